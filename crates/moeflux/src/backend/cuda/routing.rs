//! The MoE routers (moe.cu's route kernels: the plain softmax's, and
//! `route_general` for every other [`RouterSpec`]), and the [`Routing`]
//! they leave on the device, so that no router needs a host round trip.

use std::sync::OnceLock;

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

use super::geometry::ROUTE_THREADS;
use super::{CudaBackend, MAX_SHARED_BYTES, Tensor, Weight, block_per_item, int, ok};
use crate::config::{RouterSpec, ScoreFunction};
use crate::error::{Error, Result};

/// Tokens (warps) per block of the one-warp router (its kernels take any
/// number of warps per block).
const ROUTE_WARPS: usize = 4;

/// Each token's selected experts and weights on the device, and the ids on
/// the host once something asked for them (the expert store reads by id).
pub struct Routing {
    pub(super) top_k: usize,
    pub(super) rows: usize,
    pub(super) experts: CudaSlice<u32>,
    pub(super) weights: CudaSlice<f32>,
    pub(super) host_experts: OnceLock<Vec<u32>>,
}

impl Routing {
    pub(super) fn experts_on_host(&self) -> Result<&[u32]> {
        if let Some(ids) = self.host_experts.get() {
            return Ok(ids);
        }
        let stream = self.experts.stream();
        let ids = ok(
            "reading the selected experts",
            stream.clone_dtoh(&self.experts),
        )?;
        ok("reading the selected experts", stream.synchronize())?;
        Ok(self.host_experts.get_or_init(|| ids))
    }

    /// Every token's expert weights, in the order of the selected experts.
    pub fn weights_to_host(&self) -> Result<Vec<f32>> {
        let stream = self.weights.stream();
        let weights = ok(
            "reading the routing weights",
            stream.clone_dtoh(&self.weights),
        )?;
        ok("reading the routing weights", stream.synchronize())?;
        Ok(weights)
    }
}

impl CudaBackend {
    /// The selected experts on the host: a round trip a recorded step
    /// could not repeat.
    pub(super) fn routing_on_host<'a>(&self, routing: &'a Routing) -> Result<&'a [u32]> {
        self.note_unrecordable();
        routing.experts_on_host()
    }

    /// A plain softmax router (Qwen3's) runs in moe.cu's one-warp or
    /// one-block softmax kernels; every other (the grouped sigmoid router
    /// of GLM-4.5 and DeepSeek-V3, gpt-oss's softmax over the chosen) in
    /// `route_general`.
    pub(super) fn route(
        &self,
        logits: &Tensor,
        spec: &RouterSpec,
        correction_bias: Option<&Weight>,
    ) -> Result<Routing> {
        if !spec.is_plain_softmax() {
            return self.route_general(logits, spec, correction_bias);
        }
        let (top_k, normalize) = (spec.top_k, spec.renormalize);
        let (n, experts) = (logits.rows, logits.cols);
        assert!(
            top_k >= 1 && top_k <= experts && experts + 1024 <= MAX_SHARED_BYTES,
            "route: top-{top_k} of {experts} experts"
        );
        let mut ids = self.alloc::<u32>("route", n * top_k)?;
        let mut weights = self.alloc::<f32>("route", n * top_k)?;
        let (n_i, experts_i, top_k_i, normalize_i) = (
            int(n, "tokens"),
            int(experts, "experts"),
            int(top_k, "top-k"),
            i32::from(normalize),
        );
        // Up to 512 experts, one warp per token with the logits in registers;
        // more, one block per token.
        let warp_config = LaunchConfig {
            grid_dim: (n.div_ceil(ROUTE_WARPS) as u32, 1, 1),
            block_dim: ((ROUTE_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (kernel, config) = match experts {
            0..=128 => (&self.kernels.route_warp_4, warp_config),
            129..=256 => (&self.kernels.route_warp_8, warp_config),
            257..=512 => (&self.kernels.route_warp_16, warp_config),
            _ => (
                &self.kernels.route,
                block_per_item(n, ROUTE_THREADS, experts as u32),
            ),
        };
        launch!(
            self,
            "route",
            kernel,
            config,
            &logits.data,
            &mut ids,
            &mut weights,
            &n_i,
            &experts_i,
            &top_k_i,
            &normalize_i
        );
        Ok(Routing {
            top_k,
            rows: n,
            experts: ids,
            weights,
            host_experts: OnceLock::new(),
        })
    }

    fn route_general(
        &self,
        logits: &Tensor,
        spec: &RouterSpec,
        correction_bias: Option<&Weight>,
    ) -> Result<Routing> {
        let op = "route";
        let (n, experts, top_k) = (logits.rows, logits.cols, spec.top_k);
        assert!(
            top_k >= 1 && top_k <= experts,
            "route: top-{top_k} of {experts} experts"
        );
        // Per warp (token): scores, choices and group scores, then the
        // chosen flags.
        let per_warp = 13 * experts;
        if per_warp > MAX_SHARED_BYTES {
            return Err(Error::invalid(
                "--device cuda",
                format!(
                    "a router over {experts} experts exceeds the CUDA router's {} experts; \
                     run this model with --device cpu",
                    MAX_SHARED_BYTES / 13
                ),
            ));
        }
        let warps = (MAX_SHARED_BYTES / per_warp).clamp(1, ROUTE_WARPS);
        let (groups, keep) = spec.groups.map_or((0, 0), |g| (g.count, g.keep));
        assert!(
            groups == 0 || (experts.is_multiple_of(groups) && keep <= groups),
            "route: {experts} experts in {groups} groups, {keep} kept"
        );
        let bias = match correction_bias.filter(|_| spec.correction_bias) {
            Some(w) => {
                assert_eq!(
                    w.vector_len(op),
                    experts,
                    "route: one correction bias per expert"
                );
                w.data.device_ptr(&self.stream).0
            }
            None => 0,
        };
        let score: i32 = match spec.score {
            ScoreFunction::Softmax => 0,
            ScoreFunction::Sigmoid => 1,
            ScoreFunction::SoftmaxOfChosen => 2,
        };
        let (n_i, experts_i, top_k_i, groups_i, keep_i, renormalize) = (
            int(n, "tokens"),
            int(experts, "experts"),
            int(top_k, "top-k"),
            int(groups, "groups"),
            int(keep, "groups kept"),
            i32::from(spec.renormalize),
        );
        let mut ids = self.alloc::<u32>(op, n * top_k)?;
        let mut weights = self.alloc::<f32>(op, n * top_k)?;
        let config = LaunchConfig {
            grid_dim: (n.div_ceil(warps).max(1) as u32, 1, 1),
            block_dim: ((warps * 32) as u32, 1, 1),
            shared_mem_bytes: (warps * per_warp) as u32,
        };
        launch!(
            self,
            op,
            &self.kernels.route_general,
            config,
            &logits.data,
            &bias,
            &mut ids,
            &mut weights,
            &n_i,
            &experts_i,
            &top_k_i,
            &score,
            &groups_i,
            &keep_i,
            &renormalize,
            &spec.scaling
        );
        Ok(Routing {
            top_k,
            rows: n,
            experts: ids,
            weights,
            host_experts: OnceLock::new(),
        })
    }

    pub(super) fn selected_experts(&self, routing: &Routing) -> Result<Vec<u32>> {
        Ok(self.routing_on_host(routing)?.to_vec())
    }
}
