//! Reading safetensors checkpoints: one file or shards listed by
//! `model.safetensors.index.json`, memory-mapped so a checkpoint larger
//! than RAM is read tensor by tensor.
//!
//! Besides bf16, f16 and f32 tensors, two quantized encodings are read,
//! recognised by their content:
//!
//! - **FP8** (DeepSeek-V3, Qwen3-*-FP8): a `float8_e4m3fn` `weight` with a
//!   `weight_scale_inv` of one scale per block (`quantization_config`'s
//!   `weight_block_size`, 128×128 by default; a single value scales the
//!   whole tensor). A weight is `e4m3 × scale_inv`, computed in f32.
//! - **MLX** affine quantization (mlx-community): a `uint32` `weight`
//!   packing `bits`-wide codes lowest bits first, with `scales` and
//!   `biases` per group of `group_size` inputs (config.json's
//!   `quantization`, per-layer entries overriding the default). A weight is
//!   `q × scale + bias`, moeflux's own q4/q8 scheme: 4- and 8-bit groups of
//!   64 with bf16 scales are copied without re-quantization.
//!
//! - **MXFP4** (gpt-oss's experts): a `uint8` `{name}_blocks`
//!   `[..., groups, 16]` of e2m1 values, two per byte (low nibble first),
//!   with a `uint8` `{name}_scales` `[..., groups]` of power-of-two
//!   exponents biased by 127, one per group of 32. Presented as the tensor
//!   `{name}_blocks` of shape `[..., groups · 32]`; a weight is
//!   `e2m1 × 2^(scale − 127)`, exact in f32.
//!
//! MLX checkpoints also name tensors their own way (routed experts stacked
//! in `switch_mlp`, Qwen3.5's `language_model.model.` prefix, the
//! convolution as `[channels, kernel, 1]`, `1 + w` norms for the Qwen3-Next
//! family); opening presents them under the Hugging Face names the
//! architecture plans expect.

mod decode;
mod names;
mod quantized;
mod shards;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::TensorInfo;

use super::plan::CheckpointIndex;
use super::view::Views;
use crate::error::{Error, Result};
use names::hf_views;
use quantized::{QuantConfig, attach_companions};
pub use shards::validate_safetensors;
use shards::{check_index_agrees, open_shard, shard_files};

struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Byte offset of the data section (after the JSON header).
    data_start: usize,
    tensors: BTreeMap<String, TensorInfo>,
}

/// How a stored tensor's values are encoded.
#[derive(Clone, Debug)]
enum Encoding {
    /// bf16, f16 or f32.
    Plain,
    /// float8_e4m3fn times a scale per `block` (the whole tensor when the
    /// scale has one value).
    Fp8 { scale: String, block: [usize; 2] },
    /// MLX affine groups: codes packed in u32, scales and biases per group.
    Mlx {
        scales: String,
        biases: String,
        bits: usize,
        group: usize,
    },
    /// MXFP4: e2m1 pairs per byte, an exponent byte per 32 values.
    Mxfp4 { scales: String },
}

/// A weight as the checkpoint stores it, its companion tensors (FP8 scales,
/// MLX scales and biases) attached.
#[derive(Clone, Debug)]
struct Stored {
    shard: usize,
    /// The shape of the values (an MLX weight's unpacked shape).
    shape: Vec<usize>,
    encoding: Encoding,
}

/// The tensors of a safetensors checkpoint.
pub struct Checkpoint {
    shards: Vec<Shard>,
    stored: BTreeMap<String, Stored>,
}

/// Opens the checkpoint folder `dir` whose `config.json` is `config`: its
/// tensors under the names and shapes the architecture plans expect.
pub(crate) fn open(
    dir: &Path,
    config: &serde_json::Value,
) -> Result<(Views<Checkpoint>, CheckpointIndex)> {
    let files = shard_files(dir)?;
    let mut shards = Vec::with_capacity(files.len());
    let mut raw: BTreeMap<String, usize> = BTreeMap::new();
    for (i, path) in files.iter().enumerate() {
        let shard = open_shard(path)?;
        for name in shard.tensors.keys() {
            if let Some(prev) = raw.insert(name.clone(), i) {
                return Err(Error::tensor(
                    path,
                    name,
                    format!("also present in {}", files[prev].display()),
                ));
            }
        }
        shards.push(shard);
    }
    check_index_agrees(dir, &shards)?;
    let quant = QuantConfig::read(dir, config)?;
    let stored = attach_companions(&shards, &raw, &quant)?;
    let ckpt = Checkpoint { shards, stored };
    let views = hf_views(&ckpt.stored);
    let source = Views::new(ckpt, views, dir);
    let index = source.index(files, |t| source.store.stored[t].shard);
    Ok((source, index))
}
