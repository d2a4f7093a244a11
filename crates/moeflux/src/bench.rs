//! `moeflux bench`: decode and prefill speed of a model on this machine,
//! reported beside the ceilings measured in the same run (memory read
//! bandwidth, disk read bandwidth at the expert-blob size), so every figure
//! says how close to the hardware it is.

use std::ops::ControlFlow;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use serde::Serialize;

use crate::backend::{Backend, DeviceExpertStats};
use crate::error::{Error, Result};
use crate::experts::{CachePolicy, ExpertKey, ExpertStats, Prefetch, simulate};
use crate::model::{BatchItem, LogitsWanted, Model, Phase, Session, argmax, forward_batch};
use crate::speculative::{self, DraftSettings, DraftSource, DraftStats, Speculation};
use crate::util::{AlignedBuf, Progress, SplitMix64};

#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Tokens of the prompt before decoding (also the time-to-first-token
    /// prompt).
    pub prompt_tokens: usize,
    /// Tokens decoded and timed.
    pub decode_tokens: usize,
    /// Decode steps run before timing, to warm the expert cache.
    pub warmup_tokens: usize,
    /// Tokens of the prefill measurement (pp512).
    pub prefill_tokens: usize,
    /// Measure the memory and disk ceilings too.
    pub ceilings: bool,
    /// Record the expert requests and replay them against each cache
    /// policy at several cache sizes.
    pub compare_policies: bool,
    /// Real text to run on (tokenized): prefill and prompt take its first
    /// tokens and decoding is fed the tokens that follow (teacher forcing),
    /// so routing is the model's routing on real text. Without it, prompts
    /// are random tokens and decoding is greedy (random for synthetic
    /// models).
    pub text_tokens: Option<Vec<u32>>,
    /// Also decode this many sequences together, each step one forward
    /// pass over all of them (1: only the single-sequence decode).
    pub sequences: usize,
    /// Also time checks of this many drafted tokens (forward passes over
    /// the token chosen and the drafts, then a rewind to the first), the
    /// cost of speculative decoding's verification.
    pub check_tokens: Vec<usize>,
    /// Also generate greedily with these drafts and without, from the same
    /// prompt: the speedup and expert bytes read per generated token.
    pub draft: Option<DraftSettings>,
    /// Rounds of the drafted generation against the plain one, run in
    /// turns (plain, drafted, plain, ...): a generation of a few hundred
    /// tokens takes tens of milliseconds, within a machine's noise, so the
    /// report gives the median round.
    pub draft_rounds: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            prompt_tokens: 16,
            decode_tokens: 32,
            warmup_tokens: 8,
            prefill_tokens: 512,
            sequences: 1,
            check_tokens: Vec::new(),
            draft: None,
            draft_rounds: 1,
            ceilings: true,
            compare_policies: false,
            text_tokens: None,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Decoding many sequences together, when asked for.
    pub batch: Option<BatchDecode>,
    /// Speculative decoding's checks of drafted tokens, when asked for.
    pub checks: Vec<DraftCheck>,
    /// Greedy generation with drafts against without, when asked for.
    pub drafted: Option<DraftedDecode>,
    pub model: String,
    pub architecture: String,
    pub synthetic: bool,
    pub quantization: String,
    pub layers: usize,
    pub backend: String,
    /// How the KV cache stores keys and values, and its bytes a position.
    pub kv_type: String,
    pub kv_bytes_per_position: u64,
    pub threads: usize,
    pub expert_cache_bytes: u64,
    pub cache_policy: CachePolicy,
    pub direct_io: bool,
    pub prefetch: Prefetch,
    pub expert_bytes: u64,
    pub dense_bytes: u64,

    pub prefill_tokens: usize,
    pub prefill_tok_s: f64,
    pub prompt_tokens: usize,
    pub time_to_first_token_ms: f64,
    pub decode_tokens: usize,
    pub decode_tok_s: f64,
    pub decode_input: DecodeInput,

    /// Weights read per decoded token: dense tensors (one embedding row,
    /// the whole LM head) plus the routed experts.
    pub weight_bytes_per_token: u64,
    /// `weight_bytes_per_token × decode_tok_s`.
    pub achieved_gb_s: f64,
    pub memory_bandwidth_gb_s: Option<f64>,
    pub decode_expert_hit_rate: f64,
    /// Share of decode-routed experts each predictor named in advance.
    pub router_prediction_rate: Option<f64>,
    pub previous_token_prediction_rate: Option<f64>,
    pub decode_stats: ExpertStats,
    pub decode_expert_bytes_read_per_token: f64,
    /// Expert bytes read from disk per second of read time during decode.
    pub decode_expert_read_gb_s: Option<f64>,
    pub disk_read_gb_s: Option<f64>,
    pub disk_read_block_bytes: u64,
    pub peak_rss_bytes: Option<u64>,
    /// The backend's own expert cache (a GPU's VRAM) during the timed
    /// decode: hits, misses, prefetches, bytes and time of the uploads.
    pub device_experts: Option<DeviceExpertStats>,
    /// Pinned host-to-device copy bandwidth measured in the same run: the
    /// ceiling of the uploads' throughput.
    pub host_to_device_gb_s: Option<f64>,
    /// Replayed hit rates of each cache policy (`compare_policies`).
    pub policy_comparison: Vec<PolicyHitRate>,
    /// The CPU backend's parallel regions during the timed decode, with
    /// `MOEFLUX_CPU_PROFILE` ([`crate::backend::cpu::profile`]).
    pub cpu_profile: Option<String>,
}

/// Runs the benchmark; `progress` counts timed and warm-up tokens.
pub fn run<B: Backend>(
    model: &Arc<Model<B>>,
    options: &BenchOptions,
    progress: &dyn Progress,
) -> Result<BenchReport> {
    let cfg = model.config();
    let manifest = model.dir().manifest();
    let vocab = cfg.vocab_size;
    if options.prompt_tokens == 0 || options.decode_tokens == 0 {
        return Err(Error::invalid(
            "bench",
            "prompt and decode token counts must be positive",
        ));
    }
    let steps = options.prefill_tokens
        + options.prompt_tokens
        + options.warmup_tokens
        + options.decode_tokens;
    progress.start(steps as u64);
    let needed = options
        .prefill_tokens
        .max(options.prompt_tokens + options.warmup_tokens + options.decode_tokens);
    let tokens = match &options.text_tokens {
        Some(text) if text.len() < needed => {
            return Err(Error::invalid(
                "--text",
                format!("has {} tokens; this run needs {needed}", text.len()),
            ));
        }
        Some(text) => text.clone(),
        None => random_tokens(options.prefill_tokens.max(options.prompt_tokens), vocab, 7),
    };

    let mut prefill_tok_s = 0.0;
    if options.prefill_tokens > 0 {
        let mut session = model.session();
        let start = Instant::now();
        session.prefill(&tokens[..options.prefill_tokens])?;
        prefill_tok_s = options.prefill_tokens as f64 / start.elapsed().as_secs_f64();
        progress.advance(options.prefill_tokens as u64, "prefill");
    }

    if options.compare_policies {
        model.experts().record_trace(true);
    }
    let mut session = model.session();
    let start = Instant::now();
    let mut logits = session.prefill(&tokens[..options.prompt_tokens])?;
    let ttft = start.elapsed();
    progress.advance(options.prompt_tokens as u64, "prompt");
    // Greedy decoding of random weights falls into repeating one token,
    // which would make every step route alike; a synthetic model is fed
    // random tokens instead, the streaming worst case.
    let input = match (&options.text_tokens, manifest.synthetic) {
        (Some(_), _) => DecodeInput::Text,
        (None, true) => DecodeInput::Random,
        (None, false) => DecodeInput::Greedy,
    };
    let mut feed = match input {
        DecodeInput::Text => tokens[options.prompt_tokens..].to_vec(),
        _ => random_tokens(options.warmup_tokens + options.decode_tokens, vocab, 13),
    }
    .into_iter();
    let mut next = |logits: &[f32]| match input {
        DecodeInput::Greedy => argmax(logits),
        _ => feed.next().expect("enough tokens checked above"),
    };
    for _ in 0..options.warmup_tokens {
        logits = session.decode(next(&logits))?;
        progress.advance(1, "warm-up");
    }
    let before = model.expert_stats();
    let device_before = model.backend().device_expert_stats();
    // The profile covers the timed steps alone.
    let profiling = crate::backend::cpu::profile::enabled();
    if profiling {
        crate::backend::cpu::profile::report();
    }
    let start = Instant::now();
    for _ in 0..options.decode_tokens {
        logits = session.decode(next(&logits))?;
        progress.advance(1, "decode");
    }
    let decode_time = start.elapsed();
    let cpu_profile = profiling
        .then(crate::backend::cpu::profile::report)
        .flatten();
    let stats = model.expert_stats().since(&before);
    let device_experts = match (model.backend().device_expert_stats(), device_before) {
        (Some(after), Some(before)) => Some(after.since(&before)),
        _ => None,
    };
    progress.finish();
    let policy_comparison = match model.experts().record_trace(false) {
        Some(trace) => {
            compare_policies(&trace, manifest.experts.iter().map(|e| e.num_experts).sum())
        }
        None => Vec::new(),
    };

    let batch = match options.sequences {
        0 | 1 => None,
        n => Some(batch_decode(model, options, n, vocab)?),
    };
    let decode_tok_s = options.decode_tokens as f64 / decode_time.as_secs_f64();
    let checks = options
        .check_tokens
        .iter()
        .map(|&k| draft_check(model, options, &tokens, k))
        .collect::<Result<_>>()?;
    let drafted = match options.draft {
        Some(settings) => Some(drafted_decode(model, options, &tokens, settings)?),
        None => None,
    };
    let weight_bytes_per_token = weight_bytes_per_token(model);
    let (memory_bandwidth_gb_s, disk_read_gb_s, host_to_device_gb_s) = if options.ceilings {
        (
            Some(model.backend().memory_bandwidth()?),
            disk_read_bandwidth(model)?,
            model.backend().host_to_device_bandwidth(),
        )
    } else {
        (None, None, None)
    };
    Ok(BenchReport {
        batch,
        checks,
        drafted,
        model: model.dir().root().display().to_string(),
        architecture: cfg.architecture.name().into(),
        synthetic: manifest.synthetic,
        quantization: manifest.quantization.name().into(),
        layers: cfg.num_layers(),
        backend: model.backend().name(),
        kv_type: model.kv_type().name().into(),
        kv_bytes_per_position: model.kv_bytes_per_position(),
        threads: rayon::current_num_threads(),
        expert_cache_bytes: model.expert_cache_budget(),
        cache_policy: model.experts().cache_policy(),
        direct_io: model.experts().direct_io(),
        prefetch: model.options().prefetch,
        expert_bytes: manifest.expert_bytes(),
        dense_bytes: manifest.dense_bytes(),
        prefill_tokens: options.prefill_tokens,
        prefill_tok_s,
        prompt_tokens: options.prompt_tokens,
        time_to_first_token_ms: ttft.as_secs_f64() * 1e3,
        decode_tokens: options.decode_tokens,
        decode_tok_s,
        decode_input: input,
        weight_bytes_per_token,
        achieved_gb_s: weight_bytes_per_token as f64 * decode_tok_s / 1e9,
        memory_bandwidth_gb_s,
        decode_expert_hit_rate: stats.hit_rate(),
        router_prediction_rate: stats.router_prediction_rate(),
        previous_token_prediction_rate: stats.previous_token_prediction_rate(),
        decode_stats: stats,
        decode_expert_bytes_read_per_token: stats.bytes_read as f64 / options.decode_tokens as f64,
        decode_expert_read_gb_s: (stats.read_nanos > 0)
            .then(|| stats.bytes_read as f64 / stats.read_nanos as f64),
        disk_read_gb_s,
        disk_read_block_bytes: manifest.experts.first().map_or(0, |e| e.stride),
        peak_rss_bytes: peak_rss(),
        device_experts,
        host_to_device_gb_s,
        policy_comparison,
        cpu_profile,
    })
}

/// The cost of checking `drafted` tokens against one decode step.
#[derive(Clone, Debug, Serialize)]
pub struct DraftCheck {
    pub drafted: usize,
    /// One forward pass over the chosen token and the drafts, then a rewind
    /// to the chosen token (every draft rejected: the most a check costs).
    pub check_ms: f64,
    /// One decode step of the same session, timed in the same loop.
    pub decode_ms: f64,
    /// `check_ms / decode_ms`: the drafts kept per check above this, plus
    /// one, is what speculative decoding gains.
    pub ratio: f64,
}

/// Alternates checks of `drafted` random tokens with plain decode steps on
/// one session after the prompt, `decode_tokens` of each.
fn draft_check<B: Backend>(
    model: &Arc<Model<B>>,
    options: &BenchOptions,
    tokens: &[u32],
    drafted: usize,
) -> Result<DraftCheck> {
    let vocab = model.config().vocab_size;
    let mut session = model.session();
    session.prefill(&tokens[..options.prompt_tokens])?;
    let mut rng = SplitMix64(29 + drafted as u64);
    let mut random =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.below(vocab as u64) as u32).collect() };
    let (mut check, mut decode) = (0.0, 0.0);
    for step in 0..options.warmup_tokens + options.decode_tokens {
        let run = random(drafted + 1);
        let start = Instant::now();
        let point = session.rewind_point(run.len())?;
        let rows = session.forward_drafted(&run)?;
        let first = rows.data[..rows.vocab].to_vec();
        session.rewind(point, 1, first)?;
        let checked = start.elapsed().as_secs_f64();
        let start = Instant::now();
        session.decode(random(1)[0])?;
        if step >= options.warmup_tokens {
            check += checked;
            decode += start.elapsed().as_secs_f64();
        }
    }
    let n = options.decode_tokens as f64;
    Ok(DraftCheck {
        drafted,
        check_ms: check * 1e3 / n,
        decode_ms: decode * 1e3 / n,
        ratio: check / decode,
    })
}

/// Greedy generation with drafts against plain greedy generation.
#[derive(Clone, Debug, Serialize)]
pub struct DraftedDecode {
    pub source: DraftSource,
    pub tokens: usize,
    /// Plain and drafted speed, and their ratio, of the round whose
    /// speedup is the median.
    pub plain_tok_s: f64,
    pub drafted_tok_s: f64,
    pub speedup: f64,
    /// Every round's speedup, in the order run.
    pub round_speedups: Vec<f64>,
    pub drafts: DraftStats,
    pub plain_expert_bytes_per_token: f64,
    pub drafted_expert_bytes_per_token: f64,
    /// Whether both generated the same tokens (they must).
    pub identical: bool,
}

/// `decode_tokens` greedy tokens after the prompt, plain then drafted
/// (each after a warm-up generation of its own), from fresh sessions.
fn drafted_decode<B: Backend>(
    model: &Arc<Model<B>>,
    options: &BenchOptions,
    tokens: &[u32],
    settings: DraftSettings,
) -> Result<DraftedDecode> {
    let prompt = &tokens[..options.prompt_tokens];
    let n = options.decode_tokens;
    let greedy = |l: &[f32], _: &[u32], _: &[u32]| Ok(argmax(l));
    let go_on = |_| Ok(ControlFlow::Continue(()));
    let plain = |count: usize| -> Result<(Vec<u32>, f64, u64)> {
        let mut session = model.session();
        session.prefill(prompt)?;
        let before = model.expert_stats();
        let start = Instant::now();
        let out = session.generate(count, greedy, go_on)?;
        let bytes = model.expert_stats().since(&before).bytes_read;
        Ok((out, start.elapsed().as_secs_f64(), bytes))
    };
    let mut stats = DraftStats::default();
    let drafted = |count: usize, stats: &mut DraftStats| -> Result<(Vec<u32>, f64, u64)> {
        let mut drafter = settings.source.drafter(model)?;
        let mut speculation = Speculation::new(&mut *drafter, settings.length);
        let mut session = model.session();
        settings.source.prepare(&mut session);
        session.prefill(prompt)?;
        let before = model.expert_stats();
        let start = Instant::now();
        let out = speculative::generate(
            &mut session,
            &mut speculation,
            count,
            |l, _, _, _| Ok(argmax(l)),
            go_on,
        )?;
        let bytes = model.expert_stats().since(&before).bytes_read;
        *stats = speculation.stats;
        Ok((out, start.elapsed().as_secs_f64(), bytes))
    };
    plain(options.warmup_tokens.max(1))?;
    drafted(options.warmup_tokens.max(1), &mut stats)?;
    // (plain tok/s, drafted tok/s, speedup) per round.
    let mut rounds = Vec::with_capacity(options.draft_rounds.max(1));
    let (mut want, mut got) = (Vec::new(), Vec::new());
    let (mut plain_bytes, mut drafted_bytes) = (0, 0);
    let mut identical = true;
    for _ in 0..options.draft_rounds.max(1) {
        let (plain_out, plain_s, p_bytes) = plain(n)?;
        let (drafted_out, drafted_s, d_bytes) = drafted(n, &mut stats)?;
        identical &= plain_out == drafted_out;
        let plain_tok_s = plain_out.len() as f64 / plain_s;
        let drafted_tok_s = drafted_out.len() as f64 / drafted_s;
        rounds.push((plain_tok_s, drafted_tok_s, drafted_tok_s / plain_tok_s));
        (want, got, plain_bytes, drafted_bytes) = (plain_out, drafted_out, p_bytes, d_bytes);
    }
    let per_token = |bytes: u64, out: &[u32]| bytes as f64 / out.len().max(1) as f64;
    let mut by_speedup = rounds.clone();
    by_speedup.sort_by(|a, b| a.2.total_cmp(&b.2));
    let (plain_tok_s, drafted_tok_s, speedup) = by_speedup[by_speedup.len() / 2];
    Ok(DraftedDecode {
        source: settings.source,
        tokens: got.len(),
        plain_tok_s,
        drafted_tok_s,
        speedup,
        round_speedups: rounds.iter().map(|r| r.2).collect(),
        drafts: stats,
        plain_expert_bytes_per_token: per_token(plain_bytes, &want),
        drafted_expert_bytes_per_token: per_token(drafted_bytes, &got),
        identical,
    })
}

/// Aggregate decode of several sequences, each step one forward pass over
/// all of them.
#[derive(Clone, Debug, Serialize)]
pub struct BatchDecode {
    pub sequences: usize,
    /// Timed steps (each one token per sequence).
    pub steps: usize,
    /// Generated tokens per second, all sequences together.
    pub tok_s: f64,
    pub step_ms: f64,
    /// Expert bytes read from disk per generated token.
    pub expert_bytes_read_per_token: f64,
    /// Expert bytes uploaded to the device per generated token (a GPU
    /// streaming experts into its VRAM cache).
    pub device_upload_bytes_per_token: Option<f64>,
    /// The union of the experts a step's tokens chose, per step: each
    /// layer's distinct experts once (a device's count), the weights the
    /// step must read at least.
    pub union_expert_bytes_per_step: Option<f64>,
    /// `union_expert_bytes_per_step` over the time of a step, in GB/s.
    pub union_gb_s: Option<f64>,
}

/// `sequences` sessions, each prefilled with its own random prompt, warmed
/// up, then timed over `decode_tokens` batched steps fed random tokens.
fn batch_decode<B: Backend>(
    model: &Arc<Model<B>>,
    options: &BenchOptions,
    sequences: usize,
    vocab: usize,
) -> Result<BatchDecode> {
    let mut sessions: Vec<_> = (0..sequences).map(|_| model.session()).collect();
    let prompts: Vec<Vec<u32>> = (0..sequences)
        .map(|i| random_tokens(options.prompt_tokens, vocab, 101 + i as u64))
        .collect();
    let mut items: Vec<BatchItem<'_, B>> = sessions
        .iter_mut()
        .zip(&prompts)
        .map(|(session, tokens)| BatchItem {
            session,
            tokens,
            wanted: LogitsWanted::Last,
            phase: Phase::Prefill,
        })
        .collect();
    forward_batch(&mut items)?;
    let mut rng = SplitMix64(17);
    let mut step = |sessions: &mut [Session<B>]| -> Result<()> {
        let tokens: Vec<[u32; 1]> = (0..sequences)
            .map(|_| [rng.below(vocab as u64) as u32])
            .collect();
        let mut items: Vec<BatchItem<'_, B>> = sessions
            .iter_mut()
            .zip(&tokens)
            .map(|(session, t)| BatchItem {
                session,
                tokens: t,
                wanted: LogitsWanted::Last,
                phase: Phase::Decode,
            })
            .collect();
        forward_batch(&mut items).map(|_| ())
    };
    for _ in 0..options.warmup_tokens {
        step(&mut sessions)?;
    }
    let (store_before, device_before) =
        (model.expert_stats(), model.backend().device_expert_stats());
    let start = Instant::now();
    for _ in 0..options.decode_tokens {
        step(&mut sessions)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    let tokens = (sequences * options.decode_tokens) as f64;
    let read = model.expert_stats().since(&store_before).bytes_read;
    let device = match (model.backend().device_expert_stats(), device_before) {
        (Some(after), Some(before)) => Some(after.since(&before)),
        _ => None,
    };
    let uploaded = device.map(|d| d.uploaded_bytes as f64 / tokens);
    let steps = options.decode_tokens as f64;
    let union = device
        .filter(|d| d.batched_expert_bytes > 0)
        .map(|d| d.batched_expert_bytes as f64 / steps);
    Ok(BatchDecode {
        sequences,
        steps: options.decode_tokens,
        tok_s: tokens / seconds,
        step_ms: seconds * 1e3 / options.decode_tokens as f64,
        expert_bytes_read_per_token: read as f64 / tokens,
        device_upload_bytes_per_token: uploaded,
        union_expert_bytes_per_step: union,
        union_gb_s: union.map(|bytes| bytes * steps / seconds / 1e9),
    })
}

/// Hit rate of each policy replaying `trace`, with room for 10%, 25% and
/// 50% of the model's experts.
fn compare_policies(trace: &[ExpertKey], total_experts: usize) -> Vec<PolicyHitRate> {
    [0.10, 0.25, 0.50]
        .into_iter()
        .flat_map(|share| {
            let capacity = ((total_experts as f64 * share) as usize).max(1);
            [CachePolicy::Lru, CachePolicy::Lfu].map(|policy| PolicyHitRate {
                policy,
                cache_share: share,
                hit_rate: simulate(trace, policy, capacity),
            })
        })
        .collect()
}

#[derive(Clone, Debug, Serialize)]
pub struct PolicyHitRate {
    pub policy: CachePolicy,
    /// Cache size as a share of all the model's experts.
    pub cache_share: f64,
    pub hit_rate: f64,
}

/// What decoding is fed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DecodeInput {
    /// The model's own greedy choices.
    Greedy,
    /// Random tokens (synthetic models, whose greedy output repeats).
    Random,
    /// The following tokens of a real text.
    Text,
}

fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = SplitMix64(seed);
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

/// Bytes of weights one decoded token reads: every dense tensor except
/// the embedding table (one row of it), plus `top_k` experts per MoE layer.
pub fn weight_bytes_per_token<B: Backend>(model: &Model<B>) -> u64 {
    let cfg = model.config();
    let manifest = model.dir().manifest();
    let embed = &manifest.tensors[crate::arch::names::EMBED];
    let embed_row = embed.nbytes / embed.shape[0] as u64;
    let mut dense = manifest.dense_bytes() - embed.nbytes + embed_row;
    if cfg.tie_word_embeddings {
        dense += embed.nbytes; // the table is also the LM head
    }
    let experts: u64 = manifest
        .experts
        .iter()
        .map(|e| e.blob.nbytes * cfg.moe.router.top_k as u64)
        .sum();
    dense + experts
}

/// Disk read bandwidth in GB/s for random reads of one expert blob each,
/// as many at once as the engine issues, bypassing the page cache where
/// the system allows (`O_DIRECT`, `F_NOCACHE`). `None` for a model
/// without experts.
pub fn disk_read_bandwidth<B: Backend>(model: &Model<B>) -> Result<Option<f64>> {
    let manifest = model.dir().manifest();
    let Some(layer) = manifest.experts.iter().max_by_key(|e| e.num_experts) else {
        return Ok(None);
    };
    let path = model.dir().path_of(&layer.file)?;
    let file = crate::platform::open_uncached(&path)
        .map_err(|e| Error::io(&path, "opening for the disk benchmark", e))?;
    let block = layer.stride as usize;
    let reads = layer.num_experts.clamp(16, 256);
    let order = random_tokens(reads, layer.num_experts, 11);
    let next = AtomicUsize::new(0);
    let start = Instant::now();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..crate::experts::READ_PARALLELISM)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    let mut buf = AlignedBuf::zeroed(block);
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&expert) = order.get(i) else {
                            return Ok(());
                        };
                        file.read_exact_at(&mut buf, expert as u64 * layer.stride)
                            .map_err(|e| Error::io(&path, "reading for the disk benchmark", e))?;
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("reader thread"))
    })?;
    Ok(Some(
        (reads * block) as f64 / start.elapsed().as_secs_f64() / 1e9,
    ))
}

/// The process's peak resident set size in bytes (Linux `VmHWM`, macOS
/// `getrusage`).
pub fn peak_rss() -> Option<u64> {
    crate::platform::peak_rss()
}
