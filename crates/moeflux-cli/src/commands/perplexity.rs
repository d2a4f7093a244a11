//! `moeflux perplexity -f FILE [--ctx N]`: perplexity of a text in fixed
//! windows (see `moeflux::perplexity` for the exact definition).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use moeflux::Model;
use moeflux::backend::Backend;
use moeflux::experts::RoutingCounts;
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
    /// Also count how often the router chose each expert of each layer
    /// over the text and write the counts here (JSON): what
    /// `--expert-placement` places experts over several GPUs by. Reads each
    /// layer's routing on the host, which slows a GPU down.
    #[arg(long, value_name = "FILE")]
    routing_counts: Option<PathBuf>,
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
    let (result, seconds) = with_model!(opened, |model| score(
        &model,
        &tokens,
        args.ctx,
        args.routing_counts.as_deref()
    ))?;
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

/// The tokens' perplexity and the seconds it took to compute; with
/// `routing_counts`, the router's choices written there.
fn score<B: Backend>(
    model: &Arc<Model<B>>,
    tokens: &[u32],
    ctx: usize,
    routing_counts: Option<&Path>,
) -> Result<(Perplexity, f64)> {
    let store = model.experts();
    if routing_counts.is_some() {
        store.count_routing(true);
    }
    let start = Instant::now();
    let result = perplexity(model, tokens, ctx, &progress_bar())?;
    let seconds = start.elapsed().as_secs_f64();
    if let Some(path) = routing_counts {
        let counts = store.count_routing(false).unwrap_or_default();
        RoutingCounts::new((result.windows * result.ctx) as u64, counts)
            .write(path)
            .with_context(|| format!("--routing-counts {}", path.display()))?;
    }
    Ok((result, seconds))
}
