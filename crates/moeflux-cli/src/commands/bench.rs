//! `moeflux bench -m DIR`: decode and prefill speed beside the machine's
//! memory and disk read bandwidth, measured in the same run.

use std::sync::Arc;

use anyhow::{Result, bail};
use moeflux::Model;
use moeflux::backend::Backend;
use moeflux::bench::{BenchOptions, BenchReport, run};
use moeflux::text::Tokenizer;
use moeflux::util::human_bytes;

use super::convert::progress_bar;
use super::{DraftArgs, ModelArgs, read_text};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens before decoding.
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    /// Tokens decoded and timed.
    #[arg(short = 'n', long, default_value_t = 32)]
    decode: usize,
    /// Decode steps before timing (warms the expert cache).
    #[arg(long, default_value_t = 8)]
    warmup: usize,
    /// Tokens of the prefill measurement (0 skips it).
    #[arg(long, default_value_t = 512)]
    prefill: usize,
    /// Skip measuring memory and disk bandwidth.
    #[arg(long)]
    no_ceilings: bool,
    /// Record expert requests and replay them against LRU and LFU at 10%,
    /// 25% and 50% of the experts.
    #[arg(long)]
    compare_policies: bool,
    /// Run on this text file (prompt from its start, decoding fed the text
    /// that follows) instead of random tokens.
    #[arg(long)]
    text: Option<std::path::PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Also decode this many sequences together (one forward pass per
    /// step over all of them) and report the aggregate speed. On a GPU,
    /// more than one tiles the q4 expert codes for the kernels of several
    /// tokens, which every figure of the run then reads (see
    /// docs/PERFORMANCE.md).
    #[arg(long, visible_alias = "batch", default_value_t = 1)]
    sequences: usize,
    /// Also time speculative decoding's check of this many drafted tokens
    /// against a decode step (comma separated, e.g. 1,2,3,4).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..=16))]
    check_tokens: Vec<u16>,
    /// With --draft: also generate -n greedy tokens with drafts and
    /// without, and report the speedup and expert bytes per token.
    #[command(flatten)]
    draft: DraftArgs,
    /// With --draft: rounds of drafted against plain generation, run in
    /// turns; the median round is reported.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1000))]
    draft_rounds: u16,
}

pub fn run_command(args: Args) -> Result<()> {
    let draft = args.draft.settings()?;
    if draft.is_none() && args.draft_rounds > 1 {
        bail!(
            "--draft-rounds needs --draft lookup or --draft mtp: without drafts there is nothing to compare"
        );
    }
    let text = args
        .text
        .as_ref()
        .map(|p| read_text("--text", p))
        .transpose()?;
    let mut files = args.model.resolve(false)?;
    files.batched = args.sequences > 1;
    files.check_draft(draft)?;
    let text_tokens = match text {
        Some(text) => Some(Tokenizer::from_dir(&files.dir)?.encode(&text, false)?),
        None => None,
    };
    let needed = args
        .prompt_len
        .checked_add(args.warmup)
        .and_then(|n| n.checked_add(args.decode))
        .filter(|&n| n <= files.config.max_position_embeddings);
    if needed.is_none() || args.prefill > files.config.max_position_embeddings {
        bail!(
            "--prompt-len + --warmup + -n and --prefill must each fit the model's context of {} positions",
            files.config.max_position_embeddings
        );
    }
    with_model!(args.model.load(&files, false)?, |model| bench(
        &model,
        &args,
        text_tokens,
        draft
    ))
}

fn bench<B: Backend>(
    model: &Arc<Model<B>>,
    args: &Args,
    text_tokens: Option<Vec<u32>>,
    draft: Option<moeflux::speculative::DraftSettings>,
) -> Result<()> {
    let options = BenchOptions {
        prompt_tokens: args.prompt_len,
        decode_tokens: args.decode,
        warmup_tokens: args.warmup,
        prefill_tokens: args.prefill,
        ceilings: !args.no_ceilings,
        compare_policies: args.compare_policies,
        text_tokens,
        sequences: args.sequences,
        check_tokens: args.check_tokens.iter().map(|&k| k.into()).collect(),
        draft,
        draft_rounds: args.draft_rounds.into(),
    };
    let report = run(model, &options, &progress_bar())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
        if let Some(profile) = &report.cpu_profile {
            eprint!("{profile}");
        }
    }
    Ok(())
}

fn gb(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2} GB/s"))
}

/// The device's expert cache during decode, and its uploads beside the
/// pinned host-to-device bandwidth of the same run.
fn print_device_experts(r: &BenchReport, d: &moeflux::backend::DeviceExpertStats) {
    let row = |k: &str, v: String| println!("{k:<34} {v}");
    row(
        "VRAM expert cache",
        format!(
            "{} of {} used, {} complete layers; pinned host tier {} of {}",
            human_bytes(d.resident_bytes),
            d.budget_bytes.map_or("auto".into(), human_bytes),
            d.complete_layers,
            human_bytes(d.pinned_bytes),
            human_bytes(d.pinned_budget_bytes)
        ),
    );
    row(
        "VRAM expert hit rate (decode)",
        format!(
            "{:.1}% ({} hits, {} misses; {} prefetched, {} of them used)",
            100.0 * d.hit_rate(),
            d.hits,
            d.misses,
            d.prefetches,
            d.prefetch_hits
        ),
    );
    let tokens = r.decode_tokens.max(1) as u64;
    row(
        "PCIe uploads per token",
        format!(
            "{} ({:.1} experts; {} from the pinned tier, {} from the store)",
            human_bytes(d.uploaded_bytes / tokens),
            d.uploads as f64 / tokens as f64,
            d.pinned_hits,
            d.pinned_misses
        ),
    );
    if d.cpu_experts > 0 {
        let used = (d.hits + d.misses + d.cpu_experts).max(1);
        row(
            "experts computed on the CPU",
            format!(
                "{:.1} per token ({:.1}% of those used; {} read at {})",
                d.cpu_experts as f64 / tokens as f64,
                100.0 * d.cpu_experts as f64 / used as f64,
                human_bytes(d.cpu_expert_bytes / tokens),
                gb(d.cpu_gb_s())
            ),
        );
    }
    let share = match (d.copy_gb_s(), r.host_to_device_gb_s) {
        (Some(a), Some(p)) => format!(
            " = {:.0}% of pinned host-to-device bandwidth",
            100.0 * a / p
        ),
        _ => String::new(),
    };
    row(
        "PCIe throughput of uploads",
        format!("{}{share}", gb(d.copy_gb_s())),
    );
    row(
        "pinned host-to-device (measured)",
        gb(r.host_to_device_gb_s),
    );
    if d.exchanged_bytes > 0 {
        row(
            "exchanged between GPUs per token",
            human_bytes(d.exchanged_bytes / tokens),
        );
    }
}

fn print_table(r: &BenchReport) {
    let row = |k: &str, v: String| println!("{k:<34} {v}");
    row(
        "model",
        format!(
            "{} ({}{}, {}, {} layers)",
            r.model,
            r.architecture,
            if r.synthetic { ", synthetic" } else { "" },
            r.quantization,
            r.layers
        ),
    );
    row("backend", r.backend.clone());
    row(
        "KV cache",
        format!(
            "{}, {} a position",
            r.kv_type,
            human_bytes(r.kv_bytes_per_position)
        ),
    );
    row(
        "dense / expert bytes",
        format!(
            "{} / {}",
            human_bytes(r.dense_bytes),
            human_bytes(r.expert_bytes)
        ),
    );
    row(
        "expert cache",
        format!(
            "{} ({}), {} reads, prefetch: {}",
            human_bytes(r.expert_cache_bytes),
            match r.cache_policy {
                moeflux::experts::CachePolicy::Lfu => "LFU",
                moeflux::experts::CachePolicy::Lru => "LRU",
            },
            if r.direct_io { "direct" } else { "buffered" },
            match r.prefetch {
                moeflux::experts::Prefetch::Off => "off",
                moeflux::experts::Prefetch::Router => "router prediction",
                moeflux::experts::Prefetch::PreviousToken => "previous token's experts",
            }
        ),
    );
    if r.prefill_tokens > 0 {
        row(
            &format!("prefill (pp{})", r.prefill_tokens),
            format!("{:.1} tok/s", r.prefill_tok_s),
        );
    }
    row(
        &format!("time to first token ({} tokens)", r.prompt_tokens),
        format!("{:.1} ms", r.time_to_first_token_ms),
    );
    row(
        &format!(
            "decode ({} {} tokens)",
            r.decode_tokens,
            match r.decode_input {
                moeflux::bench::DecodeInput::Greedy => "greedy",
                moeflux::bench::DecodeInput::Random => "random",
                moeflux::bench::DecodeInput::Text => "text",
            }
        ),
        format!("{:.2} tok/s", r.decode_tok_s),
    );
    if let Some(b) = &r.batch {
        row(
            &format!("decode, {} sequences together", b.sequences),
            format!(
                "{:.1} tok/s in all ({:.2} ms a step of one token each, {} steps)",
                b.tok_s, b.step_ms, b.steps
            ),
        );
        let mut moved = format!(
            "{} read from disk",
            human_bytes(b.expert_bytes_read_per_token as u64)
        );
        if let Some(up) = b.device_upload_bytes_per_token {
            moved += &format!(", {} uploaded to the device", human_bytes(up as u64));
        }
        row("  expert bytes per token (batched)", moved);
        if let (Some(bytes), Some(gb_s)) = (b.union_expert_bytes_per_step, b.union_gb_s) {
            let share = r
                .memory_bandwidth_gb_s
                .map(|m| format!(" = {:.0}% of memory bandwidth", 100.0 * gb_s / m))
                .unwrap_or_default();
            row(
                "  experts chosen, union per step",
                format!(
                    "{} read at {gb_s:.1} GB/s{share}",
                    human_bytes(bytes as u64)
                ),
            );
        }
    }
    for c in &r.checks {
        row(
            &format!("check of {} drafted tokens", c.drafted),
            format!(
                "{:.3} ms = {:.2} decode steps of {:.3} ms",
                c.check_ms, c.ratio, c.decode_ms
            ),
        );
    }
    if let Some(d) = &r.drafted {
        let rounds = match d.round_speedups.len() {
            1 => String::new(),
            n => format!(
                " (median of {n} rounds: {})",
                d.round_speedups
                    .iter()
                    .map(|s| format!("{s:.2}x"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
        };
        row(
            &format!("greedy, {} tokens, drafts ({:?})", d.tokens, d.source),
            format!(
                "{:.2} tok/s against {:.2} plain = {:.2}x{rounds}; {:.1}% of {} drafts kept{}",
                d.drafted_tok_s,
                d.plain_tok_s,
                d.speedup,
                100.0 * d.drafts.acceptance(),
                d.drafts.drafted,
                if d.identical { "" } else { "; OUTPUTS DIFFER" }
            ),
        );
        row(
            "  expert bytes per token",
            format!(
                "{} drafted against {} plain",
                human_bytes(d.drafted_expert_bytes_per_token as u64),
                human_bytes(d.plain_expert_bytes_per_token as u64)
            ),
        );
    }
    row(
        "weights read per token",
        human_bytes(r.weight_bytes_per_token),
    );
    let share = r
        .memory_bandwidth_gb_s
        .map(|m| format!(" = {:.0}% of memory bandwidth", 100.0 * r.achieved_gb_s / m))
        .unwrap_or_default();
    row(
        "achieved bandwidth",
        format!("{:.2} GB/s{share}", r.achieved_gb_s),
    );
    row("memory bandwidth (measured)", gb(r.memory_bandwidth_gb_s));
    row(
        "expert hit rate (decode)",
        format!("{:.1}%", 100.0 * r.decode_expert_hit_rate),
    );
    let rate = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v));
    row(
        "prefetch prediction (router / prev)",
        format!(
            "{} / {}",
            rate(r.router_prediction_rate),
            rate(r.previous_token_prediction_rate)
        ),
    );
    row(
        "expert bytes read per token",
        human_bytes(r.decode_expert_bytes_read_per_token as u64),
    );
    let disk_share = match (r.decode_expert_read_gb_s, r.disk_read_gb_s) {
        (Some(a), Some(d)) => format!(" = {:.0}% of disk read bandwidth", 100.0 * a / d),
        _ => String::new(),
    };
    row(
        "expert read throughput (decode)",
        format!("{}{disk_share}", gb(r.decode_expert_read_gb_s)),
    );
    row(
        &format!(
            "disk read bandwidth ({} reads)",
            human_bytes(r.disk_read_block_bytes)
        ),
        gb(r.disk_read_gb_s),
    );
    if let Some(d) = &r.device_experts {
        print_device_experts(r, d);
    }
    row("peak RSS", r.peak_rss_bytes.map_or("-".into(), human_bytes));
    for p in &r.policy_comparison {
        row(
            &format!(
                "replayed hit rate {:?} @ {:.0}%",
                p.policy,
                100.0 * p.cache_share
            ),
            format!("{:.1}%", 100.0 * p.hit_rate),
        );
    }
}
