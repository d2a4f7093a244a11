//! moeflux: Mixture-of-Experts inference with the routed experts kept on
//! disk and read per token into a bounded cache.
//!
//! The crate is organised as the system is:
//!
//! - [`format`]: the model directory (manifest, dense file, expert files);
//! - [`quant`]: storage types and group-wise affine quantization;
//! - [`convert`]: Hugging Face checkpoint → model directory;
//! - [`arch`]: per-family configuration parsing and checkpoint mapping;
//! - [`blocks`]: the forward pass (attention, Gated DeltaNet, MoE, decoder),
//!   written once against [`backend::Backend`];
//! - [`backend`]: the implementations of those operations (CPU, CUDA);
//! - [`experts`]: the expert store (positional reads, cache);
//! - [`model`]: an opened model and its sessions;
//! - [`bench`]: speed measured beside the machine's ceilings;
//! - [`synth`]: random-weight models with real models' shapes;
//! - [`bundled`]: the small trained model compiled into the library.

pub mod arch;
pub mod backend;
pub mod bench;
pub mod blocks;
pub mod bundled;
pub mod config;
pub mod convert;
pub mod error;
pub mod experts;
pub mod format;
pub mod model;
pub mod perplexity;
mod platform;
pub mod quant;
pub mod sampling;
pub mod synth;
pub mod text;
pub mod util;

pub use config::ModelConfig;
pub use error::{Error, Result};
pub use model::{Logits, LogitsWanted, Model, ModelOptions, Session, SessionOptions};
