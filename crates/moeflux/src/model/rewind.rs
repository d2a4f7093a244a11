//! Rewinds for speculative decoding: a session appends drafted tokens in
//! one forward pass and comes back to the last one the model agreed with,
//! its KV caches cut and its Gated DeltaNet states taken from the steps the
//! backend kept or from a copy.

use super::Session;
use crate::backend::{Backend, HostValues};
use crate::blocks::decoder::LayerState;
use crate::config::LayerKind;
use crate::error::{Error, Result};
use crate::model::LogitsWanted;

/// A position a session can come back to cheaply after tokens are
/// appended ([`Session::rewind_point`]): how speculative decoding drops
/// the drafts the model rejected.
pub struct RewindPoint<B: Backend> {
    position: usize,
    /// Per layer, as in a checkpoint; `None` when cutting the KV caches
    /// back is enough.
    saved: Option<Vec<Option<LayerState<B>>>>,
    /// Whether the Gated DeltaNet states keep their steps.
    tracked: bool,
}

impl<B: Backend> Session<B> {
    /// What [`Session::rewind`] needs to come back to the current position
    /// after `appending` tokens are appended in one forward pass: nothing
    /// on a model whose KV caches are cut back exactly; on one with Gated
    /// DeltaNet layers, their states after each of those tokens, kept by
    /// the backend where it can; else a copy of the state truncation
    /// cannot restore.
    pub fn rewind_point(&mut self, appending: usize) -> Result<RewindPoint<B>> {
        let position = self.position();
        if self.model.rewinds_by_truncation() || self.layers.is_empty() {
            return Ok(RewindPoint {
                position,
                saved: None,
                tracked: false,
            });
        }
        let b = self.model.backend();
        let chunk = self.model.prefill_chunk;
        // One run per layer (within a prefill chunk), and no sliding
        // window (whose cache has let go of what a rewind needs).
        let tracked = appending <= chunk
            && self
                .model
                .config()
                .layers
                .iter()
                .all(|l| l.kind != LayerKind::SlidingAttention)
            && self.layers.iter_mut().all(|l| match l {
                LayerState::DeltaNet(state) => b.delta_net_track(state),
                LayerState::Attention(_) => true,
            });
        let saved = match tracked {
            true => None,
            false => Some(
                self.layers
                    .iter()
                    .enumerate()
                    .map(|(i, l)| self.model.copy_unrewindable(i, l))
                    .collect::<Result<_>>()?,
            ),
        };
        Ok(RewindPoint {
            position,
            saved,
            tracked,
        })
    }

    /// Goes back to `point` and on to the first `keep` tokens appended
    /// since, whose logits are `logits` (known already, from the forward
    /// that appended them). KV caches are cut back; Gated DeltaNet states
    /// come from the states the backend kept, or from the point's copy
    /// with the kept tokens run again.
    pub fn rewind(&mut self, point: RewindPoint<B>, keep: usize, logits: Vec<f32>) -> Result<()> {
        let target = point.position + keep;
        if target > self.position() || logits.len() != self.model.config().vocab_size {
            return Err(Error::invalid(
                "rewind",
                format!(
                    "keeping {keep} tokens after position {} goes past the session's {} tokens, \
                     or the logits are not a row of the vocabulary",
                    point.position,
                    self.position()
                ),
            ));
        }
        let b = self.model.backend();
        if point.tracked {
            let mut rewound = true;
            for layer in &mut self.layers {
                match layer {
                    LayerState::DeltaNet(state) => rewound &= b.delta_net_rewind(state, keep)?,
                    LayerState::Attention(cache) => b.kv_truncate(cache, target),
                }
            }
            if !rewound {
                // A state that kept fewer steps than asked: rebuild the
                // position from the checkpoints instead.
                let rebuilt = self.rebuild(target);
                self.sync_kv();
                return rebuilt;
            }
            self.truncate_tokens(target)?;
            self.checkpoints.retain(|c| c.position <= target);
            self.logits = Some(HostValues::from(logits));
            self.sync_kv();
            return Ok(());
        }
        let kept = self.tokens[point.position..target].to_vec();
        let cut_to = match &point.saved {
            None => target,
            Some(_) => point.position,
        };
        if let Some(saved) = point.saved {
            for (layer, copy) in self.layers.iter_mut().zip(saved) {
                if let Some(copy) = copy {
                    *layer = copy;
                }
            }
        }
        for layer in &mut self.layers {
            if let LayerState::Attention(cache) = layer {
                b.kv_truncate(cache, cut_to);
            }
        }
        self.truncate_tokens(cut_to)?;
        self.checkpoints.retain(|c| c.position <= cut_to);
        if cut_to < target
            && let Err(err) = self.run(&kept, LogitsWanted::Last)
        {
            // A failed run may leave layers half-updated: rebuild the
            // position from the checkpoints instead.
            let rebuilt = self.rebuild(cut_to);
            self.sync_kv();
            rebuilt?;
            return Err(err);
        }
        self.logits = Some(HostValues::from(logits));
        self.sync_kv();
        Ok(())
    }
}
