//! Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): a recurrent
//! state per value head updated by the gated delta rule, so its cost per
//! token does not grow with the context.

use std::ops::Range;

use super::{Weights, per_sequence};
use crate::arch::names;
use crate::backend::{Backend, GatedDeltaNetParams, RmsNorm};
use crate::config::LinearAttentionConfig;
use crate::error::Result;

pub struct GatedDeltaNet<B: Backend> {
    /// Rows q | k | v | z | b | a.
    in_proj: B::Weight,
    conv: B::Weight,
    a_log: B::Weight,
    dt_bias: B::Weight,
    norm: B::Weight,
    out_proj: B::Weight,
    cfg: LinearAttentionConfig,
    eps: f32,
}

impl<B: Backend> GatedDeltaNet<B> {
    pub fn load(w: &Weights<'_, B>, layer: usize) -> Result<Self> {
        let model = w.config();
        let cfg = model
            .linear_attention
            .clone()
            .expect("validated: linear layers have settings");
        let name = |t| names::layer(layer, t);
        Ok(GatedDeltaNet {
            in_proj: w.matrix(
                &name(names::LINEAR_IN_PROJ),
                cfg.in_proj_rows(),
                model.hidden_size,
            )?,
            conv: w.f32_tensor(
                &name(names::LINEAR_CONV),
                &[cfg.conv_dim(), cfg.conv_kernel],
            )?,
            a_log: w.f32_tensor(&name(names::LINEAR_A_LOG), &[cfg.num_value_heads])?,
            dt_bias: w.f32_tensor(&name(names::LINEAR_DT_BIAS), &[cfg.num_value_heads])?,
            norm: w.f32_tensor(&name(names::LINEAR_NORM), &[cfg.value_head_dim])?,
            out_proj: w.matrix(
                &name(names::LINEAR_OUT_PROJ),
                model.hidden_size,
                cfg.value_dim(),
            )?,
            eps: model.rms_norm_eps,
            cfg,
        })
    }

    /// `residual += gated_delta_net(norm(residual))` with the layer's input
    /// norm (weight `input_norm`), which the backend may fuse into the
    /// input projection.
    pub fn forward_add(
        &self,
        b: &B,
        input_norm: &B::Weight,
        norm: RmsNorm,
        states: &mut [&mut B::DeltaNetState],
        ranges: &[Range<usize>],
        residual: &mut B::Tensor,
    ) -> Result<()> {
        let c = &self.cfg;
        let (_, projected) =
            b.rms_norm_linear_many(residual, input_norm, norm, &[&self.in_proj])?;
        let [projected] = projected.as_slice() else {
            unreachable!("one projection")
        };
        let parts = b.split_cols(
            projected,
            &[
                c.conv_dim(),
                c.value_dim(),
                c.num_value_heads,
                c.num_value_heads,
            ],
        )?;
        let [qkv, z, beta_in, decay_in]: [B::Tensor; 4] = parts
            .try_into()
            .unwrap_or_else(|_| unreachable!("split into four parts"));
        let params = GatedDeltaNetParams {
            conv: &self.conv,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
        };
        let core = per_sequence(b, ranges, vec![qkv, beta_in, decay_in], |i, inputs| {
            let [qkv, beta_in, decay_in] = inputs.as_slice() else {
                unreachable!("three inputs")
            };
            b.gated_delta_net(states[i], qkv, beta_in, decay_in, params, c)
        })?;
        let normed = b.gated_rms_norm(&core, &z, &self.norm, self.eps)?;
        b.linear_add(residual, &normed, &self.out_proj)
    }
}
