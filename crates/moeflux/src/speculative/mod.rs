//! Speculative decoding: a drafter guesses the next few tokens, one
//! forward pass over them checks the guesses, and every guess the model
//! agrees with is a decode step saved. The output is the one plain
//! decoding gives: greedy tokens are identical, sampled tokens follow the
//! same distribution (speculative rejection sampling).

use crate::backend::Backend;
use crate::error::Result;
use crate::model::Session;

/// Guesses the tokens that follow a session.
pub trait Drafter<B: Backend> {
    /// Up to `k` tokens guessed to follow the session's tokens and then
    /// `next` (chosen already, not yet in the session); fewer, or none,
    /// when the drafter has no guess.
    fn draft(&mut self, session: &Session<B>, next: u32, k: usize) -> Result<Vec<u32>>;
}
