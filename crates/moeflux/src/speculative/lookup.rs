//! Prompt lookup: drafts copied from the context. When the last few tokens
//! occurred before (in the prompt or the output), the tokens that followed
//! them then are a good guess for what follows now: rewriting, quoting,
//! editing code and answering about a document repeat long runs of the
//! context.

use super::Drafter;
use crate::backend::Backend;
use crate::error::Result;
use crate::model::Session;

/// Drafts the continuation of the latest earlier occurrence of the
/// longest suffix of the context (from `max_ngram` tokens down to
/// `min_ngram`) that occurred before.
///
/// ```
/// use moeflux::speculative::PromptLookup;
///
/// let lookup = PromptLookup::default();
/// // "... 7 8 9" occurred before, followed by 10 11.
/// let context = [1, 7, 8, 9, 10, 11, 2, 3, 7, 8, 9];
/// assert_eq!(lookup.continuation(&context, 2), vec![10, 11]);
/// assert!(lookup.continuation(&[1, 2, 3], 2).is_empty());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLookup {
    /// Longest suffix looked for.
    pub max_ngram: usize,
    /// Shortest suffix looked for: 1 drafts after any repeated token, more
    /// drafts less often but better.
    pub min_ngram: usize,
}

impl Default for PromptLookup {
    /// Suffixes of 3 down to 2 tokens: a single repeated token predicts
    /// too little to pay for the tokens it drafts.
    fn default() -> Self {
        PromptLookup {
            max_ngram: 3,
            min_ngram: 2,
        }
    }
}

impl PromptLookup {
    /// Up to `k` tokens that followed the latest earlier occurrence of the
    /// longest suffix of `context` found.
    pub fn continuation(&self, context: &[u32], k: usize) -> Vec<u32> {
        let len = context.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if len <= n {
                continue;
            }
            let suffix = &context[len - n..];
            // Latest first: recent text predicts best.
            if let Some(start) = (0..len - n).rev().find(|&i| &context[i..i + n] == suffix) {
                let from = start + n;
                return context[from..(from + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

impl<B: Backend> Drafter<B> for PromptLookup {
    fn draft(&mut self, session: &Session<B>, next: u32, k: usize) -> Result<Vec<u32>> {
        let mut context = Vec::with_capacity(session.position() + 1);
        context.extend_from_slice(session.tokens());
        context.push(next);
        Ok(self.continuation(&context, k))
    }
}
