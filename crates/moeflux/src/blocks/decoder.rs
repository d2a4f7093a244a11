//! The decoder stack: embeddings, then per layer `x += mixer(norm(x))` and
//! `x += ffn(norm(x))`, then the final norm and the LM head. Every
//! supported architecture is this stack with different mixers and
//! feed-forward blocks per layer.

use super::Weights;
use super::attention::{self, Attention};
use super::gated_delta_net::GatedDeltaNet;
use super::moe::{Mlp, SparseMoe};
use crate::arch::names;
use crate::backend::{Backend, RmsNorm};
use crate::config::{FeedForwardKind, LayerKind};
use crate::error::Result;
use crate::experts::{ExpertStore, Prefetch};

enum Mixer<B: Backend> {
    Attention(Attention<B>),
    Linear(GatedDeltaNet<B>),
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
    Linear(B::LinearState),
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
    vocab_size: usize,
}

impl<B: Backend> Decoder<B> {
    pub fn load(w: &Weights<'_, B>, prefetch: Prefetch) -> Result<Self> {
        let cfg = w.config();
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for (i, spec) in cfg.layers.iter().enumerate() {
            let mixer = match spec.kind {
                LayerKind::FullAttention => Mixer::Attention(Attention::load(w, i)?),
                LayerKind::LinearAttention => Mixer::Linear(GatedDeltaNet::load(w, i)?),
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
            vocab_size: v,
        })
    }

    /// During decode, predicts the next MoE layer's experts from this
    /// layer's MoE input and lets the store read them ahead, so the reads
    /// overlap this layer's compute.
    fn predict_next_layer(&self, b: &B, layer: usize, h: &B::Tensor, store: &ExpertStore) {
        if self.prefetch == Prefetch::Off {
            return;
        }
        let Some(next) = self.next_moe[layer] else {
            return;
        };
        if b.experts_resident(store, next) {
            return;
        }
        if let FeedForward::Sparse(moe) = &self.layers[next].ffn {
            let named = store.predict(next, moe.predict(b, h), self.prefetch);
            b.prefetch_experts(store, next, &named);
        }
    }

    /// Empty caches for a new sequence.
    pub fn new_state(&self, b: &B, cfg: &crate::config::ModelConfig) -> Vec<LayerState<B>> {
        self.layers
            .iter()
            .map(|layer| match layer.mixer {
                Mixer::Attention(_) => LayerState::Attention(b.new_kv_cache(attention::shape(cfg))),
                Mixer::Linear(_) => LayerState::Linear(
                    b.new_linear_state(cfg.linear_attention.as_ref().expect("validated")),
                ),
            })
            .collect()
    }

    /// Runs `tokens` (following whatever `state` already holds) through the
    /// stack and returns the logits of the last `logit_rows` of them, or
    /// `None` when none are wanted (a prefill chunk before the last).
    ///
    /// A decode step whose experts the backend holds entirely may be
    /// recorded by the backend and replayed on later steps (see
    /// [`Backend::step_key`]).
    pub fn forward(
        &self,
        b: &B,
        tokens: &[u32],
        state: &mut [LayerState<B>],
        store: &ExpertStore,
        logit_rows: usize,
    ) -> Result<Option<B::Tensor>> {
        if let ([token], 1) = (tokens, logit_rows)
            && self.experts_all_resident(b, store)
        {
            let mut position = 0;
            let key = {
                let mut kv = Vec::new();
                let mut linear = Vec::new();
                for layer in state.iter_mut() {
                    match layer {
                        LayerState::Attention(cache) => {
                            position = b.kv_len(cache);
                            kv.push(cache);
                        }
                        LayerState::Linear(s) => linear.push(&*s),
                    }
                }
                b.step_key(&mut kv, &linear)
            };
            if let Some(key) = key {
                if let Some(logits) = b.replay_step(key, *token, position) {
                    return Ok(Some(logits));
                }
                let vocab = self.vocab_size;
                let logits = b.record_step(key, *token, position, vocab, &mut || {
                    self.run(b, tokens, state, store, 1)
                        .map(|logits| logits.expect("one row of logits asked for"))
                })?;
                return Ok(Some(logits));
            }
        }
        self.run(b, tokens, state, store, logit_rows)
    }

    /// Whether the backend holds every expert of every MoE layer.
    fn experts_all_resident(&self, b: &B, store: &ExpertStore) -> bool {
        self.layers.iter().enumerate().all(|(i, layer)| {
            matches!(layer.ffn, FeedForward::Dense(_)) || b.experts_resident(store, i)
        })
    }

    /// [`Decoder::forward`], computed op by op.
    fn run(
        &self,
        b: &B,
        tokens: &[u32],
        state: &mut [LayerState<B>],
        store: &ExpertStore,
        logit_rows: usize,
    ) -> Result<Option<B::Tensor>> {
        let mut x = b.embed(&self.embed, tokens);
        for (i, (layer, layer_state)) in self.layers.iter().zip(state.iter_mut()).enumerate() {
            let (norm, input_norm) = (self.norm, &layer.input_norm);
            match (&layer.mixer, layer_state) {
                (Mixer::Attention(attn), LayerState::Attention(cache)) => {
                    attn.forward_add(b, input_norm, norm, cache, &mut x)
                }
                (Mixer::Linear(gdn), LayerState::Linear(s)) => {
                    gdn.forward_add(b, input_norm, norm, s, &mut x)
                }
                _ => unreachable!("state built by new_state for these layers"),
            };
            let post_norm = &layer.post_attention_norm;
            match &layer.ffn {
                FeedForward::Dense(mlp) => {
                    let h = b.rms_norm(&x, post_norm, norm);
                    if tokens.len() == 1 {
                        self.predict_next_layer(b, i, &h, store);
                    }
                    mlp.forward_add(b, &h, &mut x)
                }
                FeedForward::Sparse(moe) => {
                    let (h, routing) = moe.route(b, &x, post_norm, norm);
                    if tokens.len() == 1 {
                        self.predict_next_layer(b, i, &h, store);
                    }
                    let track = self.prefetch != Prefetch::Off;
                    moe.forward_add(b, &h, &routing, store, track, &mut x)?
                }
            };
        }
        if logit_rows == 0 {
            return Ok(None);
        }
        let last = b.last_rows(&x, logit_rows);
        let normed = b.rms_norm(&last, &self.final_norm, self.norm);
        Ok(Some(b.linear(
            &normed,
            self.lm_head.as_ref().unwrap_or(&self.embed),
        )))
    }
}
