//! The engine through the library's API, one test binary: batches, the
//! bundled model, prefill against decode, conversion's precision, the
//! expert store, the input formats (FP8, GGUF, MLX, MXFP4) and their
//! fuzzed headers, KV cache types, the multi-token-prediction head,
//! sessions, and speculative decoding. One binary links the library once
//! instead of once per file. The per-kernel tests (`tests/backend_ops.rs`),
//! the transformers fixtures (`tests/transformers_parity.rs`) and the CUDA
//! suite (`tests/cuda.rs`) stay binaries of their own, to be run by name.

#[path = "../common/mod.rs"]
mod common;
#[path = "../format_support/mod.rs"]
mod format_support;

mod batched;
mod bundled_model;
mod decode_consistency;
mod expert_precision;
mod expert_store;
mod format_fp8;
mod format_gguf;
mod format_mlx;
mod format_mxfp4;
mod fuzz_headers;
mod kv_types;
mod mtp;
mod sessions;
mod speculative;
