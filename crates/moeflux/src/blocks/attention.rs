//! Softmax attention with grouped-query heads and RoPE, and what families
//! add to it: per-head RMSNorm of q and k (Qwen3, optional in GLM-4.5), a
//! sigmoid output gate per head computed by `q_proj` alongside the queries
//! (Qwen3-Next), projection biases (GLM-4.5, gpt-oss), sink logits and a
//! sliding window (gpt-oss).

use std::ops::Range;

use super::{Weights, per_sequence};
use crate::arch::names;
use crate::backend::{AttentionShape, Backend, RmsNorm, Rope};
use crate::config::{LayerKind, ModelConfig, NormStyle};
use crate::error::Result;

pub struct Attention<B: Backend> {
    /// Rows: queries, then (gated attention) the output gates.
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    o_proj: B::Weight,
    /// Per-head q and k norms, where the family has them.
    qk_norm: Option<(B::Weight, B::Weight)>,
    /// Biases of q, k and v, and of o.
    qkv_bias: Option<[B::Weight; 3]>,
    o_bias: Option<B::Weight>,
    sinks: Option<B::Weight>,
    shape: AttentionShape,
    rope: Rope,
    norm: RmsNorm,
    output_gate: bool,
}

/// The KV cache's geometry of attention layer `layer`: the heads' (a
/// sliding-attention layer's with the window), or for MLA one head of the
/// latent width (the latent and the rotary key; no values).
pub fn shape(cfg: &ModelConfig, layer: usize) -> AttentionShape {
    if let Some(m) = &cfg.mla {
        return AttentionShape {
            num_heads: cfg.attention.num_heads,
            num_kv_heads: 1,
            head_dim: m.latent_width(),
            window: None,
            latent: true,
        };
    }
    AttentionShape {
        num_heads: cfg.attention.num_heads,
        num_kv_heads: cfg.attention.num_kv_heads,
        head_dim: cfg.attention.head_dim,
        window: match cfg.spec(layer).kind {
            LayerKind::SlidingAttention => cfg.attention.sliding_window,
            _ => None,
        },
        latent: false,
    }
}

pub fn norm(cfg: &ModelConfig) -> RmsNorm {
    RmsNorm {
        eps: cfg.rms_norm_eps,
        unit_offset: cfg.norm == NormStyle::UnitOffset,
    }
}

impl<B: Backend> Attention<B> {
    pub fn load(w: &Weights<'_, B>, layer: usize) -> Result<Self> {
        let cfg = w.config();
        let a = &cfg.attention;
        let h = cfg.hidden_size;
        let (q_dim, kv_dim) = (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim);
        let q_rows = if a.output_gate { 2 * q_dim } else { q_dim };
        let name = |t| names::layer(layer, t);
        let qk_norm = match a.qk_norm {
            true => Some((
                w.f32_tensor(&name(names::ATTN_Q_NORM), &[a.head_dim])?,
                w.f32_tensor(&name(names::ATTN_K_NORM), &[a.head_dim])?,
            )),
            false => None,
        };
        let qkv_bias = match a.qkv_bias {
            true => Some([
                w.f32_tensor(&name(names::ATTN_Q_BIAS), &[q_rows])?,
                w.f32_tensor(&name(names::ATTN_K_BIAS), &[kv_dim])?,
                w.f32_tensor(&name(names::ATTN_V_BIAS), &[kv_dim])?,
            ]),
            false => None,
        };
        Ok(Attention {
            q_proj: w.matrix(&name(names::ATTN_Q), q_rows, h)?,
            k_proj: w.matrix(&name(names::ATTN_K), kv_dim, h)?,
            v_proj: w.matrix(&name(names::ATTN_V), kv_dim, h)?,
            o_proj: w.matrix(&name(names::ATTN_O), h, q_dim)?,
            qk_norm,
            qkv_bias,
            o_bias: match a.o_bias {
                true => Some(w.f32_tensor(&name(names::ATTN_O_BIAS), &[h])?),
                false => None,
            },
            sinks: match a.sinks {
                true => Some(w.f32_tensor(&name(names::ATTN_SINKS), &[a.num_heads])?),
                false => None,
            },
            shape: shape(cfg, layer),
            rope: Rope {
                head_dim: a.head_dim,
                rotary_dim: a.rotary_dim,
                theta: a.rope_theta,
                yarn: a.rope_yarn,
            },
            norm: norm(cfg),
            output_gate: a.output_gate,
        })
    }

    /// `residual += attention(norm(residual))` with the layer's input norm
    /// (weight `input_norm`), which the backend may fuse into the q/k/v
    /// products. `ranges` are each sequence's rows of `residual`, and
    /// `caches` their KV caches: the projections run over every row, the
    /// attention itself over each sequence's rows and cache.
    pub fn forward_add(
        &self,
        b: &B,
        input_norm: &B::Weight,
        norm: RmsNorm,
        caches: &mut [&mut B::KvCache],
        ranges: &[Range<usize>],
        residual: &mut B::Tensor,
    ) -> Result<()> {
        let q_dim = self.shape.num_heads * self.shape.head_dim;
        let projections = [&self.q_proj, &self.k_proj, &self.v_proj];
        let (_, projected) = b.rms_norm_linear_many(residual, input_norm, norm, &projections)?;
        let [mut projected, mut k, mut v]: [B::Tensor; 3] = projected
            .try_into()
            .unwrap_or_else(|_| unreachable!("three projections"));
        if let Some([q_bias, k_bias, v_bias]) = &self.qkv_bias {
            b.add_bias(&mut projected, q_bias)?;
            b.add_bias(&mut k, k_bias)?;
            b.add_bias(&mut v, v_bias)?;
        }
        let (q, gate) = if self.output_gate {
            let mut parts = b.split_cols(&projected, &[q_dim, q_dim])?.into_iter();
            (parts.next().unwrap(), parts.next())
        } else {
            (projected, None)
        };
        let decode_many = ranges.len() > 1 && ranges.iter().all(|r| r.len() == 1);
        let mut out = match &self.qk_norm {
            Some((q_norm, k_norm))
                if decode_many && self.sinks.is_none() && self.shape.window.is_none() =>
            {
                b.attention_decode_many(
                    caches, q, k, &v, q_norm, k_norm, self.norm, self.rope, self.shape,
                )?
            }
            _ => self.attend_per_sequence(b, caches, ranges, q, k, v)?,
        };
        if let Some(gate) = gate {
            b.mul_sigmoid(&mut out, &gate)?;
        }
        match &self.o_bias {
            None => b.linear_add(residual, &out, &self.o_proj),
            Some(bias) => {
                let mut y = b.linear(&out, &self.o_proj)?;
                b.add_bias(&mut y, bias)?;
                b.add_assign(residual, &y)
            }
        }
    }

    /// Each sequence's queries and keys prepared and attended over its own
    /// cache.
    fn attend_per_sequence(
        &self,
        b: &B,
        caches: &mut [&mut B::KvCache],
        ranges: &[Range<usize>],
        q: B::Tensor,
        k: B::Tensor,
        v: B::Tensor,
    ) -> Result<B::Tensor> {
        per_sequence(b, ranges, vec![q, k, v], |i, qkv| {
            let [q, k, v]: [B::Tensor; 3] = qkv.try_into().unwrap_or_else(|_| unreachable!());
            let cache = &mut *caches[i];
            let start = b.kv_len(cache);
            let (q, k) = match &self.qk_norm {
                Some((q_norm, k_norm)) => {
                    b.qk_norm_rope(q, k, q_norm, k_norm, self.norm, self.rope, start)?
                }
                None => {
                    let (mut q, mut k) = (q, k);
                    b.rope(&mut q, self.rope, start)?;
                    b.rope(&mut k, self.rope, start)?;
                    (q, k)
                }
            };
            b.attention(cache, &q, &k, &v, self.shape, self.sinks.as_ref())
        })
    }
}
