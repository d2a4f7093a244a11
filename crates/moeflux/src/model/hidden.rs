//! A session's hidden states (after the final norm) of the tokens it
//! holds, kept on the backend when a multi-token-prediction drafter reads
//! them ([`Session::keep_hidden_states`](super::Session::keep_hidden_states)).

use std::ops::Range;

use crate::backend::Backend;
use crate::error::Result;

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
                *part = b.gather_rows(part, &[0..len - start])?;
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
                pieces.push(b.gather_rows(part, &[lo - start..hi - start])?);
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
