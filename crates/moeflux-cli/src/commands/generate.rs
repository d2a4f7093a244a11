//! `moeflux generate`: continue a prompt, given as text (`-p`, streamed
//! back as text) or as token ids (`--prompt-tokens`, the ids printed with
//! `--print-token-ids`).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use moeflux::Model;
use moeflux::backend::Backend;
use moeflux::text::{ChatMessage, ChatOptions, ChatTemplate, TOKENIZER_FILE, Tokenizer};

use super::text::{TextGeneration, rate};
use super::{ModelArgs, SamplingArgs, parse_tokens};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt as text.
    #[arg(short = 'p', long, conflicts_with = "prompt_tokens")]
    prompt: Option<String>,
    /// The prompt as token ids, comma separated.
    #[arg(long)]
    prompt_tokens: Option<String>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// System prompt (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 128)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print the generated token ids instead of text.
    #[arg(long)]
    print_token_ids: bool,
    /// Continue the session saved in this file (by --save-state).
    #[arg(long)]
    load_state: Option<PathBuf>,
    /// Save the session (prompt and generated tokens) to this file at the end.
    #[arg(long)]
    save_state: Option<PathBuf>,
    /// Print nothing but the generated text (or ids).
    #[arg(short, long)]
    quiet: bool,
    /// Print expert-store statistics to stderr at the end.
    #[arg(long)]
    stats: bool,
}

pub fn run(args: Args) -> Result<()> {
    if args.prompt.is_none() && args.prompt_tokens.is_none() && args.load_state.is_none() {
        bail!(
            "give a prompt: -p \"text\" or --prompt-tokens 1,2,3 (or --load-state FILE to continue)"
        );
    }
    with_model!(args.model.open(args.quiet)?, |model| generate(
        &model, &args
    ))
}

fn generate<B: Backend>(model: &Arc<Model<B>>, args: &Args) -> Result<()> {
    let dir = model.dir().root().to_path_buf();
    let mut sampler = args.sampling.sampler(&dir)?;
    let mut session = model.session();
    if let Some(path) = &args.load_state {
        session.load_state_file(path)?;
    }
    // Text in or out needs the tokenizer; ids in and out do not, and a
    // model directory without one prints ids.
    let tokenizer =
        if args.prompt.is_some() || (!args.print_token_ids && dir.join(TOKENIZER_FILE).is_file()) {
            Some(Tokenizer::from_dir(&dir)?)
        } else {
            None
        };
    let prompt = match (&args.prompt, &args.prompt_tokens) {
        (Some(text), _) => {
            let tok = tokenizer.as_ref().expect("loaded for text prompts");
            if args.chat {
                let template = ChatTemplate::from_dir(&dir, tok.special_tokens(), None)?;
                let mut messages: Vec<ChatMessage> =
                    args.system.iter().map(ChatMessage::system).collect();
                messages.push(ChatMessage::user(text));
                let options = ChatOptions {
                    add_generation_prompt: true,
                    ..Default::default()
                };
                tok.encode(&template.render(&messages, &options)?, false)?
            } else {
                tok.encode(text, true)?
            }
        }
        (None, Some(ids)) => parse_tokens("--prompt-tokens", ids)?,
        (None, None) => Vec::new(),
    };
    let start = Instant::now();
    if args.prompt.is_some() || args.prompt_tokens.is_some() {
        session.prefill(&prompt)?;
    }
    let prompt_seconds = start.elapsed().as_secs_f64();
    let mut stdout = std::io::stdout().lock();
    let generated = match &tokenizer {
        Some(tok) if !args.print_token_ids => {
            let streamed = TextGeneration {
                tokenizer: tok,
                sampler: &mut sampler,
                stop_strings: &args.sampling.stop,
                max_tokens: args.max_tokens,
                interrupt: None,
            }
            .run(&mut session, &mut stdout)?;
            writeln!(stdout)?;
            (streamed.tokens.len(), streamed.seconds)
        }
        _ => {
            let start = Instant::now();
            let stop_ids = tokenizer
                .as_ref()
                .map(|t| t.special_tokens().stop_ids.clone())
                .unwrap_or_default();
            let ids = session.generate(
                args.max_tokens,
                |logits, prompt, generated| sampler.sample(logits, prompt, generated),
                |id| {
                    Ok(match stop_ids.contains(&id) {
                        true => std::ops::ControlFlow::Break(()),
                        false => std::ops::ControlFlow::Continue(()),
                    })
                },
            )?;
            writeln!(
                stdout,
                "{}",
                ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
            )?;
            (ids.len(), start.elapsed().as_secs_f64())
        }
    };
    if let Some(path) = &args.save_state {
        session.save_state_file(path)?;
    }
    if !args.quiet {
        eprintln!(
            "prompt: {}; generation: {}",
            rate(prompt.len(), prompt_seconds),
            rate(generated.0, generated.1)
        );
        if !sampler.config().is_greedy() && args.sampling.seed.is_none() {
            eprintln!("seed: {} (pass --seed {0} to repeat)", sampler.seed());
        }
    }
    if args.stats {
        super::print_expert_stats(model);
    }
    Ok(())
}
