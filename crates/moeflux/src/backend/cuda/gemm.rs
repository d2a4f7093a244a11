//! `x · wᵀ` on the tensor cores for many tokens at once (prefill), in
//! kernels/gemm.cu.
//!
//! The SIMT kernels of linear.cu issue one f32 fma per weight and token,
//! which caps prefill far below what the device can do; the tensor cores
//! (`mma.sync` on bf16, sm_80 and later) do the same products many times
//! faster. They take bf16 operands, so to keep the results within f32
//! rounding of the CPU's (the accuracy the backend promises, see the
//! module documentation) the activations are split into two bf16 halves
//! and the quantized weights enter as their exact integer codes, the
//! per-group scale and bias applied afterwards in f32 (gemm.cu explains the
//! scheme).
//!
//! The results differ from the SIMT kernels' by f32 rounding only, but
//! they do differ: a token's result depends, to rounding, on whether its
//! call had [`TENSOR_CORE_MIN_TOKENS`] tokens or more (prefill and decode
//! agree to rounding, no longer bit for bit). Within the tensor-core path
//! each output is the same sequence of operations for a call of the same
//! shape, so repeated runs are identical (a call of few tokens splits its
//! columns over several blocks and adds the parts in a fixed order).

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::geometry::{GEMM_BM, GEMM_BN, GEMM_THREADS};
use super::{CudaBackend, Matrix, grid_stride, int, ok};
use crate::error::Result;
use crate::quant::DType;
use crate::quant::GROUP_SIZE;

/// Fewest tokens for which `matmul` takes the tensor-core kernels. Below
/// it most of a block's 64-token tile would be padding and linear.cu's
/// kernels (which read each weight once per 8 tokens) do about as well; a
/// first choice, to be tuned by measurement.
const TENSOR_CORE_MIN_TOKENS: usize = 16;
/// Most blocks along a grid's y dimension (the token tiles).
const MAX_GRID_Y: usize = 65_535;

impl CudaBackend {
    /// `x · wᵀ` for `x` `[n, cols]` on the tensor cores, or `None` when the
    /// call does not qualify: fewer than [`TENSOR_CORE_MIN_TOKENS`] tokens,
    /// f32 weights (no exact bf16 form), bf16 weights whose rows are not
    /// whole 16-byte vectors, or a device older than sm_80.
    pub(super) fn matmul_tensor_cores(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        cols: usize,
        w: &Matrix<'_>,
    ) -> Result<Option<CudaSlice<f32>>> {
        let l = w.layout;
        let token_tiles = n.div_ceil(GEMM_BN);
        if n < TENSOR_CORE_MIN_TOKENS || l.rows == 0 || token_tiles > MAX_GRID_Y {
            return Ok(None);
        }
        // Quantized widths are whole 64-column groups by construction.
        let (op, kernel) = match l.dtype {
            DType::Q4 => ("linear q4 (tensor cores)", &self.kernels.linear_tc_q4),
            DType::Q8 => ("linear q8 (tensor cores)", &self.kernels.linear_tc_q8),
            DType::Bf16 if cols.is_multiple_of(8) => {
                ("linear bf16 (tensor cores)", &self.kernels.linear_tc_bf16)
            }
            DType::Bf16 | DType::F32 => return Ok(None),
            DType::Q3 | DType::Q2 | DType::Mxfp4 => unreachable!("refused by load_weight"),
        };
        let (major, _) = ok(op, self.ctx.compute_capability())?;
        if major < 8 {
            return Ok(None);
        }
        let (codes, scales, biases) = w.sections();
        // Few tokens make few tiles: the stages are split over blocks, about
        // two blocks per multiprocessor in all, and the splits summed after.
        let tiles = l.rows.div_ceil(GEMM_BM) * token_tiles;
        let stages = cols.div_ceil(GROUP_SIZE);
        let split_stages = stages.div_ceil((2 * self.sm_count / tiles).clamp(1, stages));
        let splits = stages.div_ceil(split_stages);
        let count = n * l.rows;
        let mut out = self.alloc::<f32>(op, count)?;
        let mut partial = match splits {
            1 => None,
            _ => Some(self.alloc::<f32>(op, splits * count)?),
        };
        let (rows, cols_i, n_i, split_i) = (
            int(l.rows, "rows"),
            int(cols, "columns"),
            int(n, "tokens"),
            int(split_stages, "stages"),
        );
        let config = LaunchConfig {
            grid_dim: (
                l.rows.div_ceil(GEMM_BM) as u32,
                token_tiles as u32,
                splits as u32,
            ),
            block_dim: (GEMM_THREADS, 1, 1),
            // The kernels' tiles are static shared memory (38 KiB).
            shared_mem_bytes: 0,
        };
        let target = partial.as_mut().unwrap_or(&mut out);
        launch!(
            self, op, kernel, config, &codes, &scales, &biases, x, target, &rows, &cols_i, &n_i,
            &split_i
        );
        if let Some(partial) = &partial {
            let (splits_i, count_l) = (int(splits, "splits"), count as i64);
            launch!(
                self,
                op,
                &self.kernels.sum_split_outputs,
                grid_stride(count),
                partial,
                &mut out,
                &splits_i,
                &count_l
            );
        }
        Ok(Some(out))
    }
}
