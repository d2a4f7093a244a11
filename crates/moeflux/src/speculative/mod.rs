//! Speculative decoding: a drafter guesses the next few tokens, one
//! forward pass over them checks the guesses, and every guess the model
//! agrees with is a decode step saved. The output is the one plain
//! decoding gives: greedy tokens are identical, sampled tokens follow the
//! same distribution (speculative rejection sampling,
//! [`Sampler::sample_with_draft`](crate::sampling::Sampler::sample_with_draft)).
//!
//! A step runs the token just chosen and the drafts after it in one
//! forward pass; the first draft the model disagrees with ends the step,
//! and the session goes back to the last kept token: KV caches are cut,
//! Gated DeltaNet states and sliding windows come from a copy taken before
//! the step, with the kept tokens run again.

mod lookup;
mod mtp;

use std::ops::ControlFlow;

use serde::Serialize;

pub use lookup::PromptLookup;
pub use mtp::{MtpDrafter, missing_mtp_head};

use crate::backend::Backend;
use crate::error::Result;
use crate::model::{Model, Session};

/// Guesses the tokens that follow a session.
pub trait Drafter<B: Backend> {
    /// Up to `k` tokens guessed to follow the session's tokens and then
    /// `next` (chosen already, not yet in the session); fewer, or none,
    /// when the drafter has no guess.
    fn draft(&mut self, session: &Session<B>, next: u32, k: usize) -> Result<Vec<u32>>;

    /// Readies `session` for this drafter before drafting starts
    /// ([`generate`] calls it): a multi-token-prediction head needs the
    /// hidden states of the tokens from here on. Nothing by default.
    fn prepare(&mut self, _session: &mut Session<B>) {}
}

/// Where drafts come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DraftSource {
    /// The model's multi-token-prediction head.
    Mtp,
    /// Continuations of earlier occurrences of the last few tokens in the
    /// prompt and output ([`PromptLookup`]); no weights needed.
    Lookup,
}

impl DraftSource {
    /// The drafter of this kind for `model`'s sessions; an error naming
    /// what is missing when the model cannot have one.
    pub fn drafter<B: Backend>(self, model: &Model<B>) -> Result<Box<dyn Drafter<B>>> {
        match self {
            DraftSource::Lookup => Ok(Box::new(PromptLookup::default())),
            DraftSource::Mtp => Ok(Box::new(MtpDrafter::new(model)?)),
        }
    }

    /// Readies a new session for drafts of this kind before its prompt
    /// runs: the multi-token-prediction head reads the hidden state of
    /// every token ([`Session::keep_hidden_states`]).
    pub fn prepare<B: Backend>(self, session: &mut Session<B>) {
        if self == DraftSource::Mtp {
            session.keep_hidden_states(true);
        }
    }
}

/// How many tokens to draft per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftLength {
    /// Always this many (fewer when the drafter has fewer guesses, or near
    /// the end of the generation or the context).
    Fixed(usize),
    /// Follows the acceptance: one more after a step whose drafts were all
    /// kept, one more than were kept after a step that rejected one; from
    /// 1 to `max`.
    Adaptive { max: usize },
}

impl DraftLength {
    /// The default: adaptive up to 6 tokens per step (on copy-heavy text
    /// a step keeps most of 6 drafts; after a rejection the length drops
    /// to what was kept).
    pub const DEFAULT: DraftLength = DraftLength::Adaptive { max: 6 };

    /// Tokens to draft at the first step.
    pub fn first(self) -> usize {
        match self {
            DraftLength::Fixed(k) => k,
            DraftLength::Adaptive { max } => max,
        }
    }

    /// Tokens to draft after a step that drafted `drafted` and kept
    /// `accepted` of them, drafting `current` at most.
    pub fn next(self, drafted: usize, accepted: usize, current: usize) -> usize {
        match self {
            DraftLength::Fixed(k) => k,
            DraftLength::Adaptive { max } if drafted > 0 && accepted == drafted => {
                (current + 1).min(max)
            }
            DraftLength::Adaptive { max } if drafted > 0 => (accepted + 1).min(max),
            DraftLength::Adaptive { .. } => current,
        }
    }
}

/// Where drafts come from and how many per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftSettings {
    pub source: DraftSource,
    pub length: DraftLength,
}

/// What drafting achieved during a generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DraftStats {
    /// Forward passes that checked drafts.
    pub checks: u64,
    /// Tokens drafted.
    pub drafted: u64,
    /// Drafted tokens the model agreed with.
    pub accepted: u64,
}

impl DraftStats {
    /// The share of drafted tokens kept (0 when none were drafted).
    pub fn acceptance(&self) -> f64 {
        match self.drafted {
            0 => 0.0,
            n => self.accepted as f64 / n as f64,
        }
    }

    /// Adds another generation's counts.
    pub fn add(&mut self, other: &DraftStats) {
        self.checks += other.checks;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
    }
}

/// A drafter and how much it drafts, with what it achieved so far.
pub struct Speculation<'a, B: Backend> {
    pub drafter: &'a mut dyn Drafter<B>,
    pub length: DraftLength,
    pub stats: DraftStats,
}

impl<'a, B: Backend> Speculation<'a, B> {
    pub fn new(drafter: &'a mut dyn Drafter<B>, length: DraftLength) -> Self {
        Speculation {
            drafter,
            length,
            stats: DraftStats::default(),
        }
    }
}

/// [`Session::generate`] with drafted tokens checked in one forward pass.
///
/// `pick(logits, prompt, generated, draft)` chooses each token; when a
/// drafter guessed one for that position it is `Some(guess)` and the guess
/// is kept exactly when `pick` returns it
/// ([`Sampler::sample_with_draft`](crate::sampling::Sampler::sample_with_draft)
/// does this right for every sampling setting). Each token is handed to
/// `on_token` once it is in the session, as [`Session::generate`] does, and
/// the session ends with the logits after its last token, so the result
/// and the session's state are those of plain decoding.
///
/// ```
/// use std::ops::ControlFlow;
/// use std::sync::Arc;
/// use moeflux::model::argmax;
/// use moeflux::speculative::{DraftLength, PromptLookup, Speculation, generate};
/// use moeflux::{Model, ModelOptions};
///
/// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
/// let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
/// let prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6];
///
/// let mut plain = model.session();
/// plain.prefill(&prompt)?;
/// let want = plain.generate(12, |l, _, _| Ok(argmax(l)), |_| Ok(ControlFlow::Continue(())))?;
///
/// let mut session = model.session();
/// session.prefill(&prompt)?;
/// let mut lookup = PromptLookup::default();
/// let mut speculation = Speculation::new(&mut lookup, DraftLength::Fixed(3));
/// let got = generate(
///     &mut session,
///     &mut speculation,
///     12,
///     |l, _, _, _| Ok(argmax(l)),
///     |_| Ok(ControlFlow::Continue(())),
/// )?;
/// assert_eq!(got, want);
/// assert_eq!(session.tokens(), plain.tokens());
/// # Ok::<(), moeflux::Error>(())
/// ```
pub fn generate<B: Backend>(
    session: &mut Session<B>,
    speculation: &mut Speculation<'_, B>,
    max_new_tokens: usize,
    mut pick: impl FnMut(&[f32], &[u32], &[u32], Option<u32>) -> Result<u32>,
    mut on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<Vec<u32>> {
    speculation.drafter.prepare(session);
    let mut logits = session.current_logits()?;
    let prompt_len = session.position();
    let steps = max_new_tokens.min(session.remaining());
    let mut out: Vec<u32> = Vec::with_capacity(steps);
    let mut k = speculation.length.first();
    // A token chosen when the model rejected a draft, run by the next step.
    let mut pending: Option<u32> = None;
    while out.len() < steps {
        let next = match pending.take() {
            Some(token) => token,
            None => pick(&logits, &session.tokens()[..prompt_len], &out, None)?,
        };
        // The drafts must fit the generation and the context after `next`.
        let room = (steps - out.len() - 1).min(session.remaining() - 1);
        let drafts = match k.min(room) {
            0 => Vec::new(),
            k => {
                let mut d = speculation.drafter.draft(session, next, k)?;
                d.truncate(k);
                d
            }
        };
        if drafts.is_empty() {
            logits = session.decode(next)?;
            out.push(next);
            if on_token(next)?.is_break() {
                break;
            }
            continue;
        }
        let point = session.rewind_point(drafts.len() + 1)?;
        let mut run = Vec::with_capacity(drafts.len() + 1);
        run.push(next);
        run.extend_from_slice(&drafts);
        let rows = session.forward_drafted(&run)?;
        let row = |i: usize| &rows.data[i * rows.vocab..(i + 1) * rows.vocab];
        speculation.stats.checks += 1;
        speculation.stats.drafted += drafts.len() as u64;
        // Tokens of `run` kept (`next` always), and whether to stop.
        let mut kept = 1;
        out.push(next);
        let mut stop = on_token(next)?.is_break();
        while !stop && kept < run.len() {
            let chosen = pick(
                row(kept - 1),
                &session.tokens()[..prompt_len],
                &out,
                Some(run[kept]),
            )?;
            if chosen != run[kept] {
                pending = Some(chosen);
                break;
            }
            speculation.stats.accepted += 1;
            out.push(chosen);
            kept += 1;
            stop = on_token(chosen)?.is_break();
        }
        k = speculation.length.next(drafts.len(), kept - 1, k);
        logits = row(kept - 1).to_vec();
        if kept < run.len() {
            session.rewind(point, kept, logits.clone())?;
        }
        if stop {
            break;
        }
    }
    Ok(out)
}
