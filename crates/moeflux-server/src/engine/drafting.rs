//! Speculative decoding in the engine: a sequence's drafter, the run of
//! its next token and drafts checked in one step, and the choice of its
//! tokens from that run's logits, with the rewind past the first draft
//! rejected.

use moeflux::backend::Backend;
use moeflux::speculative::{DraftLength, Drafter};
use moeflux::{Logits, RewindPoint, Session};

use super::Engine;
use crate::error::ApiError;

/// A sequence's drafter and the step it is checking.
pub(super) struct Drafting<B: Backend> {
    pub(super) drafter: Box<dyn Drafter<B>>,
    pub(super) length: DraftLength,
    /// Tokens to draft next step.
    pub(super) k: usize,
    /// This step's tokens: the next token, then the drafts.
    pub(super) run: Vec<u32>,
    /// Where the session goes back to when a draft is rejected.
    pub(super) point: Option<RewindPoint<B>>,
}

impl<B: Backend> Drafting<B> {
    /// Drafts after `next` (at most `room` tokens) into this step's run,
    /// with a rewind point when there are drafts.
    pub(super) fn draft(
        &mut self,
        session: &mut Session<B>,
        next: u32,
        room: usize,
    ) -> moeflux::Result<()> {
        self.run.clear();
        self.run.push(next);
        self.point = None;
        let k = self.k.min(room);
        if k == 0 {
            return Ok(());
        }
        let mut drafts = self.drafter.draft(session, next, k)?;
        drafts.truncate(k);
        if !drafts.is_empty() {
            self.point = Some(session.rewind_point(drafts.len() + 1)?);
            self.run.extend(drafts);
        }
        Ok(())
    }

    /// This step's run and rewind point, when it checked drafts.
    pub(super) fn take_check(&mut self) -> Option<(Vec<u32>, RewindPoint<B>)> {
        let point = self.point.take()?;
        Some((std::mem::take(&mut self.run), point))
    }
}

impl<B: Backend> Engine<'_, B> {
    /// Chooses choice `c` of request `r`'s tokens from the logits after
    /// each token of `run` (its next token and the drafts after it), as
    /// long as the drafts are the tokens chosen, then rewinds the session
    /// to the last row used: the tokens and the session are those of
    /// decoding without drafts.
    pub(super) fn check_drafts(
        &mut self,
        r: usize,
        c: usize,
        run: &[u32],
        point: RewindPoint<B>,
        logits: &Logits,
    ) {
        let mut accepted = 0;
        let mut used = 0;
        for (row, draft) in run
            .iter()
            .skip(1)
            .copied()
            .map(Some)
            .chain([None])
            .enumerate()
        {
            used = row + 1;
            let token = self.next_token(r, c, logits.row(row), draft);
            let running = &self.running[r];
            if token.is_some() && token == draft {
                accepted += 1;
            }
            if running.gone || running.choices[c].done || token != draft {
                break;
            }
        }
        self.metrics.draft_checks.inc();
        self.metrics.drafted_tokens.add(run.len() as u64 - 1);
        self.metrics.accepted_drafts.add(accepted);
        let running = &mut self.running[r];
        if running.gone {
            return;
        }
        let choice = &mut running.choices[c];
        if let Some(d) = &mut choice.drafting {
            d.k = d.length.next(run.len() - 1, accepted as usize, d.k);
        }
        if used < run.len() {
            let kept = logits.row(used - 1).to_vec();
            if let Err(err) = choice.session.rewind(point, used, kept) {
                let error = ApiError::engine(format!("rewinding rejected drafts failed: {err}"));
                self.fail(r, error);
            }
        }
    }
}
