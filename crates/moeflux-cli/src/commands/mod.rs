//! One module per subcommand, plus the options they share.

pub mod bench;
pub mod convert;
pub mod generate;
pub mod inspect;
pub mod logits;
pub mod synth;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use moeflux::{Model, ModelOptions};

/// Options for opening a model directory.
#[derive(clap::Args)]
pub struct ModelArgs {
    /// A moeflux model directory (made by `moeflux convert`).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Memory for cached experts, in MiB (default: all experts if they fit
    /// in half the available memory, else half the available memory).
    #[arg(long)]
    pub expert_cache_mb: Option<u64>,
    /// Prompt tokens processed together.
    #[arg(long, default_value_t = moeflux::model::DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Skip hashing the dense weights on open.
    #[arg(long)]
    pub no_verify: bool,
}

impl ModelArgs {
    pub fn open(&self) -> Result<Arc<Model>> {
        let options = ModelOptions {
            expert_cache_bytes: self.expert_cache_mb.map(|mb| mb << 20),
            prefill_chunk: self.prefill_chunk,
            verify_checksums: !self.no_verify,
            kv_limit_bytes: None,
        };
        Ok(Arc::new(Model::open(&self.model, &options)?))
    }
}

/// Parses `1,2,3` (commas and/or spaces) into token ids.
pub fn parse_tokens(option: &str, text: &str) -> Result<Vec<u32>> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>().with_context(|| {
                format!(
                    "{option}: `{s}` is not a token id (expected non-negative integers like 1,2,3)"
                )
            })
        })
        .collect()
}
