//! Multi-head latent attention (DeepSeek-V3, Kimi K2): queries through a
//! low-rank projection (or one `q_proj`), a normalised latent and one
//! rotary key per token, attention with `kv_b_proj` absorbed
//! ([`Backend::mla_attention`]) so the KV cache keeps only the latent and
//! the rotary key.

use std::ops::Range;

use super::{Weights, per_sequence};
use crate::arch::names;
use crate::backend::{Backend, RmsNorm, Rope};
use crate::config::MlaConfig;
use crate::error::Result;

/// transformers' `DeepseekV3RMSNorm` of the query and latent keeps its
/// default epsilon whatever `rms_norm_eps` says.
const LATENT_NORM_EPS: f32 = 1e-6;

pub struct LatentAttention<B: Backend> {
    /// `q_a_proj` and its norm, when the query has a low rank.
    q_a: Option<(B::Weight, B::Weight)>,
    /// `q_b_proj`, or `q_proj` without a query rank.
    q: B::Weight,
    kv_a: B::Weight,
    kv_a_norm: B::Weight,
    kv_b: B::Weight,
    o_proj: B::Weight,
    mla: MlaConfig,
    heads: usize,
    /// The queries' rotation (each head's first `qk_rope_head_dim`) and
    /// the rotary key's.
    rope_q: Rope,
    rope_k: Rope,
}

impl<B: Backend> LatentAttention<B> {
    pub fn load(w: &Weights<'_, B>, layer: usize) -> Result<Self> {
        let cfg = w.config();
        let mla = cfg.mla.clone().expect("an MLA layer of an MLA config");
        let (h, heads) = (cfg.hidden_size, cfg.attention.num_heads);
        let name = |t| names::layer(layer, t);
        let q_rows = heads * mla.qk_head_dim();
        let (q_a, q) = match mla.q_lora_rank {
            Some(r) => (
                Some((
                    w.matrix(&name(names::MLA_Q_A), r, h)?,
                    w.f32_tensor(&name(names::MLA_Q_A_NORM), &[r])?,
                )),
                w.matrix(&name(names::MLA_Q_B), q_rows, r)?,
            ),
            None => (None, w.matrix(&name(names::ATTN_Q), q_rows, h)?),
        };
        let rope = Rope {
            head_dim: mla.qk_head_dim(),
            rotary_dim: mla.qk_rope_head_dim,
            theta: cfg.attention.rope_theta,
            yarn: cfg.attention.rope_yarn,
        };
        Ok(LatentAttention {
            q_a,
            q,
            kv_a: w.matrix(&name(names::MLA_KV_A), mla.latent_width(), h)?,
            kv_a_norm: w.f32_tensor(&name(names::MLA_KV_A_NORM), &[mla.kv_lora_rank])?,
            kv_b: w.matrix(
                &name(names::MLA_KV_B),
                heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                mla.kv_lora_rank,
            )?,
            o_proj: w.matrix(&name(names::ATTN_O), h, heads * mla.v_head_dim)?,
            heads,
            rope_q: rope,
            rope_k: Rope {
                head_dim: mla.qk_rope_head_dim,
                ..rope
            },
            mla,
        })
    }

    /// `residual += mla(norm(residual))` with the layer's input norm;
    /// `ranges` are each sequence's rows and `caches` their latent caches.
    pub fn forward_add(
        &self,
        b: &B,
        input_norm: &B::Weight,
        norm: RmsNorm,
        caches: &mut [&mut B::KvCache],
        ranges: &[Range<usize>],
        residual: &mut B::Tensor,
    ) -> Result<()> {
        let first = match &self.q_a {
            Some((q_a, _)) => q_a,
            None => &self.q,
        };
        let (_, products) =
            b.rms_norm_linear_many(residual, input_norm, norm, &[first, &self.kv_a])?;
        let [first, kv]: [B::Tensor; 2] = products
            .try_into()
            .unwrap_or_else(|_| unreachable!("two projections"));
        let latent_norm = RmsNorm {
            eps: LATENT_NORM_EPS,
            ..norm
        };
        let q = match &self.q_a {
            Some((_, q_a_norm)) => {
                b.linear(&b.rms_norm(&first, q_a_norm, latent_norm)?, &self.q)?
            }
            None => first,
        };
        let [latent, k_rot]: [B::Tensor; 2] = b
            .split_cols(&kv, &[self.mla.kv_lora_rank, self.mla.qk_rope_head_dim])?
            .try_into()
            .unwrap_or_else(|_| unreachable!("two parts"));
        let latent = b.rms_norm(&latent, &self.kv_a_norm, latent_norm)?;
        let out = per_sequence(b, ranges, vec![q, latent, k_rot], |i, parts| {
            let [mut q, latent, mut k_rot]: [B::Tensor; 3] =
                parts.try_into().unwrap_or_else(|_| unreachable!());
            let cache = &mut *caches[i];
            let start = b.kv_len(cache);
            b.rope(&mut q, self.rope_q, start)?;
            b.rope(&mut k_rot, self.rope_k, start)?;
            b.mla_attention(
                cache, &q, &latent, &k_rot, &self.kv_b, &self.mla, self.heads,
            )
        })?;
        b.linear_add(residual, &out, &self.o_proj)
    }
}
