//! moeflux: Mixture-of-Experts inference with the routed experts kept on
//! disk and read per token into a bounded cache.
//!
//! # Quick start
//!
//! Open a model directory with [`Model::open`] and continue a prompt with
//! [`text::complete`]. The small model compiled into the library
//! ([`bundled`]) gives a real model to run with nothing downloaded:
//!
//! ```
//! use std::sync::Arc;
//! use moeflux::text::{Completion, complete};
//! use moeflux::{Model, ModelOptions};
//!
//! // Converted into the cache on first use, then reused.
//! let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
//! let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
//!
//! let out = complete(&model, &Completion::new("It is a truth universally acknowledged,", 8))?;
//! assert!(out.tokens.len() <= 8);
//! assert!(!out.text.is_empty());
//! println!("{}", out.text);
//! # Ok::<(), moeflux::Error>(())
//! ```
//!
//! A model directory is what [`convert::convert`] (or `moeflux convert`)
//! makes of a Hugging Face checkpoint.
//!
//! # Tokens in, tokens out
//!
//! Below [`text::complete`], a [`Session`] holds one token sequence and its
//! state; [`Session::prefill`] appends a prompt, [`Session::generate`] (or
//! [`Session::decode`], one token at a time) continues it, choosing tokens
//! with a [`sampling::Sampler`]. [`text::Tokenizer`] turns text into ids
//! and back, and [`text::ChatTemplate`] renders conversations.
//!
//! ```
//! # use std::sync::Arc;
//! # use moeflux::{Model, ModelOptions};
//! use std::ops::ControlFlow;
//! use moeflux::sampling::{Sampler, SamplerConfig};
//! use moeflux::text::Tokenizer;
//!
//! # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
//! # let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
//! let tokenizer = Tokenizer::from_dir(&dir)?;
//! let mut sampler = Sampler::new(SamplerConfig::from_generation_config(&dir)?)?;
//!
//! let mut session = model.session();
//! session.prefill(&tokenizer.encode("The weather was", true)?)?;
//! let new = session.generate(
//!     5,
//!     |logits, prompt, generated| sampler.sample(logits, prompt, generated),
//!     |_token| Ok(ControlFlow::Continue(())),
//! )?;
//! println!("{}", tokenizer.decode(&new, true)?);
//! assert!(new.len() <= 5);
//! # Ok::<(), moeflux::Error>(())
//! ```
//!
//! # Modules
//!
//! The crate is organised as the system is:
//!
//! - [`mod@format`]: the model directory (manifest, dense file, expert files);
//! - [`quant`]: storage types and group-wise affine quantization;
//! - [`convert`]: Hugging Face checkpoint → model directory;
//! - [`arch`]: per-family configuration parsing and checkpoint mapping;
//! - [`blocks`]: the forward pass (attention, Gated DeltaNet, MoE, decoder),
//!   written once against [`backend::Backend`];
//! - [`backend`]: the implementations of those operations (CPU, CUDA);
//! - [`experts`]: the expert store (positional reads, cache);
//! - [`model`]: an opened model and its sessions;
//! - [`sampling`]: choosing the next token, and when to stop;
//! - [`speculative`]: drafted tokens checked in one forward pass;
//! - [`text`]: tokenizer, chat templates, streamed text generation;
//! - [`perplexity`]: perplexity over a text in fixed windows;
//! - [`mod@bench`]: speed measured beside the machine's ceilings;
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
pub mod rope;
pub mod sampling;
pub mod speculative;
pub mod synth;
pub mod text;
pub mod tuning;
pub mod util;

pub use backend::HostValues;
pub use config::ModelConfig;
pub use error::{Error, Result};
pub use model::{
    BatchItem, Logits, LogitsWanted, Model, ModelOptions, Phase, RewindPoint, Session,
    SessionOptions, forward_batch,
};
