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
use moeflux::backend::Backend;
use moeflux::experts::{CachePolicy, IoMode, Prefetch};
use moeflux::util::human_bytes;
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
    /// Expert cache replacement policy.
    #[arg(long, value_enum, default_value = "lfu")]
    pub cache_policy: CachePolicyArg,
    /// How expert files are read: direct bypasses the page cache (auto: direct
    /// when the experts exceed 3/4 of memory).
    #[arg(long, value_enum, default_value = "auto")]
    pub io: IoArg,
    /// Which experts to read ahead during decode.
    #[arg(long, value_enum, default_value = "router")]
    pub prefetch: PrefetchArg,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum CachePolicyArg {
    Lru,
    Lfu,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum IoArg {
    Auto,
    Direct,
    Buffered,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum PrefetchArg {
    Off,
    Router,
    PreviousToken,
}

impl ModelArgs {
    pub fn open(&self) -> Result<Arc<Model>> {
        let options = ModelOptions {
            expert_cache_bytes: self.expert_cache_mb.map(|mb| mb << 20),
            cache_policy: match self.cache_policy {
                CachePolicyArg::Lru => CachePolicy::Lru,
                CachePolicyArg::Lfu => CachePolicy::Lfu,
            },
            io: match self.io {
                IoArg::Auto => IoMode::Auto,
                IoArg::Direct => IoMode::Direct,
                IoArg::Buffered => IoMode::Buffered,
            },
            prefetch: match self.prefetch {
                PrefetchArg::Off => Prefetch::Off,
                PrefetchArg::Router => Prefetch::Router,
                PrefetchArg::PreviousToken => Prefetch::PreviousToken,
            },
            prefill_chunk: self.prefill_chunk,
            verify_checksums: !self.no_verify,
            kv_limit_bytes: None,
        };
        let model = Model::open(&self.model, &options)?;
        let manifest = model.dir().manifest();
        let experts = model.experts();
        eprintln!(
            "moeflux: {} ({}, {}{}) on {}; expert cache {} of {} ({:?}, {} reads, prefetch {:?})",
            self.model.display(),
            model.config().architecture.name(),
            manifest.quantization.name(),
            if manifest.synthetic {
                ", synthetic: random weights"
            } else {
                ""
            },
            model.backend().name(),
            human_bytes(experts.cache_budget()),
            human_bytes(manifest.expert_bytes()),
            experts.cache_policy(),
            if experts.direct_io() {
                "direct"
            } else {
                "buffered"
            },
            options.prefetch,
        );
        Ok(Arc::new(model))
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
