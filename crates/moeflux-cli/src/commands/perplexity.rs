//! `moeflux perplexity -f FILE [--ctx N]`: perplexity of a text in fixed
//! windows (see `moeflux::perplexity` for the exact definition).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use moeflux::Model;
use moeflux::backend::Backend;
use moeflux::perplexity::{Perplexity, perplexity};
use moeflux::text::Tokenizer;

use super::ModelArgs;
use super::convert::progress_bar;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The text file to score (UTF-8).
    #[arg(short = 'f', long = "file")]
    file: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let text = std::fs::read_to_string(&args.file).with_context(|| {
        format!(
            "{}: reading the text to score (must be UTF-8)",
            args.file.display()
        )
    })?;
    let opened = args.model.open(args.json)?;
    let (tokens, result, seconds) = with_model!(opened, |model| score(&model, &text, args.ctx))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        println!(
            "perplexity {:.4} over {} tokens ({} windows of {}, {} scored) in {:.1} s ({:.0} tok/s)",
            result.ppl,
            tokens.len(),
            result.windows,
            result.ctx,
            result.scored_tokens,
            seconds,
            (result.windows * result.ctx) as f64 / seconds
        );
    }
    Ok(())
}

/// The text's tokens, their perplexity and the seconds it took to compute.
fn score<B: Backend>(
    model: &Arc<Model<B>>,
    text: &str,
    ctx: usize,
) -> Result<(Vec<u32>, Perplexity, f64)> {
    let tokenizer = Tokenizer::from_dir(model.dir().root())?;
    let tokens = tokenizer.encode(text, false)?;
    let start = Instant::now();
    let result = perplexity(model, &tokens, ctx, &progress_bar())?;
    Ok((tokens, result, start.elapsed().as_secs_f64()))
}
