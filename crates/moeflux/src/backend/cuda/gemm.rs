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
//! columns over several blocks and adds the parts in a fixed order). Up to
//! [`MAX_JOBS`] matrices of one input (q, k and v) share a launch, and a
//! product added to a residual is added by the kernel (or the sum of its
//! splits).
//!
//! With [`CudaOptions::activations`](super::CudaOptions) int8, a prompt's
//! q4 products (not a router's, not a recorded decode step's) quantize
//! their input per group of 64 columns as the CPU's int8 activations do and
//! multiply on the integer tensor cores (gemm.cu's int8 section): the
//! CPU's int8 arithmetic, within its bound.

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig};

use super::geometry::{GEMM_BM, GEMM_BN, GEMM_I8_STAGE_BYTES, GEMM_THREADS, I8_STAGES, MAX_JOBS};
use super::linear::MatvecJobs;
use super::{CudaBackend, Matrix, grid_stride, int};
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

/// Dynamic shared memory of `linear_tc_q4_i8`: its stages in flight.
const I8_SHARED_BYTES: usize = I8_STAGES * GEMM_I8_STAGE_BYTES;

/// Activations quantized for the int8 q4 kernels (`Q8Rows` in gemm.cu):
/// the device addresses of their int8 codes and of their four f32
/// parameters per group of 64 columns.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct Q8Rows {
    pub codes: u64,
    pub params: u64,
}

// SAFETY: two u64s, laid out as the kernels' struct of two pointers.
unsafe impl DeviceRepr for Q8Rows {}

impl Q8Rows {
    /// For a kernel's parameter it does not use.
    pub const NONE: Q8Rows = Q8Rows {
        codes: 0,
        params: 0,
    };
}

/// Rows quantized by [`CudaBackend::quantize_q4_activations`], with the
/// buffers behind them (kept until the kernels reading them are queued;
/// freed in stream order after).
pub(super) struct QuantizedRows {
    pub rows: Q8Rows,
    _buffers: (CudaSlice<u8>, CudaSlice<f32>),
}

impl CudaBackend {
    /// `x · wᵀ` for `x` `[n, cols]` on the tensor cores, or `None` when the
    /// call does not qualify (see [`CudaBackend::products_tensor_cores`]).
    pub(super) fn matmul_tensor_cores(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        cols: usize,
        w: &Matrix<'_>,
    ) -> Result<Option<CudaSlice<f32>>> {
        if !self.tensor_cores_fit(n, cols, &[w]) {
            return Ok(None);
        }
        let mut out = self.alloc::<f32>("linear (tensor cores)", n * w.layout.rows)?;
        self.products_tensor_cores(x, n, cols, &mut [(w, &mut out)], false)?;
        Ok(Some(out))
    }

    /// Whether [`CudaBackend::products_tensor_cores`] takes these matrices
    /// for `n` tokens `cols` wide: at least [`TENSOR_CORE_MIN_TOKENS`]
    /// tokens, one to [`MAX_JOBS`] matrices of one type, that width and
    /// some rows, q4, q8 or bf16 (f32 has no exact bf16 form; bf16 rows
    /// must be whole 16-byte vectors), on sm_80 or later.
    pub(super) fn tensor_cores_fit(&self, n: usize, cols: usize, ws: &[&Matrix<'_>]) -> bool {
        let Some(first) = ws.first() else {
            return false;
        };
        let dtype = first.layout.dtype;
        let typed = match dtype {
            DType::Q4 | DType::Q8 => true,
            DType::Bf16 => cols.is_multiple_of(8),
            DType::F32 => false,
            DType::Q3 | DType::Q2 | DType::Mxfp4 => unreachable!("refused by load_weight"),
        };
        // `tc_shared_limit` is set from compute capability 8.0, where the
        // tensor-core kernels are built.
        self.tc_shared_limit.is_some()
            && n >= TENSOR_CORE_MIN_TOKENS
            && n.div_ceil(GEMM_BN) <= MAX_GRID_Y
            && ws.len() <= MAX_JOBS
            && typed
            && ws
                .iter()
                .all(|w| w.layout.dtype == dtype && w.layout.cols == cols && w.layout.rows > 0)
    }

    /// `out_j (+)= x · w_jᵀ` for `x` `[n, cols]` and each job's matrix
    /// (`out_j` `[n, rows_j]`) in one launch, or two where the columns are
    /// split; with `accumulate` the products are added to the outputs. The
    /// caller checked [`CudaBackend::tensor_cores_fit`].
    pub(super) fn products_tensor_cores(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        cols: usize,
        jobs: &mut [(&Matrix<'_>, &mut CudaSlice<f32>)],
        accumulate: bool,
    ) -> Result<()> {
        let int8 = jobs.iter().all(|(m, _)| m.int8) && !self.in_engine_step();
        let (op, kernel) = match jobs[0].0.layout.dtype {
            DType::Q4 if int8 => (
                "linear q4 (tensor cores, int8)",
                &self.kernels.linear_tc_q4_i8,
            ),
            DType::Q4 => ("linear q4 (tensor cores)", &self.kernels.linear_tc_q4),
            DType::Q8 => ("linear q8 (tensor cores)", &self.kernels.linear_tc_q8),
            _ => ("linear bf16 (tensor cores)", &self.kernels.linear_tc_bf16),
        };
        let token_tiles = n.div_ceil(GEMM_BN);
        let (packed, row_tiles) = self.pack_jobs(jobs, n, GEMM_BM);
        // Few tokens make few tiles: the stages are split over blocks, about
        // two blocks per multiprocessor in all, and the splits summed after.
        let tiles = row_tiles * token_tiles;
        let stages = cols.div_ceil(GROUP_SIZE);
        let split_stages = stages.div_ceil((2 * self.sm_count / tiles).clamp(1, stages));
        let splits = stages.div_ceil(split_stages);
        let mut parts = self.split_parts(op, jobs, n, splits)?;
        let partial_ptr = parts.pointer(&self.stream);
        let (cols_i, n_i, split_i, accumulate_i) = (
            int(cols, "columns"),
            int(n, "tokens"),
            int(split_stages, "stages"),
            i32::from(accumulate),
        );
        let mut config = LaunchConfig {
            grid_dim: (row_tiles as u32, token_tiles as u32, splits as u32),
            block_dim: (GEMM_THREADS, 1, 1),
            // The bf16 kernels' tiles are static shared memory (38 KiB).
            shared_mem_bytes: 0,
        };
        let args = (&packed, &partial_ptr, [cols_i, n_i, split_i, accumulate_i]);
        match int8 {
            true => {
                let quantized = self.quantize_q4_activations(op, x, n, cols)?;
                config.shared_mem_bytes = I8_SHARED_BYTES as u32;
                self.launch_linear_tc(op, kernel, config, &quantized.rows, args)?;
            }
            false => {
                let x = x.device_ptr(&self.stream).0;
                self.launch_linear_tc(op, kernel, config, &x, args)?;
            }
        }
        self.add_split_parts(op, &parts, &packed, n, accumulate)
    }

    /// One launch of a `linear_tc_*` kernel over `packed` jobs: `x` the
    /// input as the kernel takes it (the address of f32 rows, or
    /// [`Q8Rows`]), then the split parts' address, the columns, tokens,
    /// stages a split and whether to accumulate.
    fn launch_linear_tc<X: DeviceRepr>(
        &self,
        op: &str,
        kernel: &CudaFunction,
        config: LaunchConfig,
        x: &X,
        (packed, partial, [cols, n, split_stages, accumulate]): (&MatvecJobs, &u64, [i32; 4]),
    ) -> Result<()> {
        launch!(
            self,
            op,
            kernel,
            config,
            packed,
            x,
            partial,
            &cols,
            &n,
            &split_stages,
            &accumulate
        );
        Ok(())
    }

    /// `x` (`[rows, cols]`, whole groups of 64 columns) quantized for the
    /// int8 q4 kernels, in one launch.
    pub(super) fn quantize_q4_activations(
        &self,
        op: &str,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<QuantizedRows> {
        let codes = self.alloc::<u8>(op, rows * cols)?;
        let params = self.alloc::<f32>(op, 4 * rows * (cols / GROUP_SIZE))?;
        let quantized = Q8Rows {
            codes: codes.device_ptr(&self.stream).0,
            params: params.device_ptr(&self.stream).0,
        };
        let (rows_i, cols_i) = (int(rows, "tokens"), int(cols, "columns"));
        launch!(
            self,
            "quantizing activations (int8)",
            &self.kernels.quantize_activations_q4,
            grid_stride(rows * cols / 8),
            x,
            &quantized,
            &rows_i,
            &cols_i
        );
        Ok(QuantizedRows {
            rows: quantized,
            _buffers: (codes, params),
        })
    }
}
