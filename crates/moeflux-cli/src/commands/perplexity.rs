//! `moeflux perplexity -f FILE [--ctx N]`: perplexity of a text in fixed
//! windows (see `moeflux::perplexity` for the exact definition).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use moeflux::Model;
use moeflux::backend::Backend;
use moeflux::perplexity::{Perplexity, perplexity};
use moeflux::text::Tokenizer;

use super::convert::progress_bar;
use super::{ModelArgs, read_text};

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
    let text = read_text("-f", &args.file)?;
    let files = args.model.resolve(args.json)?;
    let context = files.config.max_position_embeddings;
    if args.ctx < 2 || args.ctx > context {
        bail!(
            "--ctx: {} is not between 2 and the model's context of {context}",
            args.ctx
        );
    }
    let tokens = Tokenizer::from_dir(&files.dir)?.encode(&text, false)?;
    if tokens.len() < args.ctx {
        bail!(
            "-f: {} has {} tokens, fewer than one window of --ctx {}; use a longer text or a smaller --ctx",
            args.file.display(),
            tokens.len(),
            args.ctx
        );
    }
    let opened = args.model.load(&files, args.json)?;
    let (result, seconds) = with_model!(opened, |model| score(&model, &tokens, args.ctx))?;
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

/// The tokens' perplexity and the seconds it took to compute.
fn score<B: Backend>(
    model: &Arc<Model<B>>,
    tokens: &[u32],
    ctx: usize,
) -> Result<(Perplexity, f64)> {
    let start = Instant::now();
    let result = perplexity(model, tokens, ctx, &progress_bar())?;
    Ok((result, start.elapsed().as_secs_f64()))
}
