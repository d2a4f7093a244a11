//! Text generation: tokens sampled, decoded into whole characters, checked
//! against stop strings and handed out as they arrive; and [`complete`],
//! prompt in, text out, for programs that want nothing more.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde::Serialize;

use super::{ChatMessage, ChatOptions, ChatTemplate, Tokenizer};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::{Model, Session};
use crate::sampling::{Sampler, SamplerConfig, StopCondition};
use crate::speculative::{self, DraftSettings, DraftStats, Speculation};

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model wrote an end-of-text token.
    EndOfText,
    /// One of the stop strings appeared.
    StopString,
    /// The most tokens asked for were generated.
    MaxTokens,
    /// The session's context is full.
    ContextFull,
    /// The interrupt flag was raised.
    Interrupted,
}

impl FinishReason {
    /// A few words for people.
    pub fn describe(self) -> &'static str {
        match self {
            FinishReason::EndOfText => "end of text",
            FinishReason::StopString => "stop string",
            FinishReason::MaxTokens => "token limit",
            FinishReason::ContextFull => "context full",
            FinishReason::Interrupted => "interrupted",
        }
    }
}

/// The log-probability of a generated token under the model's
/// distribution (softmax of the raw logits, before any sampling setting),
/// with the most likely alternatives.
#[derive(Clone, Debug, Serialize)]
pub struct TokenLogprob {
    /// The token generated.
    pub token: u32,
    /// Its natural-log probability.
    pub logprob: f32,
    /// The `top` most likely tokens at this step, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What one generation produced.
#[derive(Clone, Debug)]
pub struct Generated {
    /// The ids generated, end-of-text token included when there was one.
    pub tokens: Vec<u32>,
    /// The text handed out (without stop strings or end-of-text tokens).
    pub text: String,
    /// Time the generation took.
    pub seconds: f64,
    /// Why it ended.
    pub finish: FinishReason,
    /// One per token when asked for ([`TextGeneration::logprobs`]).
    pub logprobs: Vec<TokenLogprob>,
    /// What drafting achieved, when it was on ([`TextGeneration::draft`]).
    pub drafts: Option<DraftStats>,
}

/// One streamed generation's settings: [`TextGeneration::run`] continues a
/// session, handing out text as it is decoded and stopping at an
/// end-of-text token, a stop string, the token limit, a full context or an
/// interruption.
///
/// ```
/// use std::sync::Arc;
/// use moeflux::sampling::{Sampler, SamplerConfig};
/// use moeflux::text::{FinishReason, TextGeneration, Tokenizer};
/// use moeflux::{Model, ModelOptions};
///
/// let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
/// let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
/// let tokenizer = Tokenizer::from_dir(&dir)?;
/// let mut sampler = Sampler::new(SamplerConfig::default())?;
///
/// let mut session = model.session();
/// session.prefill(&tokenizer.encode("Emma Woodhouse, handsome, clever, and rich,", true)?)?;
/// let mut streamed = String::new();
/// let mut generation = TextGeneration::new(&tokenizer, &mut sampler, 6);
/// generation.logprobs = Some(2);
/// let generated = generation.run(&mut session, &mut |piece| {
///     streamed.push_str(piece);
///     Ok(())
/// })?;
///
/// assert_eq!(generated.text, streamed);
/// assert_eq!(generated.logprobs.len(), generated.tokens.len());
/// if generated.finish == FinishReason::MaxTokens {
///     assert_eq!(generated.tokens.len(), 6);
/// }
/// # Ok::<(), moeflux::Error>(())
/// ```
#[non_exhaustive]
pub struct TextGeneration<'a> {
    /// Decodes the generated ids; its stop ids end the generation.
    pub tokenizer: &'a Tokenizer,
    /// Picks each token.
    pub sampler: &'a mut Sampler,
    /// Texts that end the generation; they are not handed out.
    pub stop_strings: &'a [String],
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Raised (by Ctrl-C, a cancelled request) to end the generation
    /// before the next token.
    pub interrupt: Option<&'a AtomicBool>,
    /// Record each token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Go on past end-of-text tokens (for measurements; the text after one
    /// is rarely meaningful).
    pub ignore_eos: bool,
    /// Speculative decoding: drafted tokens checked in one forward pass
    /// (the same output as without).
    pub draft: Option<DraftSettings>,
}

impl<'a> TextGeneration<'a> {
    /// Up to `max_tokens` tokens picked by `sampler`, ended by the
    /// tokenizer's end-of-text tokens; no stop strings, interruption or
    /// log-probabilities until their fields are set.
    pub fn new(tokenizer: &'a Tokenizer, sampler: &'a mut Sampler, max_tokens: usize) -> Self {
        TextGeneration {
            tokenizer,
            sampler,
            stop_strings: &[],
            max_tokens,
            interrupt: None,
            logprobs: None,
            ignore_eos: false,
            draft: None,
        }
    }

    /// Generates from the session's current state (which must hold at
    /// least one token), handing each new piece of text to `on_text`.
    pub fn run<B: Backend>(
        &mut self,
        session: &mut Session<B>,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Generated> {
        let eos_ids = match self.ignore_eos {
            true => Vec::new(),
            false => self.tokenizer.special_tokens().stop_ids.clone(),
        };
        let mut stop = StopCondition::new(eos_ids, self.stop_strings.to_vec())?;
        let mut decoder = self.tokenizer.stream_decoder(true);
        let mut text = String::new();
        let mut finish = FinishReason::MaxTokens;
        let mut logprobs = Vec::new();
        let start = Instant::now();
        let sampler = &mut *self.sampler;
        let (interrupt, top) = (self.interrupt, self.logprobs);
        let interrupted = || interrupt.is_some_and(|flag| flag.load(Ordering::Relaxed));
        let mut pick = |logits: &[f32], prompt: &[u32], generated: &[u32], draft: Option<u32>| {
            let token = match draft {
                Some(draft) => sampler.sample_with_draft(logits, prompt, generated, draft)?,
                None => sampler.sample(logits, prompt, generated)?,
            };
            if let Some(top) = top {
                logprobs.push(TokenLogprob::of(logits, token, top));
            }
            Ok(token)
        };
        let mut on_token = |id| {
            if stop.is_eos(id) {
                finish = FinishReason::EndOfText;
                return Ok(ControlFlow::Break(()));
            }
            let step = stop.push(&decoder.step(id)?);
            text.push_str(&step.text);
            on_text(&step.text)?;
            if step.stopped_by.is_some() {
                finish = FinishReason::StopString;
                return Ok(ControlFlow::Break(()));
            }
            if interrupted() {
                finish = FinishReason::Interrupted;
                return Ok(ControlFlow::Break(()));
            }
            Ok(ControlFlow::Continue(()))
        };
        let mut drafts = None;
        let tokens = if interrupted() {
            finish = FinishReason::Interrupted;
            Vec::new()
        } else if let Some(settings) = self.draft {
            let mut drafter = settings.source.drafter(session.model())?;
            let mut speculation = Speculation::new(&mut *drafter, settings.length);
            let tokens = speculative::generate(
                session,
                &mut speculation,
                self.max_tokens,
                &mut pick,
                &mut on_token,
            )?;
            drafts = Some(speculation.stats);
            tokens
        } else {
            session.generate(
                self.max_tokens,
                |logits, prompt, generated| pick(logits, prompt, generated, None),
                &mut on_token,
            )?
        };
        if finish == FinishReason::MaxTokens && session.remaining() == 0 {
            finish = FinishReason::ContextFull;
        }
        if !matches!(finish, FinishReason::EndOfText | FinishReason::StopString) {
            let rest = stop.push(&decoder.finish()?).text + &stop.finish();
            text.push_str(&rest);
            on_text(&rest)?;
        }
        Ok(Generated {
            tokens,
            text,
            seconds: start.elapsed().as_secs_f64(),
            finish,
            logprobs,
            drafts,
        })
    }
}

impl TokenLogprob {
    /// `token`'s log-probability under `logits` (a softmax of them as
    /// they are) and the `top` most likely tokens'.
    pub fn of(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
        let top = top.min(logits.len());
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let log_sum = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
        let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
        if top > 0 {
            for (i, &l) in logits.iter().enumerate() {
                if best.len() < top || l > best[best.len() - 1].1 {
                    let at = best.partition_point(|&(_, b)| b >= l);
                    best.insert(at, (i as u32, l));
                    best.truncate(top);
                }
            }
        }
        TokenLogprob {
            token,
            logprob: logits[token as usize] - log_sum,
            top: best.into_iter().map(|(i, l)| (i, l - log_sum)).collect(),
        }
    }
}

/// A prompt and how to continue it, for [`complete`]. [`Completion::new`]
/// is greedy, as plain text, with no stop strings.
#[derive(Clone, Debug)]
pub struct Completion {
    /// The text to continue.
    pub prompt: String,
    /// Wrap the prompt in the model's chat template as a user message
    /// (after `system`, if given).
    pub chat: bool,
    /// A system message before the prompt, with `chat`.
    pub system: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How tokens are chosen.
    pub sampling: SamplerConfig,
    /// Texts that end the completion (left out of its text).
    pub stop: Vec<String>,
}

impl Completion {
    /// Greedy continuation of `prompt`, at most `max_tokens` long.
    pub fn new(prompt: impl Into<String>, max_tokens: usize) -> Completion {
        Completion {
            prompt: prompt.into(),
            chat: false,
            system: None,
            max_tokens,
            sampling: SamplerConfig {
                temperature: 0.0,
                ..SamplerConfig::default()
            },
            stop: Vec::new(),
        }
    }
}

/// Prompt in, text out: tokenizes the prompt (through the chat template
/// when asked), prefills it in a new session of `model` and generates.
///
/// ```
/// use std::sync::Arc;
/// use moeflux::text::{Completion, complete};
/// use moeflux::{Model, ModelOptions};
///
/// let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
/// let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
/// let mut request = Completion::new("It is a truth universally acknowledged,", 12);
/// request.stop.push(".".into());
/// let out = complete(&model, &request)?;
/// println!("{}", out.text);
/// assert!(out.tokens.len() <= 12 && !out.text.contains('.'));
///
/// // The same prompt as a chat message, through the model's chat template.
/// let mut chat = Completion::new("What should a young lady do at a ball?", 6);
/// chat.chat = true;
/// let answer = complete(&model, &chat)?;
/// assert!(answer.tokens.len() <= 6);
/// # Ok::<(), moeflux::Error>(())
/// ```
pub fn complete<B: Backend>(model: &Arc<Model<B>>, request: &Completion) -> Result<Generated> {
    let dir = model.dir().root();
    let tokenizer = Tokenizer::from_dir(dir)?;
    let prompt = if request.chat {
        let template = ChatTemplate::from_dir(dir, tokenizer.special_tokens(), None)?;
        let mut messages: Vec<ChatMessage> =
            request.system.iter().map(ChatMessage::system).collect();
        messages.push(ChatMessage::user(&request.prompt));
        let options = ChatOptions {
            add_generation_prompt: true,
            ..ChatOptions::default()
        };
        tokenizer.encode(&template.render(&messages, &options)?, false)?
    } else {
        tokenizer.encode(&request.prompt, true)?
    };
    if prompt.is_empty() {
        return Err(Error::invalid(
            "prompt",
            "is empty after tokenization: give some text",
        ));
    }
    let mut sampler = Sampler::new(request.sampling.clone())?;
    let mut session = model.session();
    session.prefill(&prompt)?;
    let mut generation = TextGeneration::new(&tokenizer, &mut sampler, request.max_tokens);
    generation.stop_strings = &request.stop;
    generation.run(&mut session, &mut |_| Ok(()))
}
