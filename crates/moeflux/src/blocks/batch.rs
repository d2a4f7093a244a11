//! The rows of one forward pass. Any mix of sequences goes through the
//! model at once: prefill chunks and decode tokens, of different lengths,
//! each sequence following whatever its own state (KV caches, Gated
//! DeltaNet states) already holds. Per-sequence work (attention, the
//! delta rule) runs on each sequence's rows; everything else (the
//! projections, the experts) on all rows together, so an expert is read and
//! multiplied once per batch however many rows chose it.

use std::ops::Range;

/// Whether a sequence's rows are a prompt being read or generated tokens.
/// The two compute the same; they differ in what pays off around them
/// (reading the next layer's experts ahead pays during decode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Prefill,
    Decode,
}

/// One sequence's part of a batch: `rows` consecutive tokens, of which
/// the last `logit_rows` want logits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub rows: usize,
    pub phase: Phase,
    pub logit_rows: usize,
}

/// The tokens of every sequence in the batch, one sequence after another,
/// and where each sequence's rows are.
#[derive(Clone, Debug, Default)]
pub struct ForwardBatch {
    pub tokens: Vec<u32>,
    pub segments: Vec<Segment>,
}

impl ForwardBatch {
    /// A batch of one sequence.
    pub fn single(tokens: &[u32], phase: Phase, logit_rows: usize) -> ForwardBatch {
        let mut batch = ForwardBatch::default();
        batch.push(tokens, phase, logit_rows);
        batch
    }

    /// Adds a sequence's rows.
    pub fn push(&mut self, tokens: &[u32], phase: Phase, logit_rows: usize) {
        assert!(logit_rows <= tokens.len(), "more logit rows than tokens");
        self.tokens.extend_from_slice(tokens);
        self.segments.push(Segment {
            rows: tokens.len(),
            phase,
            logit_rows,
        });
    }

    pub fn sequences(&self) -> usize {
        self.segments.len()
    }

    /// Each sequence's rows in the batch.
    pub fn ranges(&self) -> Vec<Range<usize>> {
        let mut start = 0;
        self.segments
            .iter()
            .map(|s| {
                start += s.rows;
                start - s.rows..start
            })
            .collect()
    }

    /// The rows whose logits are wanted, each sequence's last ones.
    pub fn logit_ranges(&self) -> Vec<Range<usize>> {
        self.ranges()
            .into_iter()
            .zip(&self.segments)
            .map(|(r, s)| r.end - s.logit_rows..r.end)
            .collect()
    }

    /// Rows of logits the batch returns.
    pub fn logit_rows(&self) -> usize {
        self.segments.iter().map(|s| s.logit_rows).sum()
    }

    /// Whether every sequence is generating (one new token each).
    pub fn is_decode(&self) -> bool {
        self.segments
            .iter()
            .all(|s| s.phase == Phase::Decode && s.rows == 1)
    }
}
