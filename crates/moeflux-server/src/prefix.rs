//! Prefix reuse: sessions of finished requests kept, least recently used
//! first out, so that a request whose prompt starts with what one of them
//! holds (a chat's earlier turns, the same prompt again) resumes from
//! that session's checkpoint instead of reading the prefix again.
//!
//! Checkpoints make this exact for every architecture: attention layers'
//! KV caches are cut, Gated DeltaNet layers' recurrent states are restored
//! from the copies the checkpoint took, with the logits there.

use moeflux::Session;
use moeflux::backend::Backend;

struct Kept<B: Backend> {
    session: Session<B>,
    bytes: u64,
    used: u64,
}

/// The kept sessions, within a byte budget (their KV positions).
pub struct PrefixCache<B: Backend> {
    kept: Vec<Kept<B>>,
    budget: u64,
    bytes: u64,
    clock: u64,
}

/// A kept session restored for a new prompt.
pub struct Reused<B: Backend> {
    pub session: Session<B>,
    /// Prompt tokens it already holds.
    pub tokens: usize,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<B: Backend> PrefixCache<B> {
    /// `budget` bytes of KV cache for kept sessions; 0 keeps none.
    pub fn new(budget: u64) -> PrefixCache<B> {
        PrefixCache {
            kept: Vec::new(),
            budget,
            bytes: 0,
            clock: 0,
        }
    }

    /// KV bytes the kept sessions hold.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Keeps a finished session holding `bytes` of KV cache, evicting the
    /// least recently used ones beyond the budget.
    pub fn keep(&mut self, mut session: Session<B>, bytes: u64) {
        if self.budget == 0 || bytes > self.budget || session.checkpoints().is_empty() {
            return;
        }
        session.detach_logits();
        while self.bytes + bytes > self.budget && self.evict() {}
        self.clock += 1;
        self.bytes += bytes;
        self.kept.push(Kept {
            session,
            bytes,
            used: self.clock,
        });
    }

    /// Drops the least recently used session; false when none is kept.
    pub fn evict(&mut self) -> bool {
        let Some((i, _)) = self.kept.iter().enumerate().min_by_key(|(_, k)| k.used) else {
            return false;
        };
        let kept = self.kept.swap_remove(i);
        self.bytes -= kept.bytes;
        true
    }

    /// The kept session sharing the longest checkpointed prefix with
    /// `prompt`, restored to that checkpoint and taken out of the cache. A
    /// checkpoint at the whole prompt counts only with its logits (the
    /// first token is then chosen from them with no forward pass).
    pub fn take(&mut self, prompt: &[u32]) -> Option<Reused<B>> {
        let mut best: Option<(usize, usize)> = None;
        for (i, kept) in self.kept.iter().enumerate() {
            let shared = common_prefix(kept.session.tokens(), prompt);
            let usable = kept
                .session
                .checkpoints()
                .into_iter()
                .filter(|&c| c > 0 && c <= shared)
                .max();
            if let Some(c) = usable
                && best.is_none_or(|(_, b)| c > b)
            {
                best = Some((i, c));
            }
        }
        let (i, at) = best?;
        let kept = self.kept.swap_remove(i);
        self.bytes -= kept.bytes;
        let mut session = kept.session;
        match session.restore_to(at) {
            Ok(()) if at < prompt.len() || session.last_logits().is_some() => Some(Reused {
                session,
                tokens: at,
            }),
            _ => None,
        }
    }
}
