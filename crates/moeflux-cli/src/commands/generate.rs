//! `moeflux generate -m DIR --prompt-tokens 1,2,3 -n 16 --temp 0 --print-token-ids`

use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{Result, bail};
use moeflux::model::argmax;

use super::{ModelArgs, parse_tokens};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt as token ids, comma separated (optional with --load-state:
    /// appended to the loaded session).
    #[arg(long)]
    prompt_tokens: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 16)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Print the generated token ids.
    #[arg(long)]
    print_token_ids: bool,
    /// Continue the session saved in this file (by --save-state).
    #[arg(long)]
    load_state: Option<PathBuf>,
    /// Save the session (prompt and generated tokens) to this file at the end.
    #[arg(long)]
    save_state: Option<PathBuf>,
    /// Print expert-store statistics to stderr at the end.
    #[arg(long)]
    stats: bool,
}

pub fn run(args: Args) -> Result<()> {
    if args.temp != 0.0 {
        bail!("--temp: only greedy decoding (--temp 0) is available in this build");
    }
    let prompt = match &args.prompt_tokens {
        Some(text) => parse_tokens("--prompt-tokens", text)?,
        None if args.load_state.is_some() => Vec::new(),
        None => bail!("--prompt-tokens: required (unless --load-state continues a saved session)"),
    };
    let model = args.model.open()?;
    let mut session = model.session();
    if let Some(path) = &args.load_state {
        session.load_state_file(path)?;
    }
    if args.prompt_tokens.is_some() {
        session.prefill(&prompt)?;
    }
    let ids = session.generate(
        args.max_tokens,
        |logits, _| argmax(logits),
        |_| ControlFlow::Continue(()),
    )?;
    // Without a tokenizer the ids are the output, so they are printed
    // whether or not --print-token-ids is given.
    let _ = args.print_token_ids;
    println!(
        "{}",
        ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
    );
    if let Some(path) = &args.save_state {
        session.save_state_file(path)?;
    }
    if args.stats {
        let s = model.expert_stats();
        eprintln!(
            "experts: {} hits, {} misses, {} read",
            s.hits,
            s.misses,
            moeflux::util::human_bytes(s.bytes_read)
        );
    }
    Ok(())
}
