//! A session's hidden states (after the final norm) of the tokens it
//! holds, kept on the backend when a multi-token-prediction drafter reads
//! them ([`Session::keep_hidden_states`](super::Session::keep_hidden_states)).

use std::ops::Range;
use std::slice::from_ref;

use super::Session;
use crate::backend::Backend;
use crate::error::Result;

impl<B: Backend> Session<B> {
    /// From now on, keeps the hidden state (after the final norm) of every
    /// token appended, on the backend: what a multi-token-prediction
    /// drafter reads ([`DraftSource::prepare`](crate::speculative::DraftSource::prepare)
    /// turns it on). A hidden-size row per position, dropped as positions
    /// are; a loaded state ([`Session::load_state`]) brings none; `false`
    /// drops them all.
    pub fn keep_hidden_states(&mut self, keep: bool) {
        match (keep, &self.hidden) {
            (true, None) => self.hidden = Some(HiddenStates::starting_at(self.position())),
            (false, _) => self.hidden = None,
            (true, Some(_)) => {}
        }
    }

    /// Whether the session keeps hidden states.
    pub fn keeps_hidden_states(&self) -> bool {
        self.hidden.is_some()
    }

    /// The hidden states (after the final norm) of `positions`, `[rows,
    /// hidden]`, when the session kept all of them.
    pub fn hidden_states(&self, positions: Range<usize>) -> Result<Option<B::Tensor>> {
        match &self.hidden {
            Some(hidden) => hidden.rows(self.model.backend(), positions),
            None => Ok(None),
        }
    }

    /// The first position whose hidden state the session keeps (its
    /// length when it keeps none).
    pub fn first_hidden_state(&self) -> usize {
        self.hidden
            .as_ref()
            .map_or(self.position(), HiddenStates::first)
    }

    /// Appends tokens a forward pass ran, with their hidden states when the
    /// session keeps them.
    pub(super) fn append(&mut self, tokens: &[u32], hidden: Option<B::Tensor>) -> Result<()> {
        self.tokens.extend_from_slice(tokens);
        match (&mut self.hidden, hidden) {
            (Some(kept), Some(rows)) => kept.push(self.model.backend(), rows),
            _ => Ok(()),
        }
    }

    /// Keeps the first `len` tokens (and their hidden states).
    pub(super) fn truncate_tokens(&mut self, len: usize) -> Result<()> {
        self.tokens.truncate(len);
        match &mut self.hidden {
            Some(hidden) => hidden.truncate(self.model.backend(), len),
            None => Ok(()),
        }
    }
}

/// Hidden states of positions `first..first + rows`, in parts as forward
/// passes made them; merged as they come so that a long session holds a
/// few parts, not one per token.
pub(super) struct HiddenStates<B: Backend> {
    first: usize,
    /// Consecutive parts, each with its row count, largest first.
    parts: Vec<(B::Tensor, usize)>,
}

impl<B: Backend> HiddenStates<B> {
    /// None kept yet, the next token appended at `position`.
    pub(super) fn starting_at(position: usize) -> Self {
        HiddenStates {
            first: position,
            parts: Vec::new(),
        }
    }

    /// The position after the last row kept.
    fn end(&self) -> usize {
        self.first + self.parts.iter().map(|(_, rows)| rows).sum::<usize>()
    }

    /// Appends the rows of the positions after the last ones; two parts
    /// merge while the older is no larger than the newer (each row is then
    /// copied about log₂ n times over n rows).
    pub(super) fn push(&mut self, b: &B, rows: B::Tensor) -> Result<()> {
        let n = b.rows(&rows);
        self.parts.push((rows, n));
        while let [.., (_, older), (_, newer)] = self.parts[..]
            && older <= newer
        {
            let (b_part, b_rows) = self.parts.pop().expect("two parts");
            let (a_part, a_rows) = self.parts.pop().expect("two parts");
            self.parts
                .push((b.concat_rows(&[a_part, b_part])?, a_rows + b_rows));
        }
        Ok(())
    }

    /// Keeps the positions before `len` only.
    pub(super) fn truncate(&mut self, b: &B, len: usize) -> Result<()> {
        if len <= self.first {
            *self = HiddenStates::starting_at(len);
            return Ok(());
        }
        let mut start = self.first;
        let mut kept = 0;
        for (part, rows) in self.parts.iter_mut() {
            if start >= len {
                break;
            }
            if start + *rows > len {
                *part = b.gather_rows(part, from_ref(&(0..len - start)))?;
                *rows = len - start;
            }
            start += *rows;
            kept += 1;
        }
        self.parts.truncate(kept);
        Ok(())
    }

    /// The rows of `positions`, when all of them are kept.
    pub(super) fn rows(&self, b: &B, positions: Range<usize>) -> Result<Option<B::Tensor>> {
        if positions.start < self.first || positions.end > self.end() || positions.is_empty() {
            return Ok(None);
        }
        let mut pieces = Vec::new();
        let mut start = self.first;
        for (part, rows) in &self.parts {
            let (lo, hi) = (positions.start.max(start), positions.end.min(start + rows));
            if lo < hi {
                pieces.push(b.gather_rows(part, from_ref(&(lo - start..hi - start)))?);
            }
            start += rows;
        }
        Ok(Some(match pieces.len() {
            1 => pieces.pop().expect("one piece"),
            _ => b.concat_rows(&pieces)?,
        }))
    }

    /// The first position kept.
    pub(super) fn first(&self) -> usize {
        self.first
    }
}
