//! Drafting with the model's multi-token-prediction head: one head step per
//! drafted token, each taking the previous step's output and the token it
//! drafted. The head keeps a KV cache of its own, made of rows from the
//! main model's hidden states: after each check it runs the tokens the
//! model kept with their hidden states (as vLLM does), so its context is
//! the one it was trained on, whatever the drafts were.

use std::path::Path;
use std::sync::Arc;

use super::Drafter;
use crate::backend::{Backend, HostValues};
use crate::blocks::decoder::LayerState;
use crate::error::{Error, Result};
use crate::model::{Logits, Model, Session, argmax};

/// Drafts with the model's multi-token-prediction head
/// ([`Model::has_mtp`]). The session must keep its hidden states
/// ([`Session::keep_hidden_states`]) from its first token for the head to
/// see the whole context; [`speculative::generate`](super::generate) turns
/// that on where it was not, and the head then sees the positions from
/// there on.
///
/// A drafter follows one session; it notices when the session went back
/// or changed, and runs the head again from the first position that
/// changed. Its KV cache (one attention layer's per position) is its own,
/// outside the model's KV budget.
pub struct MtpDrafter<B: Backend> {
    /// The head's KV cache, of the model it was made for.
    cache: Option<(Arc<Model<B>>, LayerState<B>)>,
    /// The position of the cache's first row.
    base: usize,
    /// Rows made from the main model's hidden states, positions
    /// `base..base + kept`; later rows are drafts.
    kept: usize,
    /// The tokens those rows were made from: positions `0..base + kept +
    /// 1` (row `i` reads the hidden state of position `i` and the token at
    /// `i + 1`).
    seen: Vec<u32>,
}

impl<B: Backend> Default for MtpDrafter<B> {
    fn default() -> Self {
        MtpDrafter {
            cache: None,
            base: 0,
            kept: 0,
            seen: Vec::new(),
        }
    }
}

impl<B: Backend> MtpDrafter<B> {
    /// A drafter for `model`, or an error naming what is missing when the
    /// model has no head.
    pub fn new(model: &Model<B>) -> Result<Self> {
        match model.has_mtp() {
            true => Ok(MtpDrafter::default()),
            false => Err(no_head(model)),
        }
    }

    /// The head's logits of up to `k` tokens after the session's tokens
    /// and `next` (chosen, not yet in the session), each step chained on
    /// the previous one's greedy choice: `[rows, vocab]`, none when the
    /// session has not kept the hidden state of its last token.
    pub fn draft_logits(&mut self, session: &Session<B>, next: u32, k: usize) -> Result<Logits> {
        let model = session.model();
        let vocab = model.config().vocab_size;
        let mut rows = Logits {
            rows: 0,
            vocab,
            data: HostValues::default(),
        };
        let p = session.position();
        if !model.has_mtp() {
            return Err(no_head(model));
        }
        if k == 0 || p == 0 || !session.keeps_hidden_states() {
            return Ok(rows);
        }
        let tokens = session.tokens();
        // Rows stay valid while the tokens they were made from are the
        // session's (and `next`).
        let same = self
            .seen
            .iter()
            .zip(tokens.iter().chain([&next]))
            .take_while(|(a, b)| a == b)
            .count();
        // Rows before `from` are kept; row `p - 1` (with `next`) is always
        // run, its logits being the first draft's.
        let valid_end = (self.base + self.kept)
            .min(same.saturating_sub(1))
            .min(p - 1);
        let first_kept = session.first_hidden_state();
        let same_model = matches!(&self.cache, Some((m, _)) if Arc::ptr_eq(m, model));
        let valid = match valid_end.checked_sub(self.base) {
            Some(valid) if same_model && valid_end >= first_kept => valid,
            _ => {
                // Start over where the session's hidden states begin.
                if first_kept >= p {
                    return Ok(rows);
                }
                self.cache = Some((model.clone(), model.new_mtp_state(session.kv_type())?));
                self.base = first_kept;
                0
            }
        };
        let from = self.base + valid;
        let Some(hidden) = session.hidden_states(from..p)? else {
            return Ok(rows);
        };
        let (_, state) = self.cache.as_mut().expect("made above");
        if let LayerState::Attention(cache) = state {
            model.backend().kv_truncate(cache, valid);
        }
        self.kept = valid;
        // Rows `from..p`, each with the token after it: the last is
        // `next`, and its logits are the first draft's.
        let mut after: Vec<u32> = tokens[from + 1..].to_vec();
        after.push(next);
        let mut out = model.mtp_forward(state, &hidden, &after, from, 1)?;
        self.kept = p - self.base;
        self.seen.clear();
        self.seen.extend_from_slice(tokens);
        self.seen.push(next);
        let mut data = Vec::with_capacity(k * vocab);
        for step in 0..k {
            let logits = model.backend().to_host(&out.logits)?;
            let guess = argmax(&logits);
            data.extend_from_slice(&logits);
            rows.rows += 1;
            if step + 1 < k {
                out = model.mtp_forward(state, &out.chained, &[guess], p + step, 1)?;
            }
        }
        rows.data = HostValues::from(data);
        Ok(rows)
    }
}

fn no_head<B: Backend>(model: &Model<B>) -> Error {
    missing_mtp_head(model.dir().root())
}

/// The error for drafting with the multi-token-prediction head of the
/// model in `dir`, which has none.
pub fn missing_mtp_head(dir: &Path) -> Error {
    Error::invalid(
        "draft",
        format!(
            "the model in {} has no multi-token-prediction head: use --draft lookup, or convert \
             a checkpoint that ships one (Qwen3-Next, Qwen3.5, DeepSeek-V3, Kimi K2, GLM-4.5) \
             with this moeflux",
            dir.display()
        ),
    )
}

impl<B: Backend> Drafter<B> for MtpDrafter<B> {
    fn draft(&mut self, session: &Session<B>, next: u32, k: usize) -> Result<Vec<u32>> {
        let rows = self.draft_logits(session, next, k)?;
        Ok((0..rows.rows).map(|i| argmax(rows.row(i))).collect())
    }

    fn prepare(&mut self, session: &mut Session<B>) {
        session.keep_hidden_states(true);
    }
}
