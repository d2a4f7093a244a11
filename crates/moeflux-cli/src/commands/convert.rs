//! `moeflux convert <HF_DIR> -o <OUT> --quant q4|q8|bf16`

use std::path::PathBuf;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use moeflux::convert::{ConvertOptions, convert};
use moeflux::quant::DType;
use moeflux::util::Progress;
use moeflux::util::human_bytes;

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

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face checkpoint directory (config.json + safetensors).
    input: PathBuf,
    /// The model directory to create.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// Weight precision.
    #[arg(long, value_enum, default_value = "q4")]
    quant: Quant,
    /// Replace the output directory if it exists.
    #[arg(long)]
    force: bool,
}

/// The conversion progress bar (hidden when stderr is not a terminal).
pub struct Bar(ProgressBar);

pub fn progress_bar() -> Bar {
    Bar(ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% eta {eta}  {msg}",
        )
        .expect("valid template"),
    ))
}

impl Progress for Bar {
    fn start(&self, total: u64) {
        self.0.set_length(total);
    }
    fn advance(&self, done: u64, what: &str) {
        self.0.set_message(what.to_string());
        self.0.inc(done);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

pub fn run(args: Args) -> Result<()> {
    let quant = args.quant.dtype();
    let options = ConvertOptions {
        quant,
        overwrite: args.force,
    };
    let summary = convert(&args.input, &args.output, &options, &progress_bar())?;
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
    println!(
        "wrote {} ({}, {}): {} dense tensors ({}), {} MoE layers of experts ({})",
        args.output.display(),
        summary.config.architecture.name(),
        quant.name(),
        summary.tensors,
        human_bytes(summary.dense_bytes),
        summary.moe_layers,
        human_bytes(summary.expert_bytes)
    );
    Ok(())
}
