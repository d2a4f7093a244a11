//! Recorded steps: the engine's side of a backend's recordings (CUDA
//! graphs, backend/cuda/graph.rs). A decode step whose experts the backend
//! holds entirely is keyed by the state of each of its sequences and by
//! the batch's shape; the backend replays what it recorded under that key,
//! or runs the step and may record it. Recorded: one sequence's decode
//! token or its token and drafts (speculative decoding's check), and
//! several sequences' decode tokens, one each. The model definition
//! (blocks/) knows nothing of it.

use super::Model;
use crate::backend::{Backend, StepInputs};
use crate::blocks::batch::{ForwardBatch, Phase};
use crate::blocks::decoder::LayerState;
use crate::error::Result;

impl<B: Backend> Model<B> {
    /// The logits of `batch` from a recorded step, when the batch is one
    /// the backend records: every segment generated tokens (one per
    /// sequence when there are several) wanting logits, every expert
    /// resident. `None`: run it through the decoder.
    pub(super) fn recorded_step(
        &self,
        states: &mut [&mut [LayerState<B>]],
        batch: &ForwardBatch,
    ) -> Result<Option<B::Tensor>> {
        let (b, store) = (&self.backend, &self.store);
        let several = batch.sequences() > 1;
        let recordable = batch.logit_rows() > 0
            && batch
                .segments
                .iter()
                .all(|s| s.phase == Phase::Decode && (s.rows == 1 || !several))
            && self.decoder.experts_all_resident(b, store);
        if !recordable {
            return Ok(None);
        }
        let forward = |model: &Self, states: &mut [&mut [LayerState<B>]]| {
            model
                .decoder
                .forward(b, batch, states, store, false)
                .map(|out| out.logits.expect("logits asked for"))
        };
        let mut key = xxhash_rust::xxh3::Xxh3::new();
        let mut positions = Vec::with_capacity(states.len());
        for (state, segment) in states.iter_mut().zip(&batch.segments) {
            let mut position = 0;
            let mut kv = Vec::new();
            let mut linear = Vec::new();
            for layer in state.iter_mut() {
                match layer {
                    LayerState::Attention(cache) => {
                        position = b.kv_len(cache);
                        kv.push(cache);
                    }
                    LayerState::DeltaNet(s) => linear.push(&*s),
                }
            }
            let Some(sequence) = b.step_key(&mut kv, &linear, segment.rows, batch.sequences())?
            else {
                // Not recorded now (graphs off): run as the recording would.
                return b.run_step(&mut || forward(self, states)).map(Some);
            };
            key.update(&sequence.to_le_bytes());
            for n in [segment.rows, segment.logit_rows] {
                key.update(&(n as u64).to_le_bytes());
            }
            positions.push(position);
        }
        let inputs = StepInputs {
            tokens: &batch.tokens,
            positions: &positions,
            logit_rows: batch.logit_rows(),
            vocab: self.config().vocab_size,
        };
        let key = key.digest();
        if let Some(logits) = b.replay_step(key, &inputs)? {
            return Ok(Some(logits));
        }
        b.record_step(key, &inputs, &mut || forward(self, states))
            .map(Some)
    }
}
