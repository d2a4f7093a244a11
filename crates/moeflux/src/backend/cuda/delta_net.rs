//! Gated DeltaNet's causal convolution and delta rule: token by token
//! (kernels/gated_delta_net.cu), or from [`GDN_CHUNKED_MIN`] tokens in
//! chunks on the tensor cores (kernels/gdn_chunked.cu).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};

use super::geometry::{
    GDN_CHUNK, GDN_CHUNK_THREADS, GDN_LANE_ROWS, GDN_MAX_DIM, GDN_STATE_COLS, GDN_WARPS,
};
use super::{CudaBackend, DeltaNetState, Tensor, grid_stride, int};
use crate::backend::GatedDeltaNetParams;
use crate::config::LinearAttentionConfig;
use crate::error::Result;

/// Largest key head dimension of the Gated DeltaNet recurrence.
const GDN_MAX_KEY_DIM: usize = 32 * GDN_LANE_ROWS;
/// Tokens from which Gated DeltaNet's delta rule runs in chunks on the
/// tensor cores (gdn_chunked.cu) instead of token by token, unless
/// `MOEFLUX_CUDA_GDN_CHUNKED_MIN` says otherwise (a tuning knob).
pub(super) const GDN_CHUNKED_MIN: usize = 64;

/// Dynamic shared memory of the chunked Gated DeltaNet kernels
/// (gdn_chunked.cu; strides as there): gdn_chunk_prepare's K and Q (then
/// the right-hand sides), L, the inverses of L's diagonal blocks, g and β; gdn_chunk_state's state tile, U,
/// W_k, Kᵀ and update factors; gdn_chunk_output's Q, M, S0 tile, U and g.
fn gdn_chunked_shared_bytes(dk: usize, dv: usize) -> [usize; 3] {
    let ldk = dk.next_multiple_of(32) + 4;
    let ldx = dk.max(dv).next_multiple_of(32) + 4;
    let (tile_ld, tri_ld) = (GDN_STATE_COLS + 8, GDN_CHUNK + 4);
    let dk16 = dk.next_multiple_of(16);
    [
        4 * (GDN_CHUNK * (ldk + ldx + 2 * tri_ld) + 2 * GDN_CHUNK),
        4 * (dk16 * (tile_ld + tri_ld) + GDN_CHUNK * (tile_ld + ldk) + GDN_CHUNK),
        4 * (GDN_CHUNK * (ldk + tri_ld + tile_ld) + dk.next_multiple_of(8) * tile_ld + GDN_CHUNK),
    ]
}

impl CudaBackend {
    pub(super) fn gated_delta_net(
        &self,
        state: &mut DeltaNetState,
        qkv: &Tensor,
        b: &Tensor,
        a: &Tensor,
        params: GatedDeltaNetParams<'_, Self>,
        cfg: &LinearAttentionConfig,
    ) -> Result<Tensor> {
        let n = qkv.rows;
        let channels = cfg.conv_dim();
        let (nk, nv, dk, dv) = (
            cfg.num_key_heads,
            cfg.num_value_heads,
            cfg.key_head_dim,
            cfg.value_head_dim,
        );
        let kernel = cfg.conv_kernel;
        assert_eq!(qkv.cols, channels, "gated_delta_net: q|k|v width");
        assert!(
            b.cols == nv && a.cols == nv && b.rows == n && a.rows == n,
            "gated_delta_net: b and a must be [tokens, value_heads]"
        );
        assert!(
            nk > 0 && nv.is_multiple_of(nk) && dk <= GDN_MAX_KEY_DIM,
            "gated_delta_net: {nv} value heads over {nk} key heads of {dk} (at most {GDN_MAX_KEY_DIM})"
        );
        assert_eq!(
            params.conv.vector_len("gated_delta_net"),
            channels * kernel,
            "gated_delta_net: convolution taps"
        );
        assert!(
            params.a_log.vector_len("gated_delta_net") == nv
                && params.dt_bias.vector_len("gated_delta_net") == nv,
            "gated_delta_net: A_log and dt_bias need one value per value head"
        );
        let (n_i, channels_i, kernel_i) = (
            int(n, "tokens"),
            int(channels, "convolution channels"),
            int(kernel, "convolution kernel"),
        );
        let (nk_i, nv_i, dk_i, dv_i) = (
            int(nk, "key heads"),
            int(nv, "value heads"),
            int(dk, "key head dim"),
            int(dv, "value head dim"),
        );
        let mut mixed = self.alloc::<f32>("gated_delta_net", n * channels)?;
        launch!(
            self,
            "gdn_conv",
            &self.kernels.gdn_conv,
            grid_stride(n * channels),
            &qkv.data,
            &state.conv,
            &params.conv.data,
            &mut mixed,
            &n_i,
            &channels_i,
            &kernel_i
        );
        launch!(
            self,
            "gdn_conv_history",
            &self.kernels.gdn_conv_history,
            grid_stride(channels),
            &qkv.data,
            &mut state.conv,
            &n_i,
            &channels_i,
            &kernel_i
        );
        let q_scale = 1.0 / (dk as f32).sqrt();
        launch!(
            self,
            "gdn_qk_norm",
            &self.kernels.gdn_qk_norm,
            grid_stride(n * 2 * nk * 32),
            &mut mixed,
            &n_i,
            &channels_i,
            &nk_i,
            &dk_i,
            &q_scale
        );
        let mut out = self.tensor("gated_delta_net", n, cfg.value_dim())?;
        let shared = gdn_chunked_shared_bytes(dk, dv);
        let chunked = n >= self.gdn_chunked_min
            && dk <= GDN_MAX_DIM
            && dv <= GDN_MAX_DIM
            && dk.is_multiple_of(4)
            && dv.is_multiple_of(4)
            && self
                .tc_shared_limit
                .is_some_and(|limit| shared.iter().all(|&bytes| bytes <= limit));
        if chunked {
            let chunks = n.div_ceil(GDN_CHUNK);
            let pieces = nv * chunks;
            let mut work = self.alloc::<f32>(
                "gated_delta_net",
                pieces * (GDN_CHUNK * (dv + dk + GDN_CHUNK + 1) + dk * dv),
            )?;
            let config = |grid_dim: (u32, u32, u32), shared_mem_bytes: usize| LaunchConfig {
                grid_dim,
                block_dim: (GDN_CHUNK_THREADS, 1, 1),
                shared_mem_bytes: shared_mem_bytes as u32,
            };
            let column_tiles = dv.div_ceil(GDN_STATE_COLS) as u32;
            launch!(
                self,
                "gdn_chunk_prepare",
                &self.kernels.gdn_chunk_prepare,
                config((nv as u32, chunks as u32, 1), shared[0]),
                &mixed,
                &b.data,
                &a.data,
                &params.a_log.data,
                &params.dt_bias.data,
                &mut work,
                &n_i,
                &channels_i,
                &nk_i,
                &nv_i,
                &dk_i,
                &dv_i
            );
            // The state pass, then the outputs: the same parameters, the
            // last buffer written.
            let mut pass = |op: &str,
                            kernel: &CudaFunction,
                            grid: (u32, u32, u32),
                            shared_bytes: usize,
                            written: &mut CudaSlice<f32>|
             -> Result<()> {
                launch!(
                    self,
                    op,
                    kernel,
                    config(grid, shared_bytes),
                    &mixed,
                    &mut work,
                    written,
                    &n_i,
                    &channels_i,
                    &nk_i,
                    &nv_i,
                    &dk_i,
                    &dv_i
                );
                Ok(())
            };
            pass(
                "gdn_chunk_state",
                &self.kernels.gdn_chunk_state,
                (nv as u32, column_tiles, 1),
                shared[1],
                &mut state.recurrent,
            )?;
            pass(
                "gdn_chunk_output",
                &self.kernels.gdn_chunk_output,
                (nv as u32, chunks as u32, column_tiles),
                shared[2],
                &mut out.data,
            )?;
        } else {
            let config = LaunchConfig {
                grid_dim: (nv as u32, dv.div_ceil(GDN_WARPS) as u32, 1),
                block_dim: ((GDN_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(
                self,
                "gdn_recurrence",
                &self.kernels.gdn_recurrence,
                config,
                &mixed,
                &b.data,
                &a.data,
                &params.a_log.data,
                &params.dt_bias.data,
                &mut state.recurrent,
                &mut out.data,
                &n_i,
                &channels_i,
                &nk_i,
                &nv_i,
                &dk_i,
                &dv_i
            );
        }
        Ok(out)
    }
}
