//! The engine: one thread that owns the model's sessions and runs every
//! running request's next tokens in one [`forward_batch`] per step.
//!
//! Requests arrive through a bounded queue ([`EngineHandle::submit`]; a
//! full queue is a 429). Between steps, waiting requests join the batch
//! while it has room for their sequences and the KV budget holds their
//! reservation (prompt and most new tokens); finished and cancelled ones
//! leave it, their sessions (and KV caches) dropped. A step holds every
//! decoding sequence's next token and, within a per-step budget of prompt
//! tokens, the next piece of prompts being read, cut at multiples of the
//! model's prefill chunk so each sequence runs the same passes as alone.
//!
//! A sequence with speculative decoding (its request's `draft`) runs its
//! next token and the tokens its drafter guesses after it in the same
//! step; its tokens are then chosen row by row, each draft kept when the
//! chosen token equals it, and the session rewound past the first one
//! rejected: the tokens are those of decoding without drafts.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use llguidance::Matcher;
use moeflux::backend::Backend;
use moeflux::sampling::{Sampler, SamplerConfig, StopCondition};
use moeflux::speculative::DraftSettings;
use moeflux::text::{FinishReason, StreamDecoder, TokenLogprob, Tokenizer};
use moeflux::{BatchItem, LogitsWanted, Model, Phase, Session, SessionOptions, forward_batch};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::prefix::PrefixCache;
use drafting::Drafting;

mod drafting;
mod threads;

pub use threads::wait_for_engines;

/// The error a panic in the grammar library becomes.
fn grammar_panicked() -> anyhow::Error {
    anyhow::anyhow!("the grammar library panicked")
}

/// How a request's tokens are chosen and when its choices end.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Choices generated from the prompt (OpenAI's `n`).
    pub n: usize,
    pub max_tokens: usize,
    /// Choice `i` draws with `seed + i` when a seed is given.
    pub sampling: SamplerConfig,
    pub stop: Vec<String>,
    /// Added to the logits before sampling (not to the log-probabilities
    /// reported, which are the model's).
    pub logit_bias: Vec<(u32, f32)>,
    /// Report each token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// End-of-text tokens do not end the answer (they are decoded as text).
    pub ignore_eos: bool,
    /// Speculative decoding; off for a constrained answer.
    pub draft: Option<DraftSettings>,
}

/// A request handed to the engine.
pub struct Job {
    pub prompt: Vec<u32>,
    pub settings: Settings,
    /// One grammar matcher per choice for a constrained answer, or none.
    pub constraints: Vec<Matcher>,
    pub events: UnboundedSender<Event>,
    pub received: Instant,
}

impl Job {
    /// A job received now, and the receiving end of its events.
    pub fn new(
        prompt: Vec<u32>,
        settings: Settings,
        constraints: Vec<Matcher>,
    ) -> (Job, UnboundedReceiver<Event>) {
        let (events, inbox) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt,
            settings,
            constraints,
            events,
            received: Instant::now(),
        };
        (job, inbox)
    }
}

/// What the engine reports about a request, in order.
#[derive(Debug)]
pub enum Event {
    /// Choice `choice` generated `token`; `text` is the text it completed
    /// (often empty: a character split over tokens, a possible stop string
    /// held back).
    Token {
        choice: usize,
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// Choice `choice` ended; `text` is what was still held back.
    Finish {
        choice: usize,
        reason: FinishReason,
        text: String,
    },
    /// Every choice ended.
    Done {
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// The request failed in the engine; nothing more follows.
    Failed(ApiError),
}

/// The engine's limits.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Sequences in one batch (a request with `n` choices takes `n`).
    pub max_sequences: usize,
    /// Requests waiting beyond the batch before new ones get a 429.
    pub queue: usize,
    /// Positions of one sequence: prompt and generated tokens.
    pub context: usize,
    /// KV cache bytes all running sequences may reserve together.
    pub kv_budget: u64,
    /// Prompt tokens read in one step (at least one prefill chunk's piece
    /// always goes in).
    pub prefill_per_step: usize,
    /// A request still running this long after it arrived ends as at its
    /// token limit; one still waiting is answered 503.
    pub request_timeout: Option<Duration>,
    /// KV cache bytes of finished requests' sessions kept for prefix reuse
    /// (within `kv_budget`, given back when running requests need it); 0
    /// turns prefix reuse off.
    pub prefix_cache: u64,
}

/// The HTTP side's end of the engine.
pub struct EngineHandle {
    jobs: SyncSender<Job>,
    pub metrics: Arc<Metrics>,
}

impl EngineHandle {
    /// Queues a job; a full queue is a 429 with Retry-After.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        self.metrics.queued.inc();
        match self.jobs.try_send(job) {
            Ok(()) => Ok(()),
            Err(err) => {
                self.metrics.queued.dec();
                match err {
                    TrySendError::Full(_) => {
                        self.metrics.rejected.inc();
                        Err(ApiError::overloaded(1))
                    }
                    TrySendError::Disconnected(_) => {
                        Err(ApiError::unavailable("the engine has stopped"))
                    }
                }
            }
        }
    }
}

/// Starts the engine thread for `model`.
pub fn spawn<B: Backend + 'static>(
    model: Arc<Model<B>>,
    tokenizer: Arc<Tokenizer>,
    limits: Limits,
    metrics: Arc<Metrics>,
) -> std::io::Result<EngineHandle>
where
    Model<B>: Send + Sync,
{
    let (jobs, inbox) = sync_channel(limits.queue);
    let engine_metrics = metrics.clone();
    let thread = std::thread::Builder::new()
        .name("moeflux-engine".into())
        .spawn(move || {
            let mut engine = Engine {
                model,
                tokenizer: &tokenizer,
                metrics: engine_metrics,
                running: Vec::new(),
                held: None,
                reserved: 0,
                prefix: PrefixCache::new(limits.prefix_cache),
                limits,
            };
            engine.run(inbox);
        })?;
    threads::started(thread);
    Ok(EngineHandle { jobs, metrics })
}

/// One choice of a request: a session and its decoding state.
struct Choice<'t, B: Backend> {
    session: Session<B>,
    sampler: Sampler,
    stop: StopCondition,
    decoder: StreamDecoder<'t>,
    generated: Vec<u32>,
    /// The grammar a constrained answer follows.
    matcher: Option<Matcher>,
    /// The token to run next step, once the prompt is read.
    next: Option<u32>,
    done: bool,
    last_token: Option<Instant>,
    /// Speculative decoding, when the request asked for it.
    drafting: Option<Drafting<B>>,
}

/// A request in the batch.
struct Running<'t, B: Backend> {
    job: Job,
    choices: Vec<Choice<'t, B>>,
    /// KV bytes held for it in the budget.
    reserved: u64,
    first_token: bool,
    /// The client went away or the engine failed on it: removed after the
    /// step.
    gone: bool,
}

struct Engine<'t, B: Backend> {
    model: Arc<Model<B>>,
    tokenizer: &'t Tokenizer,
    limits: Limits,
    metrics: Arc<Metrics>,
    running: Vec<Running<'t, B>>,
    /// A job taken from the queue that waits for room in the batch.
    held: Option<Job>,
    /// KV bytes reserved by running requests.
    reserved: u64,
    prefix: PrefixCache<B>,
}

impl<'t, B: Backend> Engine<'t, B> {
    fn run(&mut self, inbox: Receiver<Job>) {
        loop {
            if !self.admit(&inbox) {
                return;
            }
            if self.running.is_empty() {
                continue;
            }
            self.step();
            self.retire();
            self.metrics.running.set(self.running.len() as i64);
            self.metrics.kv_reserved.set(self.reserved as i64);
            self.metrics
                .prefix_cache_bytes
                .set(self.prefix.bytes() as i64);
            self.metrics
                .kv_in_use
                .set(self.model.kv_bytes_in_use() as i64);
            self.metrics.record_experts(&self.model.expert_stats());
        }
    }

    /// Removes the finished and cancelled requests, keeping a finished
    /// request's first session for prefix reuse.
    fn retire(&mut self) {
        let per = self.model.kv_bytes_per_position();
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if !r.gone && r.choices.iter().any(|c| !c.done) {
                i += 1;
                continue;
            }
            let running = self.running.remove(i);
            self.reserved -= running.reserved;
            if !running.gone
                && let Some(first) = running.choices.into_iter().next()
            {
                let mut session = first.session;
                if self.limits.prefix_cache > 0 {
                    // The conversation so far, for its next turn (taken
                    // here, after a drafted step's rewind).
                    let _ = session.checkpoint();
                }
                let bytes = session.position() as u64 * per;
                self.prefix.keep(session, bytes);
            }
        }
    }

    /// Takes waiting jobs into the batch while they fit; waits for one when
    /// nothing runs. Returns false once the server has gone.
    fn admit(&mut self, inbox: &Receiver<Job>) -> bool {
        loop {
            let job = match self.held.take() {
                Some(job) => job,
                None if self.running.is_empty() => match inbox.recv() {
                    Ok(job) => job,
                    Err(_) => return false,
                },
                None => match inbox.try_recv() {
                    Ok(job) => job,
                    Err(std::sync::mpsc::TryRecvError::Empty) => return true,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        return !self.running.is_empty();
                    }
                },
            };
            // A held job still waits: it leaves the queue's count when it
            // starts or is dropped.
            if job.events.is_closed() {
                self.metrics.queued.dec();
                self.metrics.cancelled.inc();
                continue;
            }
            if self.timed_out(&job) {
                self.metrics.queued.dec();
                let error = ApiError::unavailable(
                    "the request waited in the queue past the server's --request-timeout",
                );
                let _ = job.events.send(Event::Failed(error));
                continue;
            }
            let sequences: usize = self.running.iter().map(|r| r.choices.len()).sum();
            let need = self.reservation(&job);
            let room = sequences + job.settings.n <= self.limits.max_sequences;
            // Kept sessions give way to requests.
            while room
                && self.reserved + self.prefix.bytes() + need > self.limits.kv_budget
                && self.prefix.evict()
            {}
            let fits_budget = self.reserved + self.prefix.bytes() + need <= self.limits.kv_budget;
            if self.running.is_empty() || (room && fits_budget) {
                self.metrics.queued.dec();
                self.start(job, need);
            } else {
                self.held = Some(job);
                return true;
            }
        }
    }

    /// KV bytes a job may come to hold.
    fn reservation(&self, job: &Job) -> u64 {
        let positions = (job.prompt.len() + job.settings.max_tokens).min(self.limits.context);
        positions as u64 * self.model.kv_bytes_per_position() * job.settings.n as u64
    }

    fn start(&mut self, mut job: Job, reserved: u64) {
        let stop_ids = if job.settings.ignore_eos {
            Vec::new()
        } else {
            self.tokenizer.special_tokens().stop_ids.clone()
        };
        let mut matchers = std::mem::take(&mut job.constraints).into_iter();
        let mut choices = Vec::with_capacity(job.settings.n);
        for i in 0..job.settings.n {
            let mut sampling = job.settings.sampling.clone();
            sampling.seed = sampling.seed.map(|s| s.wrapping_add(i as u64));
            let made = Sampler::new(sampling).and_then(|s| {
                Ok((
                    s,
                    StopCondition::new(stop_ids.clone(), job.settings.stop.clone())?,
                ))
            });
            let (sampler, stop) = match made {
                Ok(made) => made,
                Err(err) => {
                    let _ = job
                        .events
                        .send(Event::Failed(ApiError::bad_body(err.to_string())));
                    return;
                }
            };
            let matcher = matchers.next();
            let mut drafting = match job.settings.draft.filter(|_| matcher.is_none()) {
                None => None,
                Some(draft) => match draft.source.drafter(&self.model) {
                    Ok(drafter) => Some(Drafting {
                        drafter,
                        length: draft.length,
                        k: draft.length.first(),
                        run: Vec::new(),
                        point: None,
                    }),
                    Err(err) => {
                        let error = ApiError::invalid("draft", err.to_string());
                        let _ = job.events.send(Event::Failed(error));
                        return;
                    }
                },
            };
            let reused = match i {
                0 => self.prefix.take(&job.prompt),
                _ => None,
            };
            let mut session = match reused {
                Some(reused) => {
                    self.metrics.prefix_hits.inc();
                    self.metrics.prefix_tokens.add(reused.tokens as u64);
                    reused.session
                }
                None => self.model.session_with(SessionOptions {
                    context: Some(self.limits.context),
                    ..SessionOptions::default()
                }),
            };
            if let Some(d) = &mut drafting {
                d.drafter.prepare(&mut session);
            }
            choices.push(Choice {
                session,
                sampler,
                stop,
                decoder: self.tokenizer.stream_decoder(true),
                generated: Vec::new(),
                matcher,
                next: None,
                done: false,
                last_token: None,
                drafting,
            });
        }
        self.metrics
            .queue_seconds
            .observe(job.received.elapsed().as_secs_f64());
        self.reserved += reserved;
        self.running.push(Running {
            job,
            choices,
            reserved,
            first_token: false,
            gone: false,
        });
    }

    /// One forward pass over every running sequence, then a token for each
    /// that has its logits.
    fn timed_out(&self, job: &Job) -> bool {
        self.limits
            .request_timeout
            .is_some_and(|limit| job.received.elapsed() > limit)
    }

    fn step(&mut self) {
        for r in 0..self.running.len() {
            if !self.running[r].gone && self.timed_out(&self.running[r].job) {
                for c in 0..self.running[r].choices.len() {
                    if !self.running[r].choices[c].done {
                        self.end_choice(r, c, FinishReason::MaxTokens);
                    }
                }
            }
        }
        // Sessions that hold the whole prompt (a kept one restored) have
        // the logits of the first token already.
        let mut instant = Vec::new();
        for (r, running) in self.running.iter().enumerate() {
            for (c, choice) in running.choices.iter().enumerate() {
                if !choice.done
                    && choice.next.is_none()
                    && choice.session.position() == running.job.prompt.len()
                {
                    instant.push((r, c));
                }
            }
        }
        for (r, c) in instant {
            let logits = self.running[r].choices[c]
                .session
                .last_logits()
                .map(<[f32]>::to_vec);
            match logits {
                Some(logits) => {
                    self.next_token(r, c, &logits, None);
                }
                None => self.fail(r, ApiError::engine("a restored session has no logits")),
            }
        }
        // Pieces end at multiples of the model's prefill chunk, the passes
        // of a session reading its prompt alone; on the host, whose rows'
        // results do not depend on their chunk, at multiples of the step's
        // budget where that is smaller, so that a step stays short.
        let chunk = match self.model.backend().forks_on_host() {
            true => self
                .model
                .prefill_chunk()
                .min(self.limits.prefill_per_step.max(1)),
            false => self.model.prefill_chunk(),
        };
        let mut budget = self.limits.prefill_per_step;
        let mut prefilled_any = false;
        let mut owners = Vec::new();
        let mut items = Vec::new();
        let mut failed = Vec::new();

        for (r, running) in self.running.iter_mut().enumerate() {
            if running.gone {
                continue;
            }
            if running.job.events.is_closed() {
                running.gone = true;
                self.metrics.cancelled.inc();
                continue;
            }
            let prompt = &running.job.prompt;
            let max_tokens = running.job.settings.max_tokens;
            for (c, choice) in running.choices.iter_mut().enumerate() {
                let Choice {
                    session,
                    next,
                    done,
                    drafting,
                    generated,
                    ..
                } = choice;
                if *done {
                    continue;
                }
                let (tokens, phase): (&[u32], Phase) = match (next, drafting) {
                    (Some(token), Some(d)) => {
                        // Drafts fit the answer's and the context's room
                        // after the next token.
                        let room = (max_tokens.saturating_sub(generated.len() + 1))
                            .min(session.remaining().saturating_sub(1));
                        match d.draft(session, *token, room) {
                            Ok(()) => (&d.run[..], Phase::Decode),
                            Err(err) => {
                                failed.push((r, err));
                                continue;
                            }
                        }
                    }
                    (Some(token), None) => (std::slice::from_ref(token), Phase::Decode),
                    (None, _) => {
                        let at = session.position();
                        // Up to the next multiple of the chunk: the passes
                        // a session reading the prompt alone runs.
                        let piece = (chunk - at % chunk).min(prompt.len() - at);
                        if prefilled_any && piece > budget {
                            continue;
                        }
                        prefilled_any = true;
                        budget = budget.saturating_sub(piece);
                        (&prompt[at..at + piece], Phase::Prefill)
                    }
                };
                let ready =
                    phase == Phase::Decode || session.position() + tokens.len() == prompt.len();
                owners.push((r, c, ready));
                items.push(BatchItem {
                    session,
                    tokens,
                    wanted: match tokens.len() > 1 && phase == Phase::Decode {
                        true => LogitsWanted::All,
                        false => LogitsWanted::Last,
                    },
                    phase,
                });
            }
        }
        let prompt_rows: usize = items
            .iter()
            .filter(|i| i.phase == Phase::Prefill)
            .map(|i| i.tokens.len())
            .sum();
        let start = Instant::now();
        let result = match items.is_empty() {
            true => None,
            false => {
                self.metrics.batch_sequences.observe(items.len() as f64);
                Some(forward_batch(&mut items))
            }
        };
        drop(items);
        for (r, err) in failed {
            self.fail(r, ApiError::engine(format!("drafting failed: {err}")));
        }
        let Some(result) = result else {
            return;
        };
        self.metrics
            .step_seconds
            .observe(start.elapsed().as_secs_f64());
        self.metrics.prompt_tokens.add(prompt_rows as u64);
        let logits = match result {
            Ok(logits) => logits,
            Err(err) => {
                let error = ApiError::engine(format!("the forward pass failed: {err}"));
                for &(r, _, _) in &owners {
                    self.fail(r, error.clone());
                }
                return;
            }
        };
        for ((r, c, ready), logits) in owners.into_iter().zip(logits) {
            if ready && !self.running[r].gone {
                let choice = &mut self.running[r].choices[c];
                if c == 0 && choice.next.is_none() && self.limits.prefix_cache > 0 {
                    // The prompt's end, for a later request with the same
                    // prompt; a failed copy only loses that reuse.
                    let _ = choice.session.checkpoint();
                }
                match choice.drafting.as_mut().and_then(Drafting::take_check) {
                    Some((run, point)) => self.check_drafts(r, c, &run, point, &logits),
                    None => {
                        self.next_token(r, c, logits.last(), None);
                    }
                }
            }
        }
    }

    /// Ends request `r` with an error.
    fn fail(&mut self, r: usize, error: ApiError) {
        let running = &mut self.running[r];
        if !running.gone {
            running.gone = true;
            let _ = running.job.events.send(Event::Failed(error));
        }
    }

    /// Picks choice `c` of request `r`'s next token from `logits` (keeping
    /// `draft` exactly when the sampler says so), reports it, and ends the
    /// choice when a limit is reached. Returns the token, or `None` when
    /// the request failed first.
    fn next_token(
        &mut self,
        r: usize,
        c: usize,
        logits: &[f32],
        draft: Option<u32>,
    ) -> Option<u32> {
        let now = Instant::now();
        let running = &mut self.running[r];
        let settings = &running.job.settings;
        let choice = &mut running.choices[c];
        let mut masked = None;
        if !settings.logit_bias.is_empty() || choice.matcher.is_some() {
            let mut scores = logits.to_vec();
            for &(id, bias) in &settings.logit_bias {
                scores[id as usize] += bias;
            }
            if let Some(matcher) = &mut choice.matcher {
                // The grammar library must not end the engine thread.
                let mask = catch_unwind(AssertUnwindSafe(|| matcher.compute_mask()));
                let allowed = match mask.unwrap_or_else(|_| Err(grammar_panicked())) {
                    Ok(mask) => mask,
                    Err(err) => {
                        let error = ApiError::engine(format!("the answer's grammar failed: {err}"));
                        self.fail(r, error);
                        return None;
                    }
                };
                for (id, score) in scores.iter_mut().enumerate() {
                    if !allowed.is_allowed(id as u32) {
                        *score = f32::NEG_INFINITY;
                    }
                }
                if scores.iter().all(|s| *s == f32::NEG_INFINITY) {
                    let error =
                        ApiError::engine("the answer's grammar allows no token of the model");
                    self.fail(r, error);
                    return None;
                }
            }
            masked = Some(scores);
        }
        let scores = masked.as_deref().unwrap_or(logits);
        let prompt = &running.job.prompt;
        let sampled = match draft {
            Some(draft) => {
                choice
                    .sampler
                    .sample_with_draft(scores, prompt, &choice.generated, draft)
            }
            None => choice.sampler.sample(scores, prompt, &choice.generated),
        };
        let token = match sampled {
            Ok(token) => token,
            Err(err) => {
                self.fail(r, ApiError::engine(format!("sampling failed: {err}")));
                return None;
            }
        };
        if let Some(matcher) = &mut choice.matcher
            && let Err(err) = catch_unwind(AssertUnwindSafe(|| matcher.consume_token(token)))
                .unwrap_or_else(|_| Err(grammar_panicked()))
        {
            self.fail(
                r,
                ApiError::engine(format!("the answer's grammar failed: {err}")),
            );
            return None;
        }
        let logprob = settings
            .logprobs
            .map(|top| TokenLogprob::of(logits, token, top));
        choice.generated.push(token);
        self.metrics.generated_tokens.inc();
        if !running.first_token {
            running.first_token = true;
            self.metrics
                .ttft_seconds
                .observe((now - running.job.received).as_secs_f64());
        }
        if let Some(last) = choice.last_token.replace(now) {
            self.metrics
                .inter_token_seconds
                .observe((now - last).as_secs_f64());
        }
        let mut finish = None;
        let text = if choice.stop.is_eos(token) {
            finish = Some(FinishReason::EndOfText);
            String::new()
        } else {
            match choice.decoder.step(token) {
                Ok(piece) => {
                    let step = choice.stop.push(&piece);
                    if step.stopped_by.is_some() {
                        finish = Some(FinishReason::StopString);
                    }
                    step.text
                }
                Err(err) => {
                    running.gone = true;
                    let error = ApiError::engine(format!("detokenizing failed: {err}"));
                    let _ = running.job.events.send(Event::Failed(error));
                    return Some(token);
                }
            }
        };
        // A grammar that is complete ends the answer.
        if finish.is_none() && choice.matcher.as_ref().is_some_and(Matcher::is_stopped) {
            finish = Some(FinishReason::EndOfText);
        }
        if finish.is_none() && choice.generated.len() >= settings.max_tokens {
            finish = Some(FinishReason::MaxTokens);
        }
        if finish.is_none() && choice.session.remaining() == 0 {
            finish = Some(FinishReason::ContextFull);
        }
        let sent = running.job.events.send(Event::Token {
            choice: c,
            token,
            text,
            logprob,
        });
        if sent.is_err() {
            running.gone = true;
            self.metrics.cancelled.inc();
            return Some(token);
        }
        match finish {
            None => choice.next = Some(token),
            Some(reason) => self.end_choice(r, c, reason),
        }
        Some(token)
    }

    /// Ends choice `c` of request `r` for `reason`, and the request with
    /// its usage once every choice has ended.
    fn end_choice(&mut self, r: usize, c: usize, reason: FinishReason) {
        let running = &mut self.running[r];
        let choice = &mut running.choices[c];
        choice.done = true;
        // Text held back (a possible stop string, a split character) that
        // turned out to be neither.
        let rest = match reason {
            FinishReason::StopString => String::new(),
            _ => choice.decoder.finish().unwrap_or_default() + &choice.stop.finish(),
        };
        let _ = running.job.events.send(Event::Finish {
            choice: c,
            reason,
            text: rest,
        });
        if running.choices.iter().all(|c| c.done) {
            let completion_tokens = running.choices.iter().map(|c| c.generated.len()).sum();
            self.metrics.requests_finished.inc();
            let _ = running.job.events.send(Event::Done {
                prompt_tokens: running.job.prompt.len(),
                completion_tokens,
            });
        }
    }
}
