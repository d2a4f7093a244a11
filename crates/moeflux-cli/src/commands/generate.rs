//! `moeflux generate -m DIR --prompt-tokens 1,2,3 -n 16 --temp 0 --print-token-ids`

use anyhow::{Result, bail};

use super::{ModelArgs, parse_tokens};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt as token ids, comma separated.
    #[arg(long)]
    prompt_tokens: String,
    /// Tokens to generate.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 16)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Print the generated token ids.
    #[arg(long)]
    print_token_ids: bool,
    /// Print expert-store statistics to stderr at the end.
    #[arg(long)]
    stats: bool,
}

pub fn run(args: Args) -> Result<()> {
    if args.temp != 0.0 {
        bail!("--temp: only greedy decoding (--temp 0) is available in this build");
    }
    let prompt = parse_tokens("--prompt-tokens", &args.prompt_tokens)?;
    let model = args.model.open()?;
    let ids = model.generate_greedy(&prompt, args.max_tokens)?;
    // Without a tokenizer the ids are the output, so they are printed
    // whether or not --print-token-ids is given.
    let _ = args.print_token_ids;
    println!(
        "{}",
        ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
    );
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
