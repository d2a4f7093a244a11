//! The `moeflux` command line.

/// mimalloc keeps freed large blocks for reuse, where the system allocator
/// returns them to the kernel and page-faults them back in on every token
/// (logits, layer outputs).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod commands;
mod interrupt;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "moeflux",
    version,
    about = "Mixture-of-Experts inference with the experts streamed from disk"
)]
struct Cli {
    /// Worker threads (default: one per core).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert a checkpoint (Hugging Face safetensors in bf16/f16/f32 or FP8,
    /// an MLX-quantized folder, or a GGUF file) into a moeflux model directory.
    Convert(commands::convert::Args),
    /// Write the logits of every position of a token sequence to a .npy file.
    Logits(commands::logits::Args),
    /// Generate a continuation of a prompt.
    Generate(commands::generate::Args),
    /// Chat with a model (interactive, or through stdin).
    Chat(commands::chat::Args),
    /// Perplexity of a text file.
    Perplexity(commands::perplexity::Args),
    /// Describe a moeflux model directory.
    Inspect(commands::inspect::Args),
    /// Write a model with a real model's shapes and random weights.
    Synth(commands::synth::Args),
    /// Measure decode and prefill speed beside the machine's ceilings.
    Bench(commands::bench::Args),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(commands::serve::Args),
    /// Print the token ids of a text.
    Tokenize(commands::tokens::TokenizeArgs),
    /// Print the text of token ids.
    Detokenize(commands::tokens::DetokenizeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = configure_threads(cli.threads).and_then(|()| match cli.command {
        Command::Convert(args) => commands::convert::run(args),
        Command::Logits(args) => commands::logits::run(args),
        Command::Generate(args) => commands::generate::run(args),
        Command::Chat(args) => commands::chat::run(args),
        Command::Perplexity(args) => commands::perplexity::run(args),
        Command::Inspect(args) => commands::inspect::run(args),
        Command::Synth(args) => commands::synth::run(args),
        Command::Bench(args) => commands::bench::run_command(args),
        Command::Serve(args) => commands::serve::run(args),
        Command::Tokenize(args) => commands::tokens::tokenize(args),
        Command::Detokenize(args) => commands::tokens::detokenize(args),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) if matches!(err.downcast_ref(), Some(moeflux::Error::Interrupted)) => {
            eprintln!("moeflux: interrupted");
            ExitCode::from(130)
        }
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// More worker threads than any machine has cores.
const MAX_THREADS: usize = 4096;

fn configure_threads(threads: Option<usize>) -> anyhow::Result<()> {
    if let Some(n) = threads {
        anyhow::ensure!(
            (1..=MAX_THREADS).contains(&n),
            "--threads: {n} is not between 1 and {MAX_THREADS}"
        );
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .map_err(|e| anyhow::anyhow!("--threads: {e}"))?;
    }
    Ok(())
}
