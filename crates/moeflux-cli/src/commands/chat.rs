//! `moeflux chat`: a conversation with history, typed at a terminal (line
//! editing and history; a line ending in `\` or a block between `"""`
//! lines spans several lines) or piped through stdin. `/reset` starts over,
//! `/exit` quits, Ctrl-C stops the prompt being read or the answer being
//! written and keeps the conversation (a second Ctrl-C, or one at the
//! input line, quits).
//!
//! Each turn renders the whole conversation with the chat template and
//! prefills only what the session does not already hold: the part shared
//! with the previous turn is kept (a checkpoint after each answer makes
//! rewinding to it cheap for linear-attention layers). When the
//! conversation no longer fits the context, the oldest turns are dropped,
//! and the user is told which.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Result, bail};
use moeflux::backend::Backend;
use moeflux::sampling::Sampler;
use moeflux::speculative::DraftSettings;
use moeflux::text::{ChatMessage, ChatTemplate, FinishReason, TextGeneration, Tokenizer};
use moeflux::{Model, Session};
use rustyline::error::ReadlineError;
use rustyline::validate::{ValidationContext, ValidationResult, Validator};

use super::{DraftArgs, ModelArgs, SamplingArgs, TemplateArgs, new_session, rate};
use crate::interrupt::Interrupt;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    template: TemplateArgs,
    /// Tokens per answer at most.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 256)]
    max_tokens: usize,
    /// Positions the conversation may take (default: the model's context,
    /// bounded by memory); beyond it the oldest turns are dropped.
    #[arg(long)]
    ctx: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    draft: DraftArgs,
    /// Print no speeds.
    #[arg(short, long)]
    quiet: bool,
}

/// The tokenizer, template and sampler, made before the model is loaded.
struct Prepared {
    tokenizer: Tokenizer,
    template: ChatTemplate,
    sampler: Sampler,
    draft: Option<DraftSettings>,
}

pub fn run(args: Args) -> Result<()> {
    let draft = args.draft.settings()?;
    let mut files = args.model.resolve(args.quiet)?;
    files.check_context(args.ctx)?;
    files.check_draft(draft)?;
    let tokenizer = Tokenizer::from_dir(&files.dir)?;
    let prepared = Prepared {
        template: ChatTemplate::from_dir(&files.dir, tokenizer.special_tokens(), None)?,
        sampler: args.sampling.sampler(&files.dir)?,
        draft,
        tokenizer,
    };
    let interrupt = crate::interrupt::install()?;
    with_model!(args.model.load(&files, args.quiet)?, |model| chat(
        &model, &args, prepared, interrupt
    ))
}

/// Where the typed lines come from.
enum Input {
    Terminal(Box<rustyline::Editor<MultiLine, rustyline::history::FileHistory>>),
    Piped(std::io::StdinLock<'static>),
}

/// Input that continues on the next line: after a trailing `\`, or inside
/// a `"""` block.
fn continues(text: &str) -> bool {
    let fenced = text.trim_start().starts_with("\"\"\"");
    (fenced && (text.trim() == "\"\"\"" || !text.trim_end().ends_with("\"\"\"")))
        || text.ends_with('\\')
}

/// A message from the lines typed: continuation marks removed.
fn message(text: &str) -> String {
    let text = text.trim();
    if let Some(inner) = text.strip_prefix("\"\"\"") {
        return inner
            .strip_suffix("\"\"\"")
            .unwrap_or(inner)
            .trim()
            .to_string();
    }
    text.replace("\\\n", "\n")
}

/// rustyline's hook for multi-line input.
struct MultiLine;

impl Validator for MultiLine {
    fn validate(&self, ctx: &mut ValidationContext) -> rustyline::Result<ValidationResult> {
        Ok(match continues(ctx.input()) {
            true => ValidationResult::Incomplete,
            false => ValidationResult::Valid(None),
        })
    }
}
impl rustyline::completion::Completer for MultiLine {
    type Candidate = String;
}
impl rustyline::hint::Hinter for MultiLine {
    type Hint = String;
}
impl rustyline::highlight::Highlighter for MultiLine {}
impl rustyline::Helper for MultiLine {}

/// The chat history file (`moeflux::tuning::state_dir`).
fn history_file() -> Option<PathBuf> {
    moeflux::tuning::state_dir().map(|d| d.join("moeflux/chat_history"))
}

impl Input {
    fn new() -> Result<Input> {
        if !std::io::stdin().is_terminal() {
            return Ok(Input::Piped(std::io::stdin().lock()));
        }
        let mut editor = rustyline::Editor::new()?;
        editor.set_helper(Some(MultiLine));
        if let Some(path) = history_file() {
            let _ = editor.load_history(&path);
        }
        Ok(Input::Terminal(Box::new(editor)))
    }

    fn interactive(&self) -> bool {
        matches!(self, Input::Terminal(_))
    }

    /// The next message; `None` at the end of input.
    fn read(&mut self) -> Result<Option<String>> {
        match self {
            Input::Terminal(editor) => match editor.readline("> ") {
                Ok(text) => {
                    if !text.trim().is_empty() {
                        let _ = editor.add_history_entry(text.as_str());
                        if let Some(path) = history_file() {
                            let _ = path.parent().map(std::fs::create_dir_all);
                            let _ = editor.save_history(&path);
                        }
                    }
                    Ok(Some(message(&text)))
                }
                Err(ReadlineError::Eof) => Ok(None),
                Err(ReadlineError::Interrupted) => Err(moeflux::Error::Interrupted.into()),
                Err(e) => Err(e.into()),
            },
            Input::Piped(stdin) => {
                let mut text = String::new();
                loop {
                    let mut line = String::new();
                    if stdin.read_line(&mut line)? == 0 {
                        return Ok((!text.is_empty()).then(|| message(&text)));
                    }
                    text.push_str(line.trim_end_matches(['\n', '\r']));
                    if !continues(&text) {
                        return Ok(Some(message(&text)));
                    }
                    text.push('\n');
                }
            }
        }
    }
}

fn chat<B: Backend>(
    model: &Arc<Model<B>>,
    args: &Args,
    mut prepared: Prepared,
    interrupt: &Interrupt,
) -> Result<()> {
    let mut input = Input::new()?;
    let interactive = input.interactive();
    let options = args.template.options();
    let fresh = || -> Vec<ChatMessage> {
        args.template
            .system
            .iter()
            .map(ChatMessage::system)
            .collect()
    };
    let mut messages = fresh();
    let mut session = new_session(model, args.ctx, args.quiet || !interactive);
    if let Some(draft) = &prepared.draft {
        draft.source.prepare(&mut session);
    }
    session.set_interrupt(Some(interrupt.flag().clone()));
    if interactive && !args.quiet {
        eprintln!(
            "Chat with the model. /reset starts over, /exit quits; Ctrl-C stops an answer. \
             End a line with \\ or wrap text in \"\"\" for several lines."
        );
    }
    let mut stdout = std::io::stdout().lock();
    while let Some(text) = input.read()? {
        match text.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = fresh();
                session.clear();
                if interactive {
                    eprintln!("(conversation cleared)");
                }
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::user(text.trim()));
        let Some(ids) = fit_context(&mut messages, &prepared, &options, &session, args)? else {
            messages.pop();
            continue;
        };
        let shared = session
            .tokens()
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count();
        // Keep at least one token to prefill, so the logits are fresh.
        session.truncate(shared.min(ids.len() - 1))?;
        interrupt.begin();
        let prompt_start = std::time::Instant::now();
        let from = session.position();
        let prefilled = session.prefill(&ids[from..]);
        let prompt = (ids.len() - from, prompt_start.elapsed().as_secs_f64());
        match prefilled {
            Ok(_) => {}
            Err(moeflux::Error::Interrupted) => {
                interrupt.end();
                eprintln!("(stopped while reading your message; it was left out)");
                messages.pop();
                continue;
            }
            Err(e) => {
                interrupt.end();
                return Err(e.into());
            }
        }
        let answer = answer(&mut session, args, &mut prepared, interrupt, &mut stdout);
        interrupt.end();
        let answer = answer?;
        writeln!(stdout)?;
        match answer.finish {
            FinishReason::Interrupted => eprintln!("(stopped)"),
            FinishReason::ContextFull => eprintln!(
                "(the context is full ({} tokens): the answer was cut short; the next message \
                 drops the oldest turns, /reset starts over)",
                session.capacity()
            ),
            _ => {}
        }
        if interactive && !args.quiet {
            let drafts = answer.drafts.map_or(String::new(), |d| {
                format!("; drafts kept: {:.0}%", 100.0 * d.acceptance())
            });
            eprintln!(
                "[prompt: {}; answer: {}{drafts}]",
                rate(prompt.0, prompt.1),
                rate(answer.tokens.len(), answer.seconds)
            );
        }
        messages.push(ChatMessage::assistant(answer.text));
        session.checkpoint()?;
    }
    Ok(())
}

fn answer<B: Backend>(
    session: &mut Session<B>,
    args: &Args,
    prepared: &mut Prepared,
    interrupt: &Interrupt,
    out: &mut dyn Write,
) -> moeflux::Result<moeflux::text::Generated> {
    let mut generation =
        TextGeneration::new(&prepared.tokenizer, &mut prepared.sampler, args.max_tokens);
    generation.stop_strings = &args.sampling.stop;
    generation.interrupt = Some(interrupt.flag());
    generation.ignore_eos = args.sampling.ignore_eos;
    generation.draft = prepared.draft;
    generation.run(session, &mut |piece| {
        out.write_all(piece.as_bytes())
            .and_then(|()| out.flush())
            .map_err(|e| moeflux::Error::invalid("standard output", e.to_string()))
    })
}

/// The conversation's tokens, after dropping the oldest turns (user
/// message and answer) until it leaves room for an answer in the context;
/// `None`, with a message to the user, when the newest message alone does
/// not fit.
fn fit_context<B: Backend>(
    messages: &mut Vec<ChatMessage>,
    prepared: &Prepared,
    options: &moeflux::text::ChatOptions,
    session: &Session<B>,
    args: &Args,
) -> Result<Option<Vec<u32>>> {
    let capacity = session.capacity();
    let room = args.max_tokens.clamp(1, (capacity / 4).max(1));
    let first_turn = messages.iter().take_while(|m| m.role == "system").count();
    let mut dropped = 0;
    loop {
        let rendered = prepared.template.render(messages, options)?;
        let ids = prepared.tokenizer.encode(&rendered, false)?;
        if ids.is_empty() {
            bail!("the chat template rendered no tokens");
        }
        // The newest message is the last; an older turn can go.
        let droppable = messages.len() - first_turn > 1;
        if ids.len() + room <= capacity || (!droppable && ids.len() < capacity) {
            if dropped > 0 {
                eprintln!(
                    "(the context is full: dropped the oldest {dropped} exchange{} of the \
                     conversation; /reset starts over)",
                    if dropped == 1 { "" } else { "s" }
                );
            }
            return Ok(Some(ids));
        }
        if !droppable {
            eprintln!(
                "(your message takes {} tokens with the conversation's start, and the context \
                 holds {capacity}: shorten it, or raise --ctx up to the model's {})",
                ids.len(),
                session.model().config().max_position_embeddings
            );
            return Ok(None);
        }
        // The oldest user message and the answer after it.
        let end = (first_turn + 1..messages.len() - 1)
            .find(|&i| messages[i].role == "user")
            .unwrap_or(messages.len() - 1);
        dropped += 1;
        messages.drain(first_turn..end);
    }
}
