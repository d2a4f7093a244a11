//! `moeflux convert <INPUT> -o <OUT> --quant q4|q8|bf16|keep-nearest
//! --expert-quant q2|q3|q4|q8|bf16|mxfp4`

use std::path::PathBuf;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use moeflux::convert::{ConvertOptions, SourceOptions, convert_with};
use moeflux::quant::DType;
use moeflux::text::TOKENIZER_FILE;
use moeflux::util::Progress;
use moeflux::util::human_bytes;

/// A stored precision (convert and synth).
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Quant {
    Q4,
    Q8,
    Bf16,
}

impl Quant {
    pub fn dtype(self) -> DType {
        match self {
            Quant::Q4 => DType::Q4,
            Quant::Q8 => DType::Q8,
            Quant::Bf16 => DType::Bf16,
        }
    }
}

/// The routed experts' precision (convert and synth).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExpertQuant {
    Q2,
    Q3,
    Q4,
    Q8,
    Bf16,
    /// MXFP4 (gpt-oss's experts kept as they are; others rounded to it).
    Mxfp4,
}

impl ExpertQuant {
    pub fn dtype(self) -> DType {
        match self {
            ExpertQuant::Q2 => DType::Q2,
            ExpertQuant::Q3 => DType::Q3,
            ExpertQuant::Q4 => DType::Q4,
            ExpertQuant::Q8 => DType::Q8,
            ExpertQuant::Bf16 => DType::Bf16,
            ExpertQuant::Mxfp4 => DType::Mxfp4,
        }
    }

    /// The precision of the other matrices when `--quant` is not given:
    /// q8 beside experts below 4 bits (attention, routers and shared
    /// experts are a small part of the bytes and carry every token), else
    /// q4.
    pub fn default_rest(expert: Option<ExpertQuant>) -> DType {
        match expert {
            Some(ExpertQuant::Q2 | ExpertQuant::Q3) => DType::Q8,
            _ => DType::Q4,
        }
    }
}

/// convert's precisions: one for every matrix, or each matrix's nearest.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum ConvertQuant {
    Q4,
    Q8,
    Bf16,
    /// Each matrix in the moeflux type closest in size to the input's
    /// (GGUF Q4_K or MLX 4-bit as q4, Q6_K, Q8_0 or FP8 as q8, bf16 as
    /// bf16).
    KeepNearest,
}

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face checkpoint directory (config.json + safetensors in
    /// bf16, f16, f32, FP8 or MLX quantization) or a GGUF file (the first
    /// of split files).
    input: PathBuf,
    /// The model directory to create.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// Weight precision of every matrix but the routed experts' (default
    /// q4; q8 when --expert-quant is q2 or q3).
    #[arg(long, value_enum)]
    quant: Option<ConvertQuant>,
    /// Precision of the routed experts (default: as --quant).
    #[arg(long, value_enum)]
    expert_quant: Option<ExpertQuant>,
    /// Replace the output directory if it exists.
    #[arg(long)]
    force: bool,
}

/// The progress bar of long work (hidden when stderr is not a terminal),
/// and its notes (`moeflux: ...` lines on stderr unless quiet).
pub struct Bar {
    bar: ProgressBar,
    quiet: bool,
}

pub fn progress_bar() -> Bar {
    Bar {
        bar: ProgressBar::new(0).with_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% eta {eta}  {msg}",
            )
            .expect("valid template"),
        ),
        quiet: false,
    }
}

impl Bar {
    /// The same bar with its notes silenced.
    pub fn quiet(mut self, quiet: bool) -> Bar {
        self.quiet = quiet;
        self
    }
}

impl Progress for Bar {
    fn start(&self, total: u64) {
        self.bar.set_length(total);
    }
    fn advance(&self, done: u64, what: &str) {
        self.bar.set_message(what.to_string());
        self.bar.inc(done);
    }
    fn finish(&self) {
        self.bar.finish_and_clear();
    }
    fn note(&self, text: &str) {
        if !self.quiet {
            self.bar.suspend(|| eprintln!("moeflux: {text}"));
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    let (quant, keep_nearest) = match args.quant {
        None => (ExpertQuant::default_rest(args.expert_quant), false),
        Some(ConvertQuant::Q4) => (DType::Q4, false),
        Some(ConvertQuant::Q8) => (DType::Q8, false),
        Some(ConvertQuant::Bf16) => (DType::Bf16, false),
        Some(ConvertQuant::KeepNearest) => (DType::Q4, true),
    };
    let expert_quant = args.expert_quant.map(ExpertQuant::dtype);
    if args.input.is_dir()
        && args.input.join("config.json").is_file()
        && !args.input.join(TOKENIZER_FILE).is_file()
    {
        eprintln!(
            "warning: {} has no {TOKENIZER_FILE}: the converted model takes and prints token ids \
             only (generate --prompt-tokens, --print-token-ids; logits); text prompts, chat, \
             tokenize and perplexity need it (copy it into the model directory later)",
            args.input.display()
        );
    }
    let interrupt = crate::interrupt::install()?;
    let options = ConvertOptions {
        quant,
        expert_quant,
        overwrite: args.force,
        cancel: Some(interrupt.flag().clone()),
    };
    interrupt.begin();
    let source = SourceOptions { keep_nearest };
    let summary = convert_with(
        &args.input,
        &args.output,
        &options,
        &source,
        &progress_bar(),
    );
    interrupt.end();
    let summary = summary?;
    let mut skipped: std::collections::BTreeMap<&str, usize> = Default::default();
    for (_, why) in &summary.skipped {
        *skipped.entry(why).or_default() += 1;
    }
    for (why, n) in skipped {
        eprintln!("note: skipped {n} tensor(s): {why}");
    }
    if !summary.unknown.is_empty() {
        eprintln!(
            "warning: {} tensor(s) not used by {}: {}{}",
            summary.unknown.len(),
            summary.config.architecture.name(),
            summary
                .unknown
                .iter()
                .take(5)
                .cloned()
                .collect::<Vec<_>>()
                .join(", "),
            if summary.unknown.len() > 5 {
                ", ..."
            } else {
                ""
            }
        );
    }
    let precision = if keep_nearest {
        format!(
            "keep-nearest, mostly {}",
            summary_quant(&args.output).unwrap_or("mixed")
        )
    } else {
        precision_label(quant, expert_quant)
    };
    println!(
        "wrote {} ({}, {}): {} dense tensors ({}), {} MoE layers of experts ({})",
        args.output.display(),
        summary.config.architecture.name(),
        precision,
        summary.tensors,
        human_bytes(summary.dense_bytes),
        summary.moe_layers,
        human_bytes(summary.expert_bytes)
    );
    Ok(())
}

/// `q4`, or `q2 experts, q8 elsewhere`.
pub fn precision_label(quant: DType, expert_quant: Option<DType>) -> String {
    match expert_quant.filter(|&e| e != quant) {
        Some(e) => format!("{} experts, {} elsewhere", e.name(), quant.name()),
        None => quant.name().to_string(),
    }
}

/// The manifest's `quantization` of a written model.
fn summary_quant(dir: &std::path::Path) -> Option<&'static str> {
    let manifest =
        moeflux::format::Manifest::read(&dir.join(moeflux::format::MANIFEST_FILE)).ok()?;
    Some(manifest.quantization.name())
}
