//! The MoE router's softmax and top-k (moe.cu's route kernels), and the
//! [`Routing`] they leave on the device.

use std::sync::OnceLock;

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::geometry::ROUTE_THREADS;
use super::{CudaBackend, MAX_SHARED_BYTES, Tensor, Weight, block_per_item, int, ok};
use crate::config::RouterSpec;
use crate::error::Result;

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
    /// A plain softmax router (Qwen3's) runs in moe.cu's kernels; the
    /// others, on the host from downloaded logits (their kernels are still
    /// to be written).
    pub(super) fn route(
        &self,
        logits: &Tensor,
        spec: &RouterSpec,
        correction_bias: Option<&Weight>,
    ) -> Result<Routing> {
        if !spec.is_plain_softmax() {
            return self.route_on_host(logits, spec, correction_bias);
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

    fn route_on_host(
        &self,
        logits: &Tensor,
        spec: &RouterSpec,
        correction_bias: Option<&Weight>,
    ) -> Result<Routing> {
        let op = "route (host)";
        let host = self.download(op, &logits.data, logits.rows * logits.cols)?;
        let bias = match correction_bias {
            Some(w) => {
                let bytes = self.download(op, &w.data, w.data.len())?;
                Some(bytemuck::pod_collect_to_vec::<u8, f32>(&bytes))
            }
            None => None,
        };
        let routing = crate::backend::cpu::moe::route(&host, logits.cols, spec, bias.as_deref());
        Ok(Routing {
            top_k: routing.top_k,
            rows: logits.rows,
            experts: self.upload(op, &routing.experts)?,
            weights: self.upload(op, &routing.weights)?,
            host_experts: OnceLock::from(routing.experts),
        })
    }

    pub(super) fn selected_experts(&self, routing: &Routing) -> Result<Vec<u32>> {
        Ok(routing.experts_on_host()?.to_vec())
    }
}
