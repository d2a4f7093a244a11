//! The decoder stack: embeddings, then per layer `x += mixer(norm(x))` and
//! `x += ffn(norm(x))`, then the final norm and the LM head. Every
//! supported architecture is this stack with different mixers and
//! feed-forward blocks per layer.

use std::ops::Range;

use super::Weights;
use super::attention::{self, Attention};
use super::batch::ForwardBatch;
use super::gated_delta_net::GatedDeltaNet;
use super::mla::LatentAttention;
use super::moe::{Mlp, SparseMoe};
use super::mtp::{MtpHead, MtpOutput, MtpRows, MtpShared};
use crate::arch::names;
use crate::backend::{Backend, KvType, RmsNorm};
use crate::config::{FeedForwardKind, LayerKind, LayerSpec, ModelConfig};
use crate::error::Result;
use crate::experts::{ExpertStore, Prefetch};

enum Mixer<B: Backend> {
    Attention(Attention<B>),
    Latent(LatentAttention<B>),
    DeltaNet(GatedDeltaNet<B>),
}

enum FeedForward<B: Backend> {
    Dense(Mlp<B>),
    Sparse(SparseMoe<B>),
}

/// One decoder layer: `x += mixer(norm(x))`, then `x += ffn(norm(x))`.
pub(super) struct Layer<B: Backend> {
    input_norm: B::Weight,
    post_attention_norm: B::Weight,
    mixer: Mixer<B>,
    ffn: FeedForward<B>,
}

/// One sequence's state for one layer.
pub enum LayerState<B: Backend> {
    Attention(B::KvCache),
    DeltaNet(B::DeltaNetState),
}

impl<B: Backend> Layer<B> {
    /// Layer `i`, as `spec` says.
    pub(super) fn load(w: &Weights<'_, B>, i: usize, spec: &LayerSpec) -> Result<Self> {
        let cfg = w.config();
        let h = cfg.hidden_size;
        let mixer = match spec.kind {
            LayerKind::FullAttention if cfg.mla.is_some() => {
                Mixer::Latent(LatentAttention::load(w, i)?)
            }
            LayerKind::FullAttention | LayerKind::SlidingAttention => {
                Mixer::Attention(Attention::load(w, i)?)
            }
            LayerKind::LinearAttention => Mixer::DeltaNet(GatedDeltaNet::load(w, i)?),
        };
        let ffn = match spec.ffn {
            FeedForwardKind::Dense => FeedForward::Dense(Mlp::load(
                w,
                i,
                [names::MLP_GATE, names::MLP_UP, names::MLP_DOWN],
                cfg.dense_intermediate_size.unwrap_or(0),
            )?),
            FeedForwardKind::Moe => FeedForward::Sparse(SparseMoe::load(w, i)?),
        };
        Ok(Layer {
            input_norm: w.f32_tensor(&names::layer(i, names::INPUT_NORM), &[h])?,
            post_attention_norm: w
                .f32_tensor(&names::layer(i, names::POST_ATTENTION_NORM), &[h])?,
            mixer,
            ffn,
        })
    }

    /// This layer's (layer `i`'s) empty state for a new sequence.
    pub(super) fn new_state(
        &self,
        b: &B,
        cfg: &ModelConfig,
        i: usize,
        kv: KvType,
    ) -> Result<LayerState<B>> {
        Ok(match self.mixer {
            Mixer::Attention(_) | Mixer::Latent(_) => {
                LayerState::Attention(b.new_kv_cache(attention::shape(cfg, i), kv)?)
            }
            Mixer::DeltaNet(_) => LayerState::DeltaNet(
                b.new_delta_net_state(cfg.linear_attention.as_ref().expect("validated"))?,
            ),
        })
    }

    /// `x += mixer(norm(x))`, sequence `s` (rows `ranges[s]`) with its
    /// state of this layer in `states[s]`.
    pub(super) fn mix_add(
        &self,
        b: &B,
        norm: RmsNorm,
        states: &mut [&mut LayerState<B>],
        ranges: &[Range<usize>],
        x: &mut B::Tensor,
    ) -> Result<()> {
        let input_norm = &self.input_norm;
        match &self.mixer {
            Mixer::Attention(_) | Mixer::Latent(_) => {
                let mut caches: Vec<&mut B::KvCache> = states
                    .iter_mut()
                    .map(|s| match &mut **s {
                        LayerState::Attention(cache) => cache,
                        LayerState::DeltaNet(_) => unreachable!("state built by new_state"),
                    })
                    .collect();
                match &self.mixer {
                    Mixer::Attention(attn) => {
                        attn.forward_add(b, input_norm, norm, &mut caches, ranges, x)
                    }
                    Mixer::Latent(mla) => {
                        mla.forward_add(b, input_norm, norm, &mut caches, ranges, x)
                    }
                    Mixer::DeltaNet(_) => unreachable!("matched above"),
                }
            }
            Mixer::DeltaNet(gdn) => {
                let mut linear: Vec<&mut B::DeltaNetState> = states
                    .iter_mut()
                    .map(|s| match &mut **s {
                        LayerState::DeltaNet(state) => state,
                        LayerState::Attention(_) => unreachable!("state built by new_state"),
                    })
                    .collect();
                gdn.forward_add(b, input_norm, norm, &mut linear, ranges, x)
            }
        }
    }

    /// The feed-forward's input, `norm(x)`, and a MoE block's routing of it.
    pub(super) fn ffn_input(
        &self,
        b: &B,
        norm: RmsNorm,
        x: &B::Tensor,
    ) -> Result<(B::Tensor, Option<B::Routing>)> {
        let post_norm = &self.post_attention_norm;
        Ok(match &self.ffn {
            FeedForward::Dense(_) => (b.rms_norm(x, post_norm, norm)?, None),
            FeedForward::Sparse(moe) => {
                let (h, routing) = moe.route(b, x, post_norm, norm)?;
                (h, Some(routing))
            }
        })
    }

    /// `x += ffn(h)` for the input and routing [`Layer::ffn_input`] gave.
    /// `track`: tell the store which experts a decode step used.
    pub(super) fn ffn_add(
        &self,
        b: &B,
        h: &B::Tensor,
        routing: Option<&B::Routing>,
        store: &ExpertStore,
        track: bool,
        x: &mut B::Tensor,
    ) -> Result<()> {
        match (&self.ffn, routing) {
            (FeedForward::Dense(mlp), _) => mlp.forward_add(b, h, x),
            (FeedForward::Sparse(moe), Some(routing)) => {
                moe.forward_add(b, h, routing, store, track, x)
            }
            (FeedForward::Sparse(_), None) => unreachable!("ffn_input routes a MoE block"),
        }
    }
}

/// What [`Decoder::forward`] returns.
pub struct DecoderOutput<B: Backend> {
    /// The logits of the rows the batch wants, when it wants any.
    pub logits: Option<B::Tensor>,
    /// Every row's hidden state after the final norm, when asked for (the
    /// input of a multi-token-prediction head).
    pub hidden: Option<B::Tensor>,
}

pub struct Decoder<B: Backend> {
    embed: B::Weight,
    final_norm: B::Weight,
    /// `None` when tied to the embeddings.
    lm_head: Option<B::Weight>,
    layers: Vec<Layer<B>>,
    norm: RmsNorm,
    /// For each layer, the next MoE layer after it.
    next_moe: Vec<Option<usize>>,
    prefetch: Prefetch,
    mtp: Option<MtpHead<B>>,
}

impl<B: Backend> Decoder<B> {
    pub fn load(w: &Weights<'_, B>, prefetch: Prefetch) -> Result<Self> {
        let cfg = w.config();
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let layers = cfg
            .layers
            .iter()
            .enumerate()
            .map(|(i, spec)| Layer::load(w, i, spec))
            .collect::<Result<_>>()?;
        let mtp = match (&cfg.mtp, cfg.mtp_layer()) {
            (Some(mtp), Some(i)) => Some(MtpHead::load(w, Layer::load(w, i, &mtp.layer)?)?),
            _ => None,
        };
        Ok(Decoder {
            embed: w.matrix(names::EMBED, v, h)?,
            final_norm: w.f32_tensor(names::FINAL_NORM, &[h])?,
            lm_head: match cfg.tie_word_embeddings {
                true => None,
                false => Some(w.matrix(names::LM_HEAD, v, h)?),
            },
            next_moe: (0..cfg.num_layers())
                .map(|i| (i + 1..cfg.num_layers()).find(|&j| cfg.is_moe_layer(j)))
                .collect(),
            layers,
            norm: attention::norm(cfg),
            prefetch,
            mtp,
        })
    }

    /// During decode, predicts the next MoE layer's experts from this
    /// layer's MoE input and lets the store read them ahead, so the reads
    /// overlap this layer's compute.
    fn predict_next_layer(
        &self,
        b: &B,
        layer: usize,
        h: &B::Tensor,
        store: &ExpertStore,
    ) -> Result<()> {
        if self.prefetch == Prefetch::Off {
            return Ok(());
        }
        let Some(next) = self.next_moe[layer] else {
            return Ok(());
        };
        if b.experts_resident(store, next) {
            return Ok(());
        }
        if let FeedForward::Sparse(moe) = &self.layers[next].ffn {
            let named = store.predict(next, moe.predict(b, h)?, self.prefetch);
            b.prefetch_experts(store, next, &named);
        }
        Ok(())
    }

    /// Empty caches for a new sequence, keys and values stored as `kv` (a
    /// latent cache only in f32: the backend refuses another type).
    pub fn new_state(&self, b: &B, cfg: &ModelConfig, kv: KvType) -> Result<Vec<LayerState<B>>> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, layer)| layer.new_state(b, cfg, i, kv))
            .collect()
    }

    /// Whether the backend holds every expert of every MoE layer.
    pub fn experts_all_resident(&self, b: &B, store: &ExpertStore) -> bool {
        self.layers.iter().enumerate().all(|(i, layer)| {
            matches!(layer.ffn, FeedForward::Dense(_)) || b.experts_resident(store, i)
        })
    }

    /// Runs a batch through the stack, each sequence following whatever
    /// its state (`states[i]`, per layer) already holds, and returns the
    /// logits of the rows [`ForwardBatch::logit_ranges`] names, one
    /// sequence after another, or none when none are wanted (prefill
    /// chunks before the last); with `keep_hidden`, also every row's hidden
    /// state after the final norm.
    pub fn forward(
        &self,
        b: &B,
        batch: &ForwardBatch,
        states: &mut [&mut [LayerState<B>]],
        store: &ExpertStore,
        keep_hidden: bool,
    ) -> Result<DecoderOutput<B>> {
        assert_eq!(states.len(), batch.sequences(), "one state per sequence");
        let ranges = batch.ranges();
        let decode = batch.is_decode();
        let track = self.prefetch != Prefetch::Off && decode && batch.sequences() == 1;
        let mut x = b.embed(&self.embed, &batch.tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut layer_states: Vec<&mut LayerState<B>> =
                states.iter_mut().map(|s| &mut s[i]).collect();
            layer.mix_add(b, self.norm, &mut layer_states, &ranges, &mut x)?;
            let (h, routing) = layer.ffn_input(b, self.norm, &x)?;
            if decode {
                self.predict_next_layer(b, i, &h, store)?;
            }
            layer.ffn_add(b, &h, routing.as_ref(), store, track, &mut x)?;
        }
        let wanted = batch.logit_rows();
        if keep_hidden {
            let hidden = b.rms_norm(&x, &self.final_norm, self.norm)?;
            let logits = match wanted {
                0 => None,
                n if n == b.rows(&hidden) => Some(b.linear(&hidden, self.lm_head())?),
                _ => Some(b.linear(
                    &b.gather_rows(&hidden, &batch.logit_ranges())?,
                    self.lm_head(),
                )?),
            };
            return Ok(DecoderOutput {
                logits,
                hidden: Some(hidden),
            });
        }
        if wanted == 0 {
            return Ok(DecoderOutput {
                logits: None,
                hidden: None,
            });
        }
        let last = if wanted == b.rows(&x) {
            x
        } else {
            b.gather_rows(&x, &batch.logit_ranges())?
        };
        let normed = b.rms_norm(&last, &self.final_norm, self.norm)?;
        Ok(DecoderOutput {
            logits: Some(b.linear(&normed, self.lm_head())?),
            hidden: None,
        })
    }

    /// The LM head's weight (the embeddings when tied).
    fn lm_head(&self) -> &B::Weight {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// The multi-token-prediction head, when the model has one.
    pub fn mtp(&self) -> Option<&MtpHead<B>> {
        self.mtp.as_ref()
    }

    /// [`MtpHead::forward`] with the model's embeddings and LM head where
    /// the head has none of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn mtp_forward(
        &self,
        b: &B,
        state: &mut LayerState<B>,
        hidden: &B::Tensor,
        tokens: &[u32],
        first: usize,
        wanted: usize,
        store: &ExpertStore,
    ) -> Result<MtpOutput<B>> {
        let mtp = self
            .mtp
            .as_ref()
            .expect("asked of a model with an MTP head");
        mtp.forward(
            b,
            MtpShared {
                embed: &self.embed,
                lm_head: self.lm_head(),
                norm: self.norm,
            },
            state,
            MtpRows {
                hidden,
                tokens,
                first,
                wanted,
            },
            store,
        )
    }
}
