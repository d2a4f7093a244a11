//! The decoder stack: embeddings, then per layer `x += mixer(norm(x))` and
//! `x += ffn(norm(x))`, then the final norm and the LM head. Every
//! supported architecture is this stack with different mixers and
//! feed-forward blocks per layer.

use super::Weights;
use super::attention::{self, Attention};
use super::batch::ForwardBatch;
use super::gated_delta_net::GatedDeltaNet;
use super::mla::LatentAttention;
use super::moe::{Mlp, SparseMoe};
use crate::arch::names;
use crate::backend::{Backend, KvType, RmsNorm};
use crate::config::{FeedForwardKind, LayerKind};
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

struct Layer<B: Backend> {
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
}

impl<B: Backend> Decoder<B> {
    pub fn load(w: &Weights<'_, B>, prefetch: Prefetch) -> Result<Self> {
        let cfg = w.config();
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for (i, spec) in cfg.layers.iter().enumerate() {
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
            layers.push(Layer {
                input_norm: w.f32_tensor(&names::layer(i, names::INPUT_NORM), &[h])?,
                post_attention_norm: w
                    .f32_tensor(&names::layer(i, names::POST_ATTENTION_NORM), &[h])?,
                mixer,
                ffn,
            });
        }
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
    pub fn new_state(
        &self,
        b: &B,
        cfg: &crate::config::ModelConfig,
        kv: KvType,
    ) -> Result<Vec<LayerState<B>>> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, layer)| {
                Ok(match layer.mixer {
                    Mixer::Attention(_) | Mixer::Latent(_) => {
                        LayerState::Attention(b.new_kv_cache(attention::shape(cfg, i), kv)?)
                    }
                    Mixer::DeltaNet(_) => LayerState::DeltaNet(
                        b.new_delta_net_state(cfg.linear_attention.as_ref().expect("validated"))?,
                    ),
                })
            })
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
    /// sequence after another, or `None` when none are wanted (prefill
    /// chunks before the last).
    pub fn forward(
        &self,
        b: &B,
        batch: &ForwardBatch,
        states: &mut [&mut [LayerState<B>]],
        store: &ExpertStore,
    ) -> Result<Option<B::Tensor>> {
        assert_eq!(states.len(), batch.sequences(), "one state per sequence");
        let ranges = batch.ranges();
        let decode = batch.is_decode();
        let mut x = b.embed(&self.embed, &batch.tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let (norm, input_norm) = (self.norm, &layer.input_norm);
            match &layer.mixer {
                Mixer::Attention(_) | Mixer::Latent(_) => {
                    let mut caches: Vec<&mut B::KvCache> = states
                        .iter_mut()
                        .map(|s| match &mut s[i] {
                            LayerState::Attention(cache) => cache,
                            LayerState::DeltaNet(_) => unreachable!("state built by new_state"),
                        })
                        .collect();
                    match &layer.mixer {
                        Mixer::Attention(attn) => {
                            attn.forward_add(b, input_norm, norm, &mut caches, &ranges, &mut x)?
                        }
                        Mixer::Latent(mla) => {
                            mla.forward_add(b, input_norm, norm, &mut caches, &ranges, &mut x)?
                        }
                        Mixer::DeltaNet(_) => unreachable!("matched above"),
                    }
                }
                Mixer::DeltaNet(gdn) => {
                    let mut linear: Vec<&mut B::DeltaNetState> = states
                        .iter_mut()
                        .map(|s| match &mut s[i] {
                            LayerState::DeltaNet(state) => state,
                            LayerState::Attention(_) => unreachable!("state built by new_state"),
                        })
                        .collect();
                    gdn.forward_add(b, input_norm, norm, &mut linear, &ranges, &mut x)?
                }
            };
            let post_norm = &layer.post_attention_norm;
            match &layer.ffn {
                FeedForward::Dense(mlp) => {
                    let h = b.rms_norm(&x, post_norm, norm)?;
                    if decode {
                        self.predict_next_layer(b, i, &h, store)?;
                    }
                    mlp.forward_add(b, &h, &mut x)?
                }
                FeedForward::Sparse(moe) => {
                    let (h, routing) = moe.route(b, &x, post_norm, norm)?;
                    if decode {
                        self.predict_next_layer(b, i, &h, store)?;
                    }
                    let track = self.prefetch != Prefetch::Off && decode && batch.sequences() == 1;
                    moe.forward_add(b, &h, &routing, store, track, &mut x)?
                }
            };
        }
        if batch.logit_rows() == 0 {
            return Ok(None);
        }
        let last = if batch.logit_rows() == b.rows(&x) {
            x
        } else {
            b.gather_rows(&x, &batch.logit_ranges())?
        };
        let normed = b.rms_norm(&last, &self.final_norm, self.norm)?;
        Ok(Some(b.linear(
            &normed,
            self.lm_head.as_ref().unwrap_or(&self.embed),
        )?))
    }
}
