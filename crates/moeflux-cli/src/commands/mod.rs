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
pub mod serve;
pub mod synth;
pub mod tokens;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use moeflux::backend::cpu::{Activations, CpuBackend, CpuOptions};
use moeflux::backend::cuda::{CpuExperts, CudaBackend, CudaOptions, ExpertPlacement, device_count};
use moeflux::backend::{Backend, KvType};
use moeflux::experts::{CachePolicy, IoMode, Prefetch, RoutingCounts};
use moeflux::format::{MANIFEST_FILE, Manifest};
use moeflux::sampling::{Sampler, SamplerConfig};
use moeflux::speculative::{DraftLength, DraftSettings, DraftSource, DraftStats};
use moeflux::text::ChatOptions;
use moeflux::util::human_bytes;
use moeflux::{Model, ModelConfig, ModelOptions, Session, SessionOptions};

/// Which model directory.
#[derive(clap::Args)]
pub struct ModelPath {
    /// A moeflux model directory (made by `moeflux convert`); default: the
    /// bundled tiny model, converted into the cache on first use.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
}

impl ModelPath {
    /// Finds the model directory (converting the bundled model on first
    /// use) and reads its configuration.
    pub fn resolve(&self, quiet: bool) -> Result<ModelFiles> {
        let dir = match &self.model {
            Some(dir) => dir.clone(),
            None => moeflux::bundled::model_dir(&convert::progress_bar().quiet(quiet))?,
        };
        let manifest_path = dir.join(MANIFEST_FILE);
        if !dir.is_dir() {
            bail!(
                "{}: not a directory: pass a moeflux model directory made by `moeflux convert`",
                dir.display()
            );
        }
        let manifest = Manifest::read(&manifest_path)?;
        let config = manifest.model_config(&manifest_path)?;
        Ok(ModelFiles {
            dir,
            config,
            mtp_head: true,
            batched: false,
        })
    }
}

/// Options for opening a model directory.
#[derive(clap::Args)]
pub struct ModelArgs {
    #[command(flatten)]
    pub path: ModelPath,
    /// Memory for cached experts, in MiB, fractions allowed (default: all
    /// experts if they fit in half the available memory, else half the
    /// available memory).
    #[arg(long)]
    pub expert_cache_mb: Option<f64>,
    /// Prompt tokens processed together (default: 512 on the CPU, 2048 on
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
    /// the CPU), cpu, cuda, cuda:N, or cuda:N,M,... to divide the routed
    /// experts among several GPUs of this host (the first computes the
    /// rest; needs NCCL).
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: Device,
    /// With several GPUs: place the experts by the routing counts in this
    /// file (written by `moeflux perplexity --routing-counts FILE`), each
    /// GPU holding as many experts as the others and about as much of the
    /// traffic (default: expert e on GPU e mod the number of GPUs).
    #[arg(long, value_name = "FILE")]
    pub expert_placement: Option<PathBuf>,
    /// Device memory for cached experts on a GPU, in MiB, on each GPU where
    /// several divide the experts (default: the memory still free after
    /// loading the model, less a reserve for KV caches and activations).
    #[arg(long)]
    pub gpu_expert_cache_mb: Option<u64>,
    /// Page-locked host memory for experts streamed to a GPU (to each GPU
    /// where several divide the experts), in MiB
    /// (default: a quarter of the available memory, at most the experts'
    /// size; 0 uploads from the expert cache's pageable memory).
    #[arg(long)]
    pub pinned_cache_mb: Option<u64>,
    /// How activations meet q2, q3, q4 and q8 weights (MXFP4 always takes
    /// f32): f32 (exact) or int8 (quantized per group of 64 inputs: faster,
    /// slightly less accurate; see docs/PERFORMANCE.md). On the CPU device
    /// and for the experts the CPU computes beside a GPU: every such
    /// product but a router's. On a GPU: the q4 products of prompts (routed
    /// experts and dense matrices, not routers), on the integer tensor
    /// cores; decode steps take f32.
    #[arg(long, value_enum, default_value = "f32")]
    pub activations: ActivationsArg,
    /// On a GPU whose VRAM does not hold every expert: whether a decode
    /// step's experts missing from VRAM may be computed by the CPU from host
    /// memory (auto: the share that finishes with the GPU's uploads and
    /// kernels, found layer by layer), always when
    /// they are in host memory (all: for a GPU behind a slow link), or
    /// never (off: the GPU computes every expert, results repeat exactly
    /// from run to run).
    #[arg(long, value_enum, default_value = "auto")]
    pub cpu_experts: CpuExpertsArg,
    /// How the KV cache stores keys and values: f32 (exact), bf16 (half the
    /// bytes) or q8 (int8 with a scale per 32 values, 28% of f32's bytes);
    /// default: the device's (see docs/PERFORMANCE.md). Multi-head latent
    /// attention keeps its latent cache in f32.
    #[arg(long, value_enum)]
    pub kv_type: Option<KvTypeArg>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    /// One CUDA device, or several dividing the experts (the first holds
    /// everything else).
    Cuda(Vec<usize>),
}

fn parse_device(text: &str) -> Result<Device> {
    let expected = "expected auto, cpu, cuda, cuda:N or cuda:N,M,... (N a device number; \
                    several divide the experts among them)";
    Ok(match text {
        "auto" => Device::Auto,
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(vec![0]),
        _ => match text.strip_prefix("cuda:").map(|list| {
            list.split(',')
                .map(|n| n.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
        }) {
            Some(Ok(ordinals)) => {
                if (1..ordinals.len()).any(|i| ordinals[..i].contains(&ordinals[i])) {
                    bail!("{text}: a device is named twice");
                }
                Device::Cuda(ordinals)
            }
            _ => bail!("{expected}"),
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

impl ActivationsArg {
    fn activations(self) -> Activations {
        match self {
            ActivationsArg::F32 => Activations::F32,
            ActivationsArg::Int8 => Activations::Int8,
        }
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum CpuExpertsArg {
    Auto,
    All,
    Off,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum KvTypeArg {
    F32,
    Bf16,
    Q8,
}

impl KvTypeArg {
    pub fn kv_type(self) -> KvType {
        match self {
            KvTypeArg::F32 => KvType::F32,
            KvTypeArg::Bf16 => KvType::Bf16,
            KvTypeArg::Q8 => KvType::Q8,
        }
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum PrefetchArg {
    Off,
    Router,
    PreviousToken,
}

/// A model directory found and its configuration read, weights not yet
/// touched: what the options and files a command was given are checked
/// against before the (possibly long) load.
pub struct ModelFiles {
    pub dir: PathBuf,
    pub config: ModelConfig,
    /// Whether opening it opens its multi-token-prediction head (where it
    /// has one): only for `--draft mtp` in the commands that draft.
    pub mtp_head: bool,
    /// Whether the command's steps run several tokens together: several
    /// sequences (`serve`, `bench --sequences`) or drafted tokens checked
    /// (`--draft`). On a GPU its q4 expert codes are then tiled for the
    /// kernels of several tokens (+12% at 16 sequences on an H100), else
    /// kept row by row, which one token's decode reads 2% faster
    /// (`MOEFLUX_CUDA_TILED_EXPERTS` decides either way when set).
    pub batched: bool,
}

impl ModelFiles {
    /// Checks that the model can draft as `--draft` asks (`mtp` needs a
    /// multi-token-prediction head), and opens the head only for it.
    pub fn check_draft(&mut self, draft: Option<DraftSettings>) -> Result<()> {
        let mtp = draft.is_some_and(|d| d.source == DraftSource::Mtp);
        if mtp && self.config.mtp.is_none() {
            return Err(moeflux::speculative::missing_mtp_head(&self.dir).into());
        }
        self.mtp_head = mtp;
        self.batched |= draft.is_some();
        Ok(())
    }

    /// Checks `--ctx` against the model's context.
    pub fn check_context(&self, ctx: Option<usize>) -> Result<()> {
        let model = self.config.max_position_embeddings;
        match ctx {
            Some(0) => bail!("--ctx: must be at least 1"),
            Some(n) if n > model => {
                bail!("--ctx: {n} is more than the model's context of {model} positions")
            }
            _ => Ok(()),
        }
    }
}

/// `MiB` from an option, as bytes, refusing sizes beyond any memory.
fn mebibytes(option: &str, mb: Option<u64>) -> Result<Option<u64>> {
    mb.map(|mb| {
        mb.checked_mul(1 << 20)
            .with_context(|| format!("{option}: {mb} MiB is more than any machine's memory"))
    })
    .transpose()
}

/// [`mebibytes`] of a size given with a fraction (a small model's cache).
fn fractional_mebibytes(option: &str, mb: Option<f64>) -> Result<Option<u64>> {
    mb.map(|mb| {
        let bytes = mb * (1u64 << 20) as f64;
        match mb.is_finite() && mb >= 0.0 && bytes < u64::MAX as f64 {
            true => Ok(bytes as u64),
            false => bail!("{option}: {mb} MiB is not a size in memory: give a number from 0"),
        }
    })
    .transpose()
}

impl ModelArgs {
    /// Finds the model directory (converting the bundled model on first
    /// use) and reads its configuration; checks the model options.
    pub fn resolve(&self, quiet: bool) -> Result<ModelFiles> {
        fractional_mebibytes("--expert-cache-mb", self.expert_cache_mb)?;
        mebibytes("--gpu-expert-cache-mb", self.gpu_expert_cache_mb)?;
        mebibytes("--pinned-cache-mb", self.pinned_cache_mb)?;
        if self.prefill_chunk == Some(0) {
            bail!("--prefill-chunk: must be at least 1");
        }
        self.path.resolve(quiet)
    }

    /// Opens the model on the chosen device, printing a one-line
    /// description to stderr unless `quiet`, and readies its experts.
    pub fn load(&self, files: &ModelFiles, quiet: bool) -> Result<OpenedModel> {
        let dir = &files.dir;
        let options = ModelOptions {
            expert_cache_bytes: fractional_mebibytes("--expert-cache-mb", self.expert_cache_mb)?,
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
            mtp_head: files.mtp_head,
            kv_limit_bytes: None,
            kv_type: self.kv_type.map(KvTypeArg::kv_type),
        };
        let counts = match &self.expert_placement {
            Some(path) => Some(RoutingCounts::read(path, &files.config)?),
            None => None,
        };
        if counts.is_some() && !matches!(&self.device, Device::Cuda(gpus) if gpus.len() > 1) {
            bail!(
                "--expert-placement: places experts over several GPUs; name them with \
                 --device cuda:0,1,..."
            );
        }
        let opened = match self.cuda_backend(counts.as_ref(), files.batched)? {
            Some(cuda) => {
                cuda.set_pinned_cache_bytes(mebibytes("--pinned-cache-mb", self.pinned_cache_mb)?);
                OpenedModel::Cuda(Arc::new(Model::open_with(cuda, dir, &options)?))
            }
            None => {
                let cpu = CpuBackend::with_options(CpuOptions {
                    activations: self.activations.activations(),
                    ..CpuOptions::default()
                });
                OpenedModel::Cpu(Arc::new(Model::open_with(cpu, dir, &options)?))
            }
        };
        if !quiet {
            with_model!(&opened, |model| describe(&**model, dir, &options));
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
                let moe_layers = model.config().expert_layers().count() as u64;
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
    fn cuda_backend(
        &self,
        counts: Option<&RoutingCounts>,
        batched: bool,
    ) -> Result<Option<CudaBackend>> {
        let options = CudaOptions {
            tiled_experts: Some(moeflux::tuning::cuda_tiled_experts().unwrap_or(batched)),
            expert_cache_bytes: self.gpu_expert_cache_mb.map(|mb| mb << 20),
            cpu_experts: match self.cpu_experts {
                CpuExpertsArg::Auto => CpuExperts::Auto {
                    activations: self.activations.activations(),
                },
                CpuExpertsArg::All => CpuExperts::All {
                    activations: self.activations.activations(),
                },
                CpuExpertsArg::Off => CpuExperts::Off,
            },
            activations: self.activations.activations(),
            ..CudaOptions::default()
        };
        match &self.device {
            Device::Cpu => Ok(None),
            Device::Cuda(ordinals) => Ok(Some(
                CudaBackend::on_devices(
                    ordinals,
                    options,
                    match counts {
                        Some(counts) => ExpertPlacement::balanced(ordinals.len(), &counts.layers),
                        None => ExpertPlacement::round_robin(ordinals.len()),
                    },
                )
                .context("--device")?,
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
        "moeflux: {} ({}, {}{}) on {}; expert cache {} of {} ({}, {} reads, prefetch: {}); \
         KV cache {}, {} a position",
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
        match experts.cache_policy() {
            CachePolicy::Lfu => "LFU",
            CachePolicy::Lru => "LRU",
        },
        if experts.direct_io() {
            "direct"
        } else {
            "buffered"
        },
        match options.prefetch {
            Prefetch::Off => "off",
            Prefetch::Router => "router prediction",
            Prefetch::PreviousToken => "previous token's experts",
        },
        model.kv_type(),
        human_bytes(model.kv_bytes_per_position()),
    );
}

/// A session with `--ctx` positions (default: the model's context, bounded
/// by memory), saying how many unless `quiet`.
pub fn new_session<B: Backend>(
    model: &Arc<Model<B>>,
    ctx: Option<usize>,
    quiet: bool,
) -> Session<B> {
    let context = ctx.unwrap_or_else(|| model.default_context());
    if !quiet {
        let bound = if ctx.is_some() {
            "--ctx"
        } else if context < model.config().max_position_embeddings {
            "bounded by free memory; --ctx sets it"
        } else {
            "the model's; --ctx sets it"
        };
        eprintln!(
            "moeflux: context {context} tokens ({bound}; KV cache up to {})",
            human_bytes(context as u64 * model.kv_bytes_per_position())
        );
    }
    model.session_with(SessionOptions {
        context: Some(context),
        ..SessionOptions::default()
    })
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
    /// tokens stop too, unless --ignore-eos.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Go on past the model's end-of-text tokens, to the token limit or the
    /// context's end (for measurements).
    #[arg(long)]
    pub ignore_eos: bool,
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

/// Speculative decoding: where drafts come from and how many per step.
#[derive(clap::Args)]
pub struct DraftArgs {
    /// Draft tokens and check them in one forward pass (the same output as
    /// without): `lookup` copies continuations of repeated text from the
    /// prompt and output, `mtp` uses the model's multi-token-prediction
    /// head.
    #[arg(long, value_enum, default_value_t = DraftChoice::Off)]
    pub draft: DraftChoice,
    /// Tokens drafted per step (default: adaptive, up to 6, following how
    /// many are kept).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub draft_tokens: Option<u16>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DraftChoice {
    Off,
    Lookup,
    Mtp,
}

impl DraftArgs {
    /// The settings, or `None` with drafting off; `--draft-tokens` alone is
    /// refused, as it would do nothing.
    pub fn settings(&self) -> Result<Option<DraftSettings>> {
        let source = match self.draft {
            DraftChoice::Off if self.draft_tokens.is_some() => {
                bail!(
                    "--draft-tokens sets how many tokens --draft drafts: add --draft lookup or --draft mtp"
                )
            }
            DraftChoice::Off => return Ok(None),
            DraftChoice::Lookup => DraftSource::Lookup,
            DraftChoice::Mtp => DraftSource::Mtp,
        };
        let length = match self.draft_tokens {
            Some(k) => DraftLength::Fixed(k.into()),
            None => DraftLength::DEFAULT,
        };
        Ok(Some(DraftSettings { source, length }))
    }
}

/// Drafting's outcome, to stderr.
pub fn print_draft_stats(stats: &DraftStats) {
    eprintln!(
        "drafts: {} of {} kept ({:.1}%), {} checks",
        stats.accepted,
        stats.drafted,
        100.0 * stats.acceptance(),
        stats.checks
    );
}

/// How a conversation is rendered with the model's chat template.
#[derive(clap::Args)]
pub struct TemplateArgs {
    /// System prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Turn the template's thinking mode on (Qwen3 `enable_thinking`).
    #[arg(long, conflicts_with = "no_think")]
    pub think: bool,
    /// Turn the template's thinking mode off.
    #[arg(long)]
    pub no_think: bool,
}

impl TemplateArgs {
    pub fn given(&self) -> bool {
        self.system.is_some() || self.think || self.no_think
    }

    /// Rendering options ending with the assistant's turn.
    pub fn options(&self) -> ChatOptions {
        let mut options = ChatOptions {
            add_generation_prompt: true,
            ..ChatOptions::default()
        };
        if self.think || self.no_think {
            options
                .extra
                .insert("enable_thinking".into(), self.think.into());
        }
        options
    }
}

/// A UTF-8 text file named by `option` (`-`: standard input).
pub fn read_text(option: &str, path: &std::path::Path) -> Result<String> {
    if path == std::path::Path::new("-") {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
            .with_context(|| format!("{option}: reading standard input (must be UTF-8)"))?;
        return Ok(text);
    }
    std::fs::read_to_string(path)
        .with_context(|| format!("{option}: {}: reading (must be UTF-8 text)", path.display()))
}

/// `N tokens in S s (R tok/s)`.
pub fn rate(tokens: usize, seconds: f64) -> String {
    format!(
        "{tokens} tokens in {seconds:.2} s ({:.1} tok/s)",
        tokens as f64 / seconds.max(1e-9)
    )
}

/// Expert-store counters since the model was opened, to stderr, as an
/// aligned table.
pub fn print_expert_stats<B: Backend>(model: &Model<B>) {
    let s = model.expert_stats();
    let rate = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v));
    let rows = [
        (
            "expert cache",
            format!(
                "{:.1}% hit rate: {} hits, {} waited on a read ahead, {} misses",
                100.0 * s.hit_rate(),
                s.hits,
                s.prefetch_waits,
                s.misses
            ),
        ),
        (
            "read from disk",
            format!(
                "{}{}",
                human_bytes(s.bytes_read),
                if s.read_nanos > 0 {
                    format!(" at {:.2} GB/s", s.bytes_read as f64 / s.read_nanos as f64)
                } else {
                    String::new()
                }
            ),
        ),
        ("read ahead", format!("{} experts", s.prefetches_issued)),
        (
            "predictions right",
            format!(
                "router {}, previous token {}",
                rate(s.router_prediction_rate()),
                rate(s.previous_token_prediction_rate())
            ),
        ),
    ];
    for (k, v) in rows {
        eprintln!("{k:<18} {v}");
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
