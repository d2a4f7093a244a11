//! The multi-token-prediction (MTP) head, as vLLM runs the ones Qwen3-Next,
//! Qwen3.5, DeepSeek-V3 and GLM-4.5 ship (`qwen3_next_mtp.py`,
//! `deepseek_mtp.py`). Position `i` takes the main model's hidden state at
//! `i` (after its final norm) and the embedding of the token at `i + 1`:
//!
//! ```text
//! x = fc([norm_e(embed(t[i+1])); norm_h(h[i])])     (fc split per input)
//! x = decoder layer(x)                              (its own KV cache)
//! logits of t[i+2] = lm_head(norm(x))
//! ```
//!
//! Chained, a step takes the previous step's output (after `norm` or
//! before, [`MtpConfig::chain_normed`]) in place of `h` and the token it
//! drafted, one position further.

use std::slice::from_ref;

use super::Weights;
use super::decoder::{Layer, LayerState};
use crate::arch::names;
use crate::backend::{Backend, KvType, RmsNorm};
use crate::config::{ModelConfig, MtpConfig};
use crate::error::Result;
use crate::experts::ExpertStore;

pub struct MtpHead<B: Backend> {
    /// The decoder layer, numbered [`ModelConfig::mtp_layer`].
    layer: Layer<B>,
    index: usize,
    /// The head's own embeddings and LM head, where the checkpoint has
    /// them (DeepSeek-V3's copies); else the model's.
    embed: Option<B::Weight>,
    lm_head: Option<B::Weight>,
    embed_norm: B::Weight,
    hidden_norm: B::Weight,
    fc_embed: B::Weight,
    fc_hidden: B::Weight,
    norm: B::Weight,
    config: MtpConfig,
}

/// What the head shares with the model it belongs to.
pub struct MtpShared<'a, B: Backend> {
    pub embed: &'a B::Weight,
    pub lm_head: &'a B::Weight,
    pub norm: RmsNorm,
}

/// Rows of positions `first..first + n` for [`MtpHead::forward`].
pub struct MtpRows<'a, B: Backend> {
    /// `[n, hidden]`: the main model's hidden states after its final norm,
    /// or a previous step's [`MtpOutput::chained`].
    pub hidden: &'a B::Tensor,
    /// The token after each position.
    pub tokens: &'a [u32],
    /// The position of the first row.
    pub first: usize,
    /// How many of the last rows want logits.
    pub wanted: usize,
}

pub struct MtpOutput<B: Backend> {
    /// `[wanted, vocab]`: logits of the token after each row's token.
    pub logits: B::Tensor,
    /// `[wanted, hidden]`: what the next chained step takes as its hidden
    /// state.
    pub chained: B::Tensor,
}

impl<B: Backend> MtpHead<B> {
    /// The head around its decoder `layer` (loaded by the decoder, which
    /// knows how to load layers).
    pub(super) fn load(w: &Weights<'_, B>, layer: Layer<B>) -> Result<Self> {
        let cfg = w.config();
        let config = cfg
            .mtp
            .clone()
            .expect("asked of a config with an MTP layer");
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let own = |name: &str| -> Result<Option<B::Weight>> {
            match w.dir.manifest().tensors.contains_key(name) {
                true => w.matrix(name, v, h).map(Some),
                false => Ok(None),
            }
        };
        Ok(MtpHead {
            layer,
            index: cfg.num_layers(),
            embed: own(names::MTP_EMBED)?,
            lm_head: own(names::MTP_LM_HEAD)?,
            embed_norm: w.f32_tensor(names::MTP_EMBED_NORM, &[h])?,
            hidden_norm: w.f32_tensor(names::MTP_HIDDEN_NORM, &[h])?,
            fc_embed: w.matrix(names::MTP_FC_EMBED, h, h)?,
            fc_hidden: w.matrix(names::MTP_FC_HIDDEN, h, h)?,
            norm: w.f32_tensor(names::MTP_NORM, &[h])?,
            config,
        })
    }

    /// An empty KV cache of the head's layer, for a new sequence.
    pub fn new_state(&self, b: &B, cfg: &ModelConfig, kv: KvType) -> Result<LayerState<B>> {
        self.layer.new_state(b, cfg, self.index, kv)
    }

    /// Runs `rows` through the head, appending them to `state` (the
    /// head's KV cache, whose positions continue from its last row), and
    /// returns the logits and chained hidden states of the last
    /// `rows.wanted` rows.
    pub fn forward(
        &self,
        b: &B,
        shared: MtpShared<'_, B>,
        state: &mut LayerState<B>,
        rows: MtpRows<'_, B>,
        store: &ExpertStore,
    ) -> Result<MtpOutput<B>> {
        let n = rows.tokens.len();
        let norm = shared.norm;
        let embed = b.embed(self.embed.as_ref().unwrap_or(shared.embed), rows.tokens)?;
        let embed = b.rms_norm(&embed, &self.embed_norm, norm)?;
        let hidden = b.rms_norm(rows.hidden, &self.hidden_norm, norm)?;
        let mut x = b.linear(&hidden, &self.fc_hidden)?;
        if self.config.zero_first_embedding && rows.first == 0 {
            // Position 0's embedding is zero, and so is its product.
            if n > 1 {
                let rest = 1..n;
                let mut tail = b.gather_rows(&x, from_ref(&rest))?;
                let embed = b.gather_rows(&embed, from_ref(&rest))?;
                b.linear_add(&mut tail, &embed, &self.fc_embed)?;
                x = b.concat_rows(&[b.gather_rows(&x, from_ref(&(0..1)))?, tail])?;
            }
        } else {
            b.linear_add(&mut x, &embed, &self.fc_embed)?;
        }
        self.layer
            .mix_add(b, norm, &mut [state], from_ref(&(0..n)), &mut x)?;
        let (h, routing) = self.layer.ffn_input(b, norm, &x)?;
        self.layer
            .ffn_add(b, &h, routing.as_ref(), store, false, &mut x)?;
        let last = match rows.wanted {
            w if w == n => x,
            w => b.gather_rows(&x, from_ref(&(n - w..n)))?,
        };
        let normed = b.rms_norm(&last, &self.norm, norm)?;
        let logits = b.linear(&normed, self.lm_head.as_ref().unwrap_or(shared.lm_head))?;
        Ok(MtpOutput {
            logits,
            chained: match self.config.chain_normed {
                true => normed,
                false => last,
            },
        })
    }
}
