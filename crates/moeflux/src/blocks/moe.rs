//! Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block
//! (a router described by a [`RouterSpec`], optionally with a bias on its
//! logits; routed experts read from the expert store, computed as the
//! configuration's [`ExpertFfn`] says; and an optional shared expert,
//! optionally scaled by a sigmoid gate).

use super::Weights;
use crate::arch::names;
use crate::backend::{Backend, ExpertFfn, RmsNorm};
use crate::config::{ExpertActivation, RouterSpec};
use crate::error::Result;
use crate::experts::ExpertStore;

/// `down(silu(gate(x)) * up(x))`.
pub struct Mlp<B: Backend> {
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
}

impl<B: Backend> Mlp<B> {
    /// Loads the three projections named `[gate, up, down]` of `layer`.
    pub fn load(
        w: &Weights<'_, B>,
        layer: usize,
        tensors: [&str; 3],
        intermediate: usize,
    ) -> Result<Self> {
        let h = w.config().hidden_size;
        let name = |t| names::layer(layer, t);
        Ok(Mlp {
            gate: w.matrix(&name(tensors[0]), intermediate, h)?,
            up: w.matrix(&name(tensors[1]), intermediate, h)?,
            down: w.matrix(&name(tensors[2]), h, intermediate)?,
        })
    }

    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        b.linear(&self.activation(b, x)?, &self.down)
    }

    /// `residual += mlp(x)`.
    pub fn forward_add(&self, b: &B, x: &B::Tensor, residual: &mut B::Tensor) -> Result<()> {
        b.linear_add(residual, &self.activation(b, x)?, &self.down)
    }

    /// `silu(gate(x)) * up(x)`.
    fn activation(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let [gate, up]: [B::Tensor; 2] = b
            .linear_many(x, &[&self.gate, &self.up])?
            .try_into()
            .unwrap_or_else(|_| unreachable!("two projections"));
        b.silu_mul(&gate, &up)
    }
}

pub struct SparseMoe<B: Backend> {
    layer: usize,
    router: B::Weight,
    router_bias: Option<B::Weight>,
    spec: RouterSpec,
    activation: ExpertActivation,
    /// The routed experts' gate, up and down biases.
    expert_biases: Option<[B::Weight; 3]>,
    /// The per-expert bias of a router that corrects its choice with one.
    correction_bias: Option<B::Weight>,
    /// The shared expert and, when it has one, its `[1, hidden]` gate.
    shared: Option<(Mlp<B>, Option<B::Weight>)>,
}

impl<B: Backend> SparseMoe<B> {
    pub fn load(w: &Weights<'_, B>, layer: usize) -> Result<Self> {
        let cfg = w.config();
        let moe = &cfg.moe;
        let h = cfg.hidden_size;
        let name = |t| names::layer(layer, t);
        let shared = match moe.shared_expert {
            Some(shared) => Some((
                Mlp::load(
                    w,
                    layer,
                    [names::SHARED_GATE, names::SHARED_UP, names::SHARED_DOWN],
                    shared.intermediate_size,
                )?,
                match shared.gated {
                    true => Some(w.router(&name(names::SHARED_EXPERT_GATE), 1, h)?),
                    false => None,
                },
            )),
            None => None,
        };
        let correction_bias = match moe.router.correction_bias {
            true => Some(w.f32_tensor(&name(names::MOE_ROUTER_CORRECTION), &[moe.num_experts])?),
            false => None,
        };
        let (e, inter) = (moe.num_experts, moe.expert_intermediate_size);
        let expert_biases = match moe.expert_bias {
            true => Some([
                w.f32_tensor(&name(names::EXPERTS_GATE_BIAS), &[e, inter])?,
                w.f32_tensor(&name(names::EXPERTS_UP_BIAS), &[e, inter])?,
                w.f32_tensor(&name(names::EXPERTS_DOWN_BIAS), &[e, h])?,
            ]),
            false => None,
        };
        Ok(SparseMoe {
            layer,
            router: w.router(&name(names::MOE_ROUTER), moe.num_experts, h)?,
            router_bias: match moe.router_bias {
                true => Some(w.f32_tensor(&name(names::MOE_ROUTER_BIAS), &[e])?),
                false => None,
            },
            spec: moe.router.clone(),
            activation: moe.expert_activation,
            expert_biases,
            correction_bias,
            shared,
        })
    }

    /// The experts this layer's router would pick for `x`, without
    /// computing them (prefetch prediction for this layer from an earlier
    /// layer's input).
    pub fn predict(&self, b: &B, x: &B::Tensor) -> Result<Vec<u32>> {
        let mut logits = b.linear(x, &self.router)?;
        if let Some(bias) = &self.router_bias {
            b.add_bias(&mut logits, bias)?;
        }
        b.selected_experts(&b.route(&logits, &self.spec, self.correction_bias.as_ref())?)
    }

    /// The block's input, `norm(residual)` with the layer's
    /// post-attention norm (weight `post_attention_norm`), and the router's
    /// choice for it; the backend may fuse the norm into the router's
    /// product.
    pub fn route(
        &self,
        b: &B,
        residual: &B::Tensor,
        post_attention_norm: &B::Weight,
        norm: RmsNorm,
    ) -> Result<(B::Tensor, B::Routing)> {
        let (x, logits) =
            b.rms_norm_linear_many(residual, post_attention_norm, norm, &[&self.router])?;
        let [mut logits]: [B::Tensor; 1] = logits
            .try_into()
            .unwrap_or_else(|_| unreachable!("one product"));
        if let Some(bias) = &self.router_bias {
            b.add_bias(&mut logits, bias)?;
        }
        let routing = b.route(&logits, &self.spec, self.correction_bias.as_ref())?;
        Ok((x, routing))
    }

    /// How this layer's experts compute.
    fn ffn(&self) -> ExpertFfn<'_, B> {
        ExpertFfn {
            activation: self.activation,
            biases: self.expert_biases.as_ref().map(|[g, u, d]| [g, u, d]),
        }
    }

    /// `residual += moe(x)` for the `routing` [`SparseMoe::route`] gave
    /// with x. `track_routing`: tell the store which experts a decode step
    /// of one sequence used (for prefetch prediction; costs a
    /// device-to-host copy on a GPU).
    pub fn forward_add(
        &self,
        b: &B,
        x: &B::Tensor,
        routing: &B::Routing,
        store: &ExpertStore,
        track_routing: bool,
        residual: &mut B::Tensor,
    ) -> Result<()> {
        if track_routing && !b.experts_resident(store, self.layer) {
            store.note_decode_routing(self.layer, &b.selected_experts(routing)?);
        }
        if store.counting_routing() {
            store.note_routing(self.layer, &b.selected_experts(routing)?);
        }
        match &self.shared {
            None => b.routed_experts_add(residual, x, routing, store, self.layer, self.ffn()),
            Some((mlp, gate)) => {
                let mut out = b.routed_experts(x, routing, store, self.layer, self.ffn())?;
                let mut shared = mlp.forward(b, x)?;
                if let Some(gate) = gate {
                    b.mul_sigmoid(&mut shared, &b.linear(x, gate)?)?;
                }
                b.add_assign(&mut out, &shared)?;
                b.add_assign(residual, &out)
            }
        }
    }
}
