//! `moeflux chat`: a conversation with history, typed at a terminal or
//! piped through stdin. `/reset` starts over, `/exit` quits, Ctrl-C stops
//! the answer being written (a second Ctrl-C, or one at the prompt, quits).
//!
//! Each turn renders the whole conversation with the chat template and
//! prefills only what the session does not already hold: the part shared
//! with the previous turn is kept (a checkpoint after each answer makes
//! rewinding to it cheap for linear-attention layers).

use std::io::{BufRead, IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Result;
use moeflux::Model;
use moeflux::backend::Backend;
use moeflux::text::{ChatMessage, ChatOptions, ChatTemplate, Tokenizer};

use super::text::{TextGeneration, rate};
use super::{ModelArgs, SamplingArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// System prompt.
    #[arg(long)]
    system: Option<String>,
    /// Turn the template's thinking mode on (Qwen3 `enable_thinking`).
    #[arg(long, conflicts_with = "no_think")]
    think: bool,
    /// Turn the template's thinking mode off.
    #[arg(long)]
    no_think: bool,
    /// Tokens per answer at most.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print no speeds.
    #[arg(short, long)]
    quiet: bool,
}

/// Ctrl-C handling: the flag stops the answer being generated.
struct Interrupt {
    requested: Arc<AtomicBool>,
    generating: Arc<AtomicBool>,
}

impl Interrupt {
    fn install() -> Result<Interrupt> {
        let requested = Arc::new(AtomicBool::new(false));
        let generating = Arc::new(AtomicBool::new(false));
        let (r, g) = (requested.clone(), generating.clone());
        ctrlc::set_handler(move || {
            if g.load(Ordering::SeqCst) && !r.swap(true, Ordering::SeqCst) {
                return; // stop the answer, keep chatting
            }
            eprintln!();
            std::process::exit(130);
        })?;
        Ok(Interrupt {
            requested,
            generating,
        })
    }
}

pub fn run(args: Args) -> Result<()> {
    with_model!(args.model.open(args.quiet)?, |model| chat(&model, &args))
}

fn chat<B: Backend>(model: &Arc<Model<B>>, args: &Args) -> Result<()> {
    let interactive = std::io::stdin().is_terminal();
    let dir = model.dir().root().to_path_buf();
    let tokenizer = Tokenizer::from_dir(&dir)?;
    let template = ChatTemplate::from_dir(&dir, tokenizer.special_tokens(), None)?;
    let mut sampler = args.sampling.sampler(&dir)?;
    let mut options = ChatOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    if args.think || args.no_think {
        options
            .extra
            .insert("enable_thinking".into(), args.think.into());
    }
    let interrupt = Interrupt::install()?;
    let fresh = || -> Vec<ChatMessage> { args.system.iter().map(ChatMessage::system).collect() };
    let mut messages = fresh();
    let mut session = model.session();
    if interactive && !args.quiet {
        eprintln!("Chat with the model; /reset starts over, /exit quits, Ctrl-C stops an answer.");
    }
    let mut stdout = std::io::stdout().lock();
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        match line.trim() {
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
        messages.push(ChatMessage::user(line.trim()));
        let ids = tokenizer.encode(&template.render(&messages, &options)?, false)?;
        let shared = session
            .tokens()
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count();
        // Keep at least one token to prefill, so the logits are fresh.
        session.truncate(shared.min(ids.len() - 1))?;
        let prompt_start = std::time::Instant::now();
        session.prefill(&ids[session.position()..])?;
        let prompt = (ids.len() - shared, prompt_start.elapsed().as_secs_f64());

        interrupt.requested.store(false, Ordering::SeqCst);
        interrupt.generating.store(true, Ordering::SeqCst);
        let answer = TextGeneration {
            tokenizer: &tokenizer,
            sampler: &mut sampler,
            stop_strings: &args.sampling.stop,
            max_tokens: args.max_tokens,
            interrupt: Some(&interrupt.requested),
        }
        .run(&mut session, &mut stdout);
        interrupt.generating.store(false, Ordering::SeqCst);
        let answer = answer?;
        writeln!(stdout)?;
        if answer.interrupted {
            eprintln!("(stopped)");
        }
        if interactive && !args.quiet {
            eprintln!(
                "[prompt: {}; answer: {}]",
                rate(prompt.0, prompt.1),
                rate(answer.tokens.len(), answer.seconds)
            );
        }
        messages.push(ChatMessage::assistant(answer.text));
        session.checkpoint();
    }
    Ok(())
}
