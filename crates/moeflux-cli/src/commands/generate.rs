//! `moeflux generate`: continue a prompt, given as text (`-p`, or `-f FILE`,
//! streamed back as text) or as token ids (`--prompt-tokens`, the ids
//! printed with `--print-token-ids`).
//!
//! Every option and file is checked before the weights are read. The
//! generation ends at the token limit, an end-of-text token, a stop
//! string, the context's end or Ctrl-C; in each case the speeds are
//! printed and `--save-state` is written (Ctrl-C exits with status 130).

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use moeflux::backend::Backend;
use moeflux::sampling::Sampler;
use moeflux::speculative::{self, DraftSettings, Speculation};
use moeflux::text::{
    ChatMessage, ChatTemplate, FinishReason, Generated, TOKENIZER_FILE, TextGeneration, Tokenizer,
};
use moeflux::{Model, Session};
use serde_json::json;

use super::{
    DraftArgs, ModelArgs, SamplingArgs, TemplateArgs, new_session, parse_tokens, rate, read_text,
};
use crate::interrupt::Interrupt;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt as text.
    #[arg(short = 'p', long, conflicts_with_all = ["prompt_tokens", "file"])]
    prompt: Option<String>,
    /// Read the prompt from this file (`-` for standard input).
    #[arg(short = 'f', long, conflicts_with = "prompt_tokens")]
    file: Option<PathBuf>,
    /// The prompt as token ids, comma separated.
    #[arg(long)]
    prompt_tokens: Option<String>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    #[command(flatten)]
    template: TemplateArgs,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 128)]
    max_tokens: usize,
    /// Positions the session holds, prompt included (default: the model's
    /// context, bounded by memory).
    #[arg(long)]
    ctx: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    draft: DraftArgs,
    /// Print the generated token ids instead of text.
    #[arg(long, conflicts_with = "json")]
    print_token_ids: bool,
    /// Print one JSON object at the end: text, token ids, finish reason,
    /// timings (and log-probabilities with --logprobs).
    #[arg(long)]
    json: bool,
    /// With --json: each token's log-probability and this many most
    /// likely alternatives.
    #[arg(long, requires = "json")]
    logprobs: Option<usize>,
    /// Continue the session saved in this file (by --save-state).
    #[arg(long)]
    load_state: Option<PathBuf>,
    /// Save the session (prompt and generated tokens) to this file at the
    /// end, however the generation ended.
    #[arg(long)]
    save_state: Option<PathBuf>,
    /// Print nothing but the generated text (or ids).
    #[arg(short, long)]
    quiet: bool,
    /// Print expert-store (and drafting) statistics to stderr at the end.
    #[arg(long)]
    stats: bool,
}

/// The inputs, checked and prepared before the model is loaded.
struct Prepared {
    sampler: Sampler,
    draft: Option<DraftSettings>,
    tokenizer: Option<Tokenizer>,
    prompt: Vec<u32>,
    state: Option<(PathBuf, Vec<u8>)>,
}

pub fn run(args: Args) -> Result<()> {
    if args.prompt.is_none()
        && args.file.is_none()
        && args.prompt_tokens.is_none()
        && args.load_state.is_none()
    {
        bail!(
            "give a prompt: -p \"text\", -f FILE or --prompt-tokens 1,2,3 \
             (or --load-state FILE to continue)"
        );
    }
    if args.chat && args.prompt_tokens.is_some() {
        bail!("--chat: wraps a text prompt (-p or -f), not --prompt-tokens");
    }
    if !args.chat && args.template.given() {
        bail!("--system, --think and --no-think apply to a chat prompt: add --chat");
    }
    let text = match (&args.prompt, &args.file) {
        (Some(text), _) => Some(text.clone()),
        (None, Some(path)) => Some(read_text("-f", path)?),
        (None, None) => None,
    };
    let draft = args.draft.settings()?;
    let quiet = args.quiet || args.json;
    let mut files = args.model.resolve(quiet)?;
    files.check_context(args.ctx)?;
    files.check_draft(draft)?;
    if let Some(path) = &args.save_state {
        check_writable("--save-state", path)?;
    }
    let state = match &args.load_state {
        Some(path) => Some((
            path.clone(),
            std::fs::read(path)
                .with_context(|| format!("--load-state: {}: reading", path.display()))?,
        )),
        None => None,
    };
    let dir = &files.dir;
    let sampler = args.sampling.sampler(dir)?;
    // Text in or out needs the tokenizer; ids in and out do not, and a
    // model directory without one prints ids.
    let wants_text = !args.print_token_ids && (args.json || dir.join(TOKENIZER_FILE).is_file());
    let tokenizer = if text.is_some() || wants_text {
        Some(Tokenizer::from_dir(dir)?)
    } else {
        None
    };
    let prompt = match (&text, &args.prompt_tokens) {
        (Some(text), _) => {
            let tok = tokenizer.as_ref().expect("loaded for text prompts");
            let ids = if args.chat {
                let template = ChatTemplate::from_dir(dir, tok.special_tokens(), None)?;
                let mut messages: Vec<ChatMessage> = args
                    .template
                    .system
                    .iter()
                    .map(ChatMessage::system)
                    .collect();
                messages.push(ChatMessage::user(text));
                tok.encode(
                    &template.render(&messages, &args.template.options())?,
                    false,
                )?
            } else {
                tok.encode(text, true)?
            };
            if ids.is_empty() {
                bail!("the prompt is empty: give some text");
            }
            ids
        }
        (None, Some(ids)) => {
            let ids = parse_tokens("--prompt-tokens", ids)?;
            if ids.is_empty() {
                bail!("--prompt-tokens: the prompt is empty: give at least one token id");
            }
            ids
        }
        (None, None) => Vec::new(),
    };
    if let Some(bad) = prompt
        .iter()
        .find(|&&t| t as usize >= files.config.vocab_size)
    {
        bail!(
            "--prompt-tokens: token id {bad} is out of range: the vocabulary has {} ids",
            files.config.vocab_size
        );
    }
    let max_prompt = args.ctx.unwrap_or(files.config.max_position_embeddings);
    if prompt.len() > max_prompt {
        bail!(
            "the prompt is {} tokens, more than the context of {max_prompt}{}",
            prompt.len(),
            if args.ctx.is_some() {
                " set by --ctx"
            } else {
                ""
            }
        );
    }
    let prepared = Prepared {
        sampler,
        draft,
        tokenizer,
        prompt,
        state,
    };
    let interrupt = crate::interrupt::install()?;
    with_model!(args.model.load(&files, quiet)?, |model| generate(
        &model, &args, prepared, interrupt
    ))
}

/// Refuses a path that cannot be written (missing folder, a directory, no
/// permission) before any work is done.
fn check_writable(option: &str, path: &Path) -> Result<()> {
    if path.is_dir() {
        bail!("{option}: {} is a directory; name a file", path.display());
    }
    let probe = path.with_extension("partial");
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&probe)
        .with_context(|| format!("{option}: {}: cannot write here", path.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

fn generate<B: Backend>(
    model: &Arc<Model<B>>,
    args: &Args,
    mut prepared: Prepared,
    interrupt: &Interrupt,
) -> Result<()> {
    let quiet = args.quiet || args.json;
    let mut session = new_session(model, args.ctx, quiet);
    if let Some(draft) = &prepared.draft {
        draft.source.prepare(&mut session);
    }
    if let Some((path, bytes)) = &prepared.state {
        session.load_state(bytes, path)?;
    }
    let prompt = &prepared.prompt;
    if prompt.len() > session.remaining() {
        bail!(
            "the prompt is {} tokens and the context has room for {} more (of {}); \
             --ctx raises it up to the model's {}",
            prompt.len(),
            session.remaining(),
            session.capacity(),
            model.config().max_position_embeddings
        );
    }
    session.set_interrupt(Some(interrupt.flag().clone()));
    interrupt.begin();
    let start = Instant::now();
    let before = session.position();
    let prefilled = match prompt.is_empty() {
        true => Ok(()),
        false => session.prefill(prompt).map(|_| ()),
    };
    let prompt_timing = (session.position() - before, start.elapsed().as_secs_f64());
    let outcome = match prefilled {
        Ok(()) => run_generation(&mut session, args, &mut prepared, interrupt),
        Err(moeflux::Error::Interrupted) => Ok(Outcome::interrupted_prefill()),
        Err(e) => Err(e),
    };
    interrupt.end();
    let outcome = outcome?;
    if let Some(path) = &args.save_state {
        session.save_state_file(path)?;
    }
    if args.json {
        print_json(
            args,
            &prepared,
            prompt_timing,
            &outcome,
            model.config().vocab_size,
        )?;
    } else if !args.quiet {
        report(&session, model, args, &prepared, prompt_timing, &outcome);
    }
    if args.stats {
        super::print_expert_stats(model);
        if let Some(drafts) = &outcome.drafts {
            super::print_draft_stats(drafts);
        }
    }
    if outcome.finish == FinishReason::Interrupted {
        return Err(moeflux::Error::Interrupted.into());
    }
    Ok(())
}

/// How a generation went.
struct Outcome {
    generated: Generated,
    prefill_interrupted: bool,
}

impl Outcome {
    fn interrupted_prefill() -> Outcome {
        Outcome {
            generated: Generated {
                tokens: Vec::new(),
                text: String::new(),
                seconds: 0.0,
                finish: FinishReason::Interrupted,
                logprobs: Vec::new(),
                drafts: None,
            },
            prefill_interrupted: true,
        }
    }
}

impl std::ops::Deref for Outcome {
    type Target = Generated;
    fn deref(&self) -> &Generated {
        &self.generated
    }
}

fn run_generation<B: Backend>(
    session: &mut Session<B>,
    args: &Args,
    prepared: &mut Prepared,
    interrupt: &Interrupt,
) -> moeflux::Result<Outcome> {
    let generated = match &prepared.tokenizer {
        Some(tok) if !args.print_token_ids => {
            let mut stdout = std::io::stdout().lock();
            let stream = !args.json;
            let mut generation = TextGeneration::new(tok, &mut prepared.sampler, args.max_tokens);
            generation.stop_strings = &args.sampling.stop;
            generation.interrupt = Some(interrupt.flag());
            generation.logprobs = args.logprobs;
            generation.ignore_eos = args.sampling.ignore_eos;
            generation.draft = prepared.draft;
            let generated = generation.run(session, &mut |piece| {
                if stream {
                    stdout
                        .write_all(piece.as_bytes())
                        .and_then(|()| stdout.flush())
                        .map_err(|e| moeflux::Error::invalid("standard output", e.to_string()))?;
                }
                Ok(())
            })?;
            if stream {
                let _ = writeln!(stdout);
            }
            generated
        }
        _ => generate_ids(session, args, prepared, interrupt)?,
    };
    Ok(Outcome {
        generated,
        prefill_interrupted: false,
    })
}

/// Generation printing token ids (no tokenizer needed).
fn generate_ids<B: Backend>(
    session: &mut Session<B>,
    args: &Args,
    prepared: &mut Prepared,
    interrupt: &Interrupt,
) -> moeflux::Result<Generated> {
    let start = Instant::now();
    let stop_ids = match &prepared.tokenizer {
        Some(t) if !args.sampling.ignore_eos => t.special_tokens().stop_ids.clone(),
        _ => Vec::new(),
    };
    let mut finish = FinishReason::MaxTokens;
    let sampler = &mut prepared.sampler;
    let mut pick =
        |logits: &[f32], prompt: &[u32], generated: &[u32], draft: Option<u32>| match draft {
            Some(draft) => sampler.sample_with_draft(logits, prompt, generated, draft),
            None => sampler.sample(logits, prompt, generated),
        };
    let on_token = |id| {
        if stop_ids.contains(&id) {
            finish = FinishReason::EndOfText;
        } else if interrupt.requested() {
            finish = FinishReason::Interrupted;
        } else {
            return Ok(ControlFlow::Continue(()));
        }
        Ok(ControlFlow::Break(()))
    };
    let mut drafts = None;
    let tokens = match prepared.draft {
        Some(settings) => {
            let mut drafter = settings.source.drafter(session.model())?;
            let mut speculation = Speculation::new(&mut *drafter, settings.length);
            let tokens =
                speculative::generate(session, &mut speculation, args.max_tokens, pick, on_token)?;
            drafts = Some(speculation.stats);
            tokens
        }
        None => session.generate(
            args.max_tokens,
            |logits, prompt, generated| pick(logits, prompt, generated, None),
            on_token,
        )?,
    };
    if finish == FinishReason::MaxTokens && session.remaining() == 0 {
        finish = FinishReason::ContextFull;
    }
    println!(
        "{}",
        tokens
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(Generated {
        tokens,
        text: String::new(),
        seconds: start.elapsed().as_secs_f64(),
        finish,
        logprobs: Vec::new(),
        drafts,
    })
}

/// Speeds and how the generation ended, to stderr.
fn report<B: Backend>(
    session: &Session<B>,
    model: &Model<B>,
    args: &Args,
    prepared: &Prepared,
    prompt: (usize, f64),
    outcome: &Outcome,
) {
    match outcome.finish {
        FinishReason::ContextFull => eprintln!(
            "moeflux: the context is full ({} tokens): generation stopped; \
             --ctx raises it up to the model's {}",
            session.capacity(),
            model.config().max_position_embeddings
        ),
        FinishReason::Interrupted if outcome.prefill_interrupted => eprintln!(
            "moeflux: stopped while reading the prompt ({} of {} tokens read)",
            prompt.0,
            prepared.prompt.len()
        ),
        FinishReason::Interrupted => eprintln!("moeflux: stopped"),
        _ => {}
    }
    eprintln!(
        "prompt: {}; generation: {}",
        rate(prompt.0, prompt.1),
        rate(outcome.tokens.len(), outcome.seconds)
    );
    if let Some(path) = &args.save_state {
        eprintln!(
            "moeflux: saved the session ({} tokens) to {}",
            session.position(),
            path.display()
        );
    }
    if !prepared.sampler.config().is_greedy() && args.sampling.seed.is_none() {
        eprintln!(
            "seed: {} (pass --seed {0} to repeat)",
            prepared.sampler.seed()
        );
    }
}

/// The `--json` object, to stdout.
fn print_json(
    args: &Args,
    prepared: &Prepared,
    prompt: (usize, f64),
    outcome: &Outcome,
    vocab: usize,
) -> Result<()> {
    let piece = |id: u32| -> Option<String> {
        prepared
            .tokenizer
            .as_ref()
            .and_then(|t| t.decode(&[id], false).ok())
    };
    let per_second = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let logprobs: Vec<_> = outcome
        .logprobs
        .iter()
        .map(|lp| {
            json!({
                "token": lp.token,
                "text": piece(lp.token),
                "logprob": lp.logprob,
                "top": lp.top.iter().map(|&(id, logprob)| json!({
                    "token": id, "text": piece(id), "logprob": logprob
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let mut object = json!({
        "text": outcome.text,
        "tokens": outcome.tokens,
        "finish_reason": outcome.finish,
        "prompt_tokens": prompt.0,
        "timings": {
            "prompt_seconds": prompt.1,
            "prompt_tokens_per_second": per_second(prompt.0, prompt.1),
            "generation_seconds": outcome.seconds,
            "generation_tokens_per_second": per_second(outcome.tokens.len(), outcome.seconds),
        },
        "vocab_size": vocab,
    });
    if args.logprobs.is_some() {
        object["logprobs"] = logprobs.into();
    }
    if !prepared.sampler.config().is_greedy() {
        object["seed"] = prepared.sampler.seed().into();
    }
    if let Some(drafts) = &outcome.drafts {
        object["drafts"] = json!({
            "checks": drafts.checks,
            "drafted": drafts.drafted,
            "accepted": drafts.accepted,
            "acceptance": drafts.acceptance(),
        });
    }
    println!("{}", serde_json::to_string_pretty(&object)?);
    Ok(())
}
