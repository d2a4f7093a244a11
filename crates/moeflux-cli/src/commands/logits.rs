//! `moeflux logits -m DIR --tokens 1,2,3 -o out.npy`

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use moeflux::LogitsWanted;
use npyz::WriterBuilder;

use super::{ModelArgs, parse_tokens};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Token ids, comma separated.
    #[arg(long)]
    tokens: String,
    /// Output .npy file: float32, shape [tokens, vocab].
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
}

pub fn run(args: Args) -> Result<()> {
    let tokens = parse_tokens("--tokens", &args.tokens)?;
    let files = args.model.resolve(true)?;
    if tokens.is_empty() {
        bail!("--tokens: give at least one token id");
    }
    if let Some(bad) = tokens
        .iter()
        .find(|&&t| t as usize >= files.config.vocab_size)
    {
        bail!(
            "--tokens: token id {bad} is out of range: the vocabulary has {} ids",
            files.config.vocab_size
        );
    }
    if tokens.len() > files.config.max_position_embeddings {
        bail!(
            "--tokens: {} tokens are more than the model's context of {}",
            tokens.len(),
            files.config.max_position_embeddings
        );
    }
    if args.output.is_dir() {
        bail!(
            "-o: {} is a directory; name a .npy file",
            args.output.display()
        );
    }
    let logits = with_model!(args.model.load(&files, true)?, |model| model
        .session()
        .forward(&tokens, LogitsWanted::All))?;
    write_npy(
        &args.output,
        &logits.data,
        &[logits.rows as u64, logits.vocab as u64],
    )?;
    println!(
        "wrote {}: float32 logits, shape [{}, {}] (positions, vocabulary)",
        args.output.display(),
        logits.rows,
        logits.vocab
    );
    Ok(())
}

/// Writes through a temporary file renamed into place.
fn write_npy(path: &std::path::Path, data: &[f32], shape: &[u64]) -> Result<()> {
    let tmp = path.with_extension("npy.partial");
    let result = (|| -> Result<()> {
        let file =
            std::fs::File::create(&tmp).with_context(|| format!("{}: creating", tmp.display()))?;
        let mut writer = npyz::WriteOptions::new()
            .default_dtype()
            .shape(shape)
            .writer(std::io::BufWriter::new(file))
            .begin_nd()?;
        writer.extend(data.iter().copied())?;
        writer.finish()?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("{}: renaming into place", path.display()))?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("writing {}", path.display()))
}
