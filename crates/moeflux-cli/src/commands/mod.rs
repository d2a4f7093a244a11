//! One module per subcommand, plus the options they share.

/// Runs `$body` with `$model` bound to the opened model (an
/// `Arc<Model<B>>`) whatever its backend, so each command's logic is one
/// function generic over the backend.
macro_rules! with_model {
    ($opened:expr, |$model:ident| $body:expr) => {
        match $opened {
            $crate::commands::OpenedModel::Cpu($model) => $body,
            $crate::commands::OpenedModel::Cuda($model) => $body,
        }
    };
}

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

use anyhow::{Context, Result, bail};
use moeflux::backend::Backend;
use moeflux::backend::cpu::{Activations, CpuBackend, CpuOptions};
use moeflux::backend::cuda::{CudaBackend, CudaOptions, device_count};
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
    /// Prompt tokens processed together (default: 64 on the CPU, 512 on
    /// CUDA).
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
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
    #[arg(long, value_enum, default_value = "router")]
    pub prefetch: PrefetchArg,
    /// Where to compute: auto (the first CUDA device if there is one, else
    /// the CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: Device,
    /// Device memory for cached experts on a GPU, in MiB (default: the
    /// memory still free after loading the model, less a reserve for KV
    /// caches and activations).
    #[arg(long)]
    pub gpu_expert_cache_mb: Option<u64>,
    /// Page-locked host memory for experts streamed to a GPU, in MiB
    /// (default: a quarter of the available memory, at most the experts'
    /// size; 0 uploads from the expert cache's pageable memory).
    #[arg(long)]
    pub pinned_cache_mb: Option<u64>,
    /// How the CPU multiplies activations by q4 and q8 weights: f32 (exact)
    /// or int8 (quantized per group of 64 inputs: faster decode, slightly
    /// less accurate; see docs/PERFORMANCE.md).
    #[arg(long, value_enum, default_value = "f32")]
    pub activations: ActivationsArg,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda(usize),
}

fn parse_device(text: &str) -> Result<Device> {
    Ok(match text {
        "auto" => Device::Auto,
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        _ => match text.strip_prefix("cuda:").map(str::parse) {
            Some(Ok(ordinal)) => Device::Cuda(ordinal),
            _ => bail!("expected auto, cpu, cuda or cuda:N (N a device number)"),
        },
    })
}

/// An opened model on the backend `--device` chose; see `with_model!`.
pub enum OpenedModel {
    Cpu(Arc<Model<CpuBackend>>),
    Cuda(Arc<Model<CudaBackend>>),
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
pub enum ActivationsArg {
    F32,
    Int8,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum PrefetchArg {
    Off,
    Router,
    PreviousToken,
}

impl ModelArgs {
    /// Opens the model on the chosen device, printing a one-line
    /// description to stderr unless `quiet`.
    pub fn open(&self, quiet: bool) -> Result<OpenedModel> {
        let dir = match &self.model {
            Some(dir) => dir.clone(),
            None => moeflux::bundled::model_dir(&convert::progress_bar().quiet(quiet))?,
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
        let opened = match self.cuda_backend()? {
            Some(cuda) => {
                cuda.set_pinned_cache_bytes(self.pinned_cache_mb.map(|mb| mb << 20));
                OpenedModel::Cuda(Arc::new(Model::open_with(cuda, &dir, &options)?))
            }
            None => {
                let cpu = CpuBackend::with_options(CpuOptions {
                    activations: match self.activations {
                        ActivationsArg::F32 => Activations::F32,
                        ActivationsArg::Int8 => Activations::Int8,
                    },
                });
                OpenedModel::Cpu(Arc::new(Model::open_with(cpu, &dir, &options)?))
            }
        };
        if !quiet {
            with_model!(&opened, |model| describe(&**model, &dir, &options));
        }
        let start = std::time::Instant::now();
        with_model!(&opened, |model| model
            .prepare_experts(&crate::commands::convert::progress_bar()))?;
        if let OpenedModel::Cpu(model) = &opened {
            let experts = model.experts();
            if !quiet && experts.total_expert_bytes() <= experts.cache_budget() {
                eprintln!(
                    "moeflux: every expert in memory ({} read in {:.1} s)",
                    human_bytes(experts.total_expert_bytes()),
                    start.elapsed().as_secs_f64()
                );
            }
        }
        if let OpenedModel::Cuda(model) = &opened {
            let stats = model.backend().expert_cache_stats();
            if !quiet {
                let moe_layers = model.config().moe_layers().count() as u64;
                if stats.complete_layers == moe_layers {
                    eprintln!(
                        "moeflux: every expert resident in VRAM ({} uploaded in {:.1} s)",
                        human_bytes(stats.resident_bytes),
                        start.elapsed().as_secs_f64()
                    );
                } else {
                    eprintln!(
                        "moeflux: the experts ({}) exceed the VRAM expert budget: they stream into a VRAM cache",
                        human_bytes(model.dir().manifest().expert_bytes())
                    );
                }
            }
        }
        Ok(opened)
    }

    /// The CUDA backend `--device` asks for, or `None` for the CPU. `auto`
    /// falls back to the CPU, with a warning, when a GPU is there but
    /// unusable; `cuda` makes that an error.
    fn cuda_backend(&self) -> Result<Option<CudaBackend>> {
        let options = CudaOptions {
            expert_cache_bytes: self.gpu_expert_cache_mb.map(|mb| mb << 20),
        };
        match self.device {
            Device::Cpu => Ok(None),
            Device::Cuda(ordinal) => Ok(Some(
                CudaBackend::with_options(ordinal, options).context("--device")?,
            )),
            Device::Auto => match device_count().and_then(|n| match n {
                0 => Ok(None),
                _ => CudaBackend::with_options(0, options).map(Some),
            }) {
                Ok(backend) => Ok(backend),
                Err(e) => {
                    eprintln!(
                        "moeflux: warning: the GPU is unusable ({e}); computing on the CPU \
                         (--device cuda makes this an error, --device cpu silences it)"
                    );
                    Ok(None)
                }
            },
        }
    }
}

/// The one-line description of an opened model, to stderr.
fn describe<B: Backend>(model: &Model<B>, dir: &std::path::Path, options: &ModelOptions) {
    let manifest = model.dir().manifest();
    let experts = model.experts();
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
pub fn print_expert_stats<B: Backend>(model: &Model<B>) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse() {
        assert_eq!(parse_device("auto").unwrap(), Device::Auto);
        assert_eq!(parse_device("cpu").unwrap(), Device::Cpu);
        assert_eq!(parse_device("cuda").unwrap(), Device::Cuda(0));
        assert_eq!(parse_device("cuda:3").unwrap(), Device::Cuda(3));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            assert!(parse_device(bad).is_err(), "{bad}");
        }
    }
}
