//! One module per subcommand, plus the options they share.

pub mod bench;
pub mod chat;
pub mod convert;
pub mod generate;
pub mod inspect;
pub mod logits;
pub mod perplexity;
pub mod synth;
pub mod text;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use moeflux::backend::Backend;
use moeflux::experts::{CachePolicy, IoMode, Prefetch};
use moeflux::sampling::{Sampler, SamplerConfig};
use moeflux::util::human_bytes;
use moeflux::{Model, ModelOptions};

/// Options for opening a model directory.
#[derive(clap::Args)]
pub struct ModelArgs {
    /// A moeflux model directory (made by `moeflux convert`); default: the
    /// bundled tiny model, converted into the cache on first use.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
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
    /// Which experts to read ahead during decode (router: the next layer's
    /// router on this layer's input; previous-token: what the next layer
    /// used last time).
    #[arg(long, value_enum, default_value = "off")]
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
    /// Opens the model, printing a one-line description to stderr unless
    /// `quiet`.
    pub fn open(&self, quiet: bool) -> Result<Arc<Model>> {
        let dir = match &self.model {
            Some(dir) => dir.clone(),
            None => crate::bundled::default_model_dir(quiet)?,
        };
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
        let model = Model::open(&dir, &options)?;
        let manifest = model.dir().manifest();
        let experts = model.experts();
        if !quiet {
            eprintln!(
                "moeflux: {} ({}, {}{}) on {}; expert cache {} of {} ({:?}, {} reads, prefetch {:?})",
                dir.display(),
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
        }
        Ok(Arc::new(model))
    }
}

/// Sampling and stopping, with the model's `generation_config.json` as the
/// default for every flag not given.
#[derive(clap::Args)]
pub struct SamplingArgs {
    /// Temperature; 0 picks the most likely token (greedy).
    #[arg(long)]
    pub temp: Option<f32>,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Keep the most likely tokens whose probabilities add up to p (1: off).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than min-p times the most likely (0: off).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Penalise tokens already in the prompt or output (1: off).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Subtract from the logit of every token already generated (0: off).
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    /// Subtract per time a token was generated (0: off).
    #[arg(long)]
    pub frequency_penalty: Option<f32>,
    /// Seed of the random draws (reported at the end when not given).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this text appears (repeatable); the model's end-of-text
    /// tokens always stop.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    pub fn sampler(&self, model_dir: &std::path::Path) -> Result<Sampler> {
        let mut c = SamplerConfig::from_generation_config(model_dir)?;
        let set = |slot: &mut f32, v: Option<f32>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut c.temperature, self.temp);
        set(&mut c.top_p, self.top_p);
        set(&mut c.min_p, self.min_p);
        set(&mut c.repetition_penalty, self.repetition_penalty);
        set(&mut c.presence_penalty, self.presence_penalty);
        set(&mut c.frequency_penalty, self.frequency_penalty);
        if let Some(k) = self.top_k {
            c.top_k = k;
        }
        c.seed = self.seed.or(c.seed);
        Ok(Sampler::new(c)?)
    }
}

/// Expert-store counters since the model was opened, to stderr.
pub fn print_expert_stats(model: &Model) {
    let s = model.expert_stats();
    let rate = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v));
    eprintln!(
        "experts: {} hits, {} waits on prefetch, {} misses ({:.1}% hit rate); {} read{}; {} prefetched; prediction router {} / previous token {}",
        s.hits,
        s.prefetch_waits,
        s.misses,
        100.0 * s.hit_rate(),
        human_bytes(s.bytes_read),
        if s.read_nanos > 0 {
            format!(" at {:.2} GB/s", s.bytes_read as f64 / s.read_nanos as f64)
        } else {
            String::new()
        },
        s.prefetches_issued,
        rate(s.router_prediction_rate()),
        rate(s.previous_token_prediction_rate()),
    );
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
