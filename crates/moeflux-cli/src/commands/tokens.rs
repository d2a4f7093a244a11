//! `moeflux tokenize` and `moeflux detokenize`: the model's tokenizer
//! alone, no weights read.

use std::path::PathBuf;

use anyhow::{Result, bail};
use moeflux::text::Tokenizer;
use serde_json::json;

use super::{ModelPath, parse_tokens, read_text};

#[derive(clap::Args)]
pub struct TokenizeArgs {
    #[command(flatten)]
    model: ModelPath,
    /// The text to tokenize.
    #[arg(short = 'p', long, conflicts_with = "file")]
    prompt: Option<String>,
    /// Read the text from this file (`-` for standard input).
    #[arg(short = 'f', long)]
    file: Option<PathBuf>,
    /// Add the tokens the tokenizer adds around a text (a beginning-of-text
    /// token, say), as `generate -p` does.
    #[arg(long)]
    special: bool,
    /// Print each token's id and text as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct DetokenizeArgs {
    #[command(flatten)]
    model: ModelPath,
    /// Token ids, comma or space separated.
    #[arg(long)]
    tokens: String,
    /// Leave out special tokens (end of text, chat markers).
    #[arg(long)]
    skip_special: bool,
}

pub fn tokenize(args: TokenizeArgs) -> Result<()> {
    let text = match (&args.prompt, &args.file) {
        (Some(text), _) => text.clone(),
        (None, Some(path)) => read_text("-f", path)?,
        (None, None) => bail!("give the text: -p \"text\" or -f FILE"),
    };
    let files = args.model.resolve(true)?;
    let tokenizer = Tokenizer::from_dir(&files.dir)?;
    let ids = tokenizer.encode(&text, args.special)?;
    if args.json {
        let tokens: Vec<_> = ids
            .iter()
            .map(|&id| Ok(json!({"id": id, "text": tokenizer.decode(&[id], false)?})))
            .collect::<moeflux::Result<_>>()?;
        println!("{}", serde_json::to_string_pretty(&tokens)?);
    } else {
        println!(
            "{}",
            ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
        );
    }
    Ok(())
}

pub fn detokenize(args: DetokenizeArgs) -> Result<()> {
    let ids = parse_tokens("--tokens", &args.tokens)?;
    let files = args.model.resolve(true)?;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= files.config.vocab_size) {
        bail!(
            "--tokens: token id {bad} is out of range: the vocabulary has {} ids",
            files.config.vocab_size
        );
    }
    let tokenizer = Tokenizer::from_dir(&files.dir)?;
    println!("{}", tokenizer.decode(&ids, args.skip_special)?);
    Ok(())
}
