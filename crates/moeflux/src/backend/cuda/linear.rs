//! Products with stored weights (kernels/linear.cu): the embedding
//! lookup, the CUDA-core products of a few tokens, and one token's
//! products, several matrices per launch and optionally with the input's
//! RMSNorm fused in. A one-token q4 product of many rows (an LM head) runs
//! on the tensor cores (matvec_tc.cu), q4 products of a few tokens take
//! linear_few.rs, and 16 tokens or more of other types take gemm.rs.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::geometry::{
    LINEAR_WARPS, MAX_JOBS, ROWS_PER_WARP, TC_VECTOR_WARPS, VEC_ROWS, VEC_WARPS,
};
use super::{
    CudaBackend, MAX_BLOCKS, MAX_SHARED_BYTES, Matrix, Tensor, Weight, experts, grid_stride, int,
};
use crate::backend::RmsNorm;
use crate::error::Result;
use crate::quant::DType;

/// Rows per block of the one-token products' whole-rows variant.
const WHOLE_ROWS: usize = VEC_WARPS * ROWS_PER_WARP;
/// Rows (over the matrices of one launch) from which the whole-rows
/// variant is used, unless `MOEFLUX_CUDA_WHOLE_ROWS_MIN` says otherwise
/// (a tuning knob).
pub(super) const WHOLE_ROWS_MIN: usize = 1024;
/// Columns from which rows are split across a block's warps whatever the
/// rows: each warp still has a long stretch to stream (o_proj of the 30B
/// shape, 2048 × 4096: 6.3 µs split, 7.7 µs whole rows, H100).
const SPLIT_COLS_MIN: usize = 4096;

/// One matrix of a launch of several (`MatvecJob` in linear.cu): device
/// addresses, its rows, and its first block of the grid.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct MatvecJob {
    codes: u64,
    scales: u64,
    biases: u64,
    out: u64,
    rows: i32,
    first_block: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct MatvecJobs {
    job: [MatvecJob; MAX_JOBS],
    count: i32,
}

// SAFETY: plain data laid out as the kernels' structs (C layout, device
// addresses as 64-bit integers).
unsafe impl DeviceRepr for MatvecJobs {}

impl CudaBackend {
    /// The jobs of one launch over up to [`MAX_JOBS`] matrices, each
    /// writing its output for `tokens` tokens, whose blocks take
    /// `rows_per_block` rows each; and the blocks of the whole grid.
    pub(super) fn pack_jobs(
        &self,
        jobs: &mut [(&Matrix<'_>, &mut CudaSlice<f32>)],
        tokens: usize,
        rows_per_block: usize,
    ) -> (MatvecJobs, usize) {
        let mut packed = MatvecJobs {
            job: [MatvecJob::default(); MAX_JOBS],
            count: jobs.len() as i32,
        };
        let mut blocks = 0;
        for (slot, (w, out)) in packed.job.iter_mut().zip(jobs.iter_mut()) {
            let l = w.layout;
            assert!(
                out.len() >= tokens * l.rows,
                "linear: output of {} too short for {tokens} token(s)",
                w.name
            );
            let (codes, scales, biases) = w.sections();
            *slot = MatvecJob {
                codes: codes.device_ptr(&self.stream).0,
                scales: scales.device_ptr(&self.stream).0,
                biases: biases.device_ptr(&self.stream).0,
                out: out.device_ptr_mut(&self.stream).0,
                rows: int(l.rows, "rows"),
                first_block: int(blocks, "blocks"),
            };
            blocks += l.rows.div_ceil(rows_per_block);
        }
        (packed, blocks)
    }
}

/// A launch of products over jobs: [`CudaBackend::few_products`] or
/// [`CudaBackend::products_tensor_cores`].
type ProductsFn = fn(
    &CudaBackend,
    &CudaSlice<f32>,
    usize,
    usize,
    &mut [(&Matrix<'_>, &mut CudaSlice<f32>)],
    bool,
) -> Result<()>;

/// The buffer a split launch's parts go to (split-major over the launch's
/// `outputs`), if it has several splits.
pub(super) struct SplitParts {
    buffer: Option<CudaSlice<f32>>,
    splits: usize,
    outputs: usize,
}

impl SplitParts {
    /// The buffer's device address for a kernel's argument (0: one split).
    pub(super) fn pointer(&mut self, stream: &CudaStream) -> u64 {
        match self.buffer.as_mut() {
            Some(b) => b.device_ptr_mut(stream).0,
            None => 0,
        }
    }
}

/// The RMSNorm a one-token product applies to its input (`FusedNorm` in
/// linear.cu): the norm's weight, where block 0 stores the normalised
/// input, and the norm's parameters.
#[repr(C)]
#[derive(Clone, Copy)]
struct FusedNorm {
    weight: u64,
    normed: u64,
    eps: f32,
    offset: f32,
}

// SAFETY: plain data laid out as the kernels' struct (C layout, device
// addresses as 64-bit integers).
unsafe impl DeviceRepr for FusedNorm {}

/// Rows from which a one-token q4 product runs on the tensor cores
/// ([`CudaBackend::matvec_tensor_cores`]): LM heads, not layer matrices.
const TC_VECTOR_ROWS_MIN: usize = 32768;
/// Blocks per SM of linear_vector_tc_q4 (two fit by registers; fewer or
/// more were slower).
const TC_VECTOR_BLOCKS_PER_SM: usize = 2;

/// Columns one 32-bit word of a row holds in the one-token kernels
/// (`WORD_COLS` in linear.cu): rows whose width is a multiple of it take
/// them.
pub(super) fn vector_cols(dtype: DType) -> usize {
    match dtype {
        DType::Q4 | DType::Mxfp4 => 8,
        DType::Q8 => 4,
        DType::Bf16 => 2,
        DType::F32 => 1,
        // Sixteen columns a 32-bit word of the bit planes (q3 adds the
        // group's high bits); experts only.
        DType::Q3 | DType::Q2 => 16,
    }
}

impl CudaBackend {
    pub(super) fn embed(&self, table: &Weight, tokens: &[u32]) -> Result<Tensor> {
        let l = table.layout;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= l.rows) {
            panic!(
                "embed: token {bad} is outside table {} of {} rows",
                table.name, l.rows
            );
        }
        let mut out = self.tensor("embed", tokens.len(), l.cols)?;
        // A step being recorded reads its tokens from the device.
        let recorded = self.recorded_tokens(tokens.len());
        let (_uploaded, ids) = match recorded {
            Some(word) => (None, word),
            None => {
                let ids = self.upload("embed", tokens)?;
                let address = ids.device_ptr(&self.stream).0;
                (Some(ids), address)
            }
        };
        let (codes, scales, biases) = table.matrix().sections();
        let dtype = table.matrix().dtype_code();
        let (n, rows, cols) = (
            int(tokens.len(), "tokens"),
            int(l.rows, "embedding rows"),
            int(l.cols, "embedding width"),
        );
        launch!(
            self,
            "embed",
            &self.kernels.embed,
            grid_stride(tokens.len() * l.cols),
            &codes,
            &scales,
            &biases,
            &dtype,
            &ids,
            &mut out.data,
            &n,
            &rows,
            &cols
        );
        Ok(out)
    }

    pub(super) fn linear(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let m = w.matrix();
        if self.few_products_fit(x.rows, x.cols, &[&m]) {
            return Ok(self
                .products_to_tensors(x, &[&m], Self::few_products)?
                .remove(0));
        }
        let data = self.matmul(&x.data, x.rows, x.cols, &m)?;
        Ok(Tensor {
            rows: x.rows,
            cols: w.layout.rows,
            data,
        })
    }

    pub(super) fn linear_many(&self, x: &Tensor, ws: &[&Weight]) -> Result<Vec<Tensor>> {
        let matrices: Vec<Matrix<'_>> = ws.iter().map(|w| w.matrix()).collect();
        let refs: Vec<&Matrix<'_>> = matrices.iter().collect();
        if self.few_products_fit(x.rows, x.cols, &refs) {
            return self.products_to_tensors(x, &refs, Self::few_products);
        }
        if self.tensor_cores_fit(x.rows, x.cols, &refs) {
            return self.products_to_tensors(x, &refs, Self::products_tensor_cores);
        }
        if x.rows != 1 || !Self::matvecs_fit(x.cols, &refs) {
            return ws.iter().map(|w| self.linear(x, w)).collect();
        }
        self.matvecs_to_tensors(&x.data, &refs, None)
    }

    /// `products` ([`CudaBackend::few_products`] or
    /// [`CudaBackend::products_tensor_cores`]) of `x` with `matrices`,
    /// into a new tensor per matrix.
    fn products_to_tensors(
        &self,
        x: &Tensor,
        matrices: &[&Matrix<'_>],
        products: ProductsFn,
    ) -> Result<Vec<Tensor>> {
        let mut outs: Vec<CudaSlice<f32>> = matrices
            .iter()
            .map(|m| self.alloc("linear", x.rows * m.layout.rows))
            .collect::<Result<_>>()?;
        let mut jobs: Vec<(&Matrix<'_>, &mut CudaSlice<f32>)> =
            matrices.iter().copied().zip(outs.iter_mut()).collect();
        products(self, &x.data, x.rows, x.cols, &mut jobs, false)?;
        Ok(outs
            .into_iter()
            .zip(matrices)
            .map(|(data, m)| Tensor {
                rows: x.rows,
                cols: m.layout.rows,
                data,
            })
            .collect())
    }

    /// Where the column splits of a launch over `jobs` for `n` tokens write
    /// their parts: none for one split.
    pub(super) fn split_parts(
        &self,
        op: &str,
        jobs: &[(&Matrix<'_>, &mut CudaSlice<f32>)],
        n: usize,
        splits: usize,
    ) -> Result<SplitParts> {
        let outputs = jobs.iter().map(|(w, _)| n * w.layout.rows).sum();
        let buffer = match splits {
            1 => None,
            _ => Some(self.alloc::<f32>(op, splits * outputs)?),
        };
        Ok(SplitParts {
            buffer,
            splits,
            outputs,
        })
    }

    /// `out_j (+)=` the sum of the parts, in split order (`sum_split_parts`),
    /// where there are several splits.
    pub(super) fn add_split_parts(
        &self,
        op: &str,
        parts: &SplitParts,
        packed: &MatvecJobs,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        let Some(buffer) = &parts.buffer else {
            return Ok(());
        };
        let (n_i, splits_i, accumulate_i) = (
            int(n, "tokens"),
            int(parts.splits, "splits"),
            i32::from(accumulate),
        );
        launch!(
            self,
            op,
            &self.kernels.sum_split_parts,
            grid_stride(parts.outputs),
            buffer,
            packed,
            &n_i,
            &splits_i,
            &accumulate_i
        );
        Ok(())
    }

    pub(super) fn rms_norm_linear_many(
        &self,
        x: &Tensor,
        weight: &Weight,
        norm: RmsNorm,
        ws: &[&Weight],
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let matrices: Vec<Matrix<'_>> = ws.iter().map(|w| w.matrix()).collect();
        let refs: Vec<&Matrix<'_>> = matrices.iter().collect();
        if x.rows != 1
            || weight.vector_len("rms_norm") != x.cols
            || !Self::matvecs_fit(x.cols, &refs)
        {
            let normed = self.rms_norm(x, weight, norm)?;
            let products = self.linear_many(&normed, ws)?;
            return Ok((normed, products));
        }
        let mut normed = self.tensor("rms_norm", 1, x.cols)?;
        let fused = FusedNorm {
            weight: weight.data.device_ptr(&self.stream).0,
            normed: normed.data.device_ptr_mut(&self.stream).0,
            eps: norm.eps,
            offset: if norm.unit_offset { 1.0 } else { 0.0 },
        };
        let products = self.matvecs_to_tensors(&x.data, &refs, Some(fused))?;
        Ok((normed, products))
    }

    pub(super) fn linear_add(&self, residual: &mut Tensor, x: &Tensor, w: &Weight) -> Result<()> {
        let m = w.matrix();
        assert!(
            residual.rows == x.rows && residual.cols == w.layout.rows,
            "linear_add: residual [{}, {}] for output [{}, {}]",
            residual.rows,
            residual.cols,
            x.rows,
            w.layout.rows
        );
        if x.rows == 1 && Self::matvecs_fit(x.cols, &[&m]) {
            self.matvecs(&x.data, &mut [(&m, &mut residual.data)], true, None)?;
        } else if self.few_products_fit(x.rows, x.cols, &[&m]) {
            let jobs = &mut [(&m, &mut residual.data)];
            self.few_products(&x.data, x.rows, x.cols, jobs, true)?;
        } else if self.tensor_cores_fit(x.rows, x.cols, &[&m]) {
            let jobs = &mut [(&m, &mut residual.data)];
            self.products_tensor_cores(&x.data, x.rows, x.cols, jobs, true)?;
        } else {
            let y = self.linear(x, w)?;
            self.add_assign(residual, &y)?;
        };
        Ok(())
    }

    /// `x · wᵀ` for `x` `[n, cols]` in device memory.
    pub(super) fn matmul(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        cols: usize,
        w: &Matrix<'_>,
    ) -> Result<CudaSlice<f32>> {
        let l = w.layout;
        assert_eq!(
            cols, l.cols,
            "linear: input width {cols} vs weight {} [{}, {}]",
            w.name, l.rows, l.cols
        );
        if let Some(out) = self.matmul_tensor_cores(x, n, cols, w)? {
            return Ok(out);
        }
        let single = n == 1;
        if single && cols.is_multiple_of(vector_cols(l.dtype)) {
            return self.matvec(x, w);
        }
        let (op, kernel) = match (l.dtype, single) {
            (DType::F32, true) => ("linear f32", &self.kernels.linear_f32_t1),
            (DType::F32, false) => ("linear f32", &self.kernels.linear_f32_t8),
            (DType::Bf16, true) => ("linear bf16", &self.kernels.linear_bf16_t1),
            (DType::Bf16, false) => ("linear bf16", &self.kernels.linear_bf16_t8),
            (DType::Q8, true) => ("linear q8", &self.kernels.linear_q8_t1),
            (DType::Q8, false) => ("linear q8", &self.kernels.linear_q8_t8),
            (DType::Q4, true) => ("linear q4", &self.kernels.linear_q4_t1),
            (DType::Q4, false) => ("linear q4", &self.kernels.linear_q4_t8),
            (DType::Q3 | DType::Q2 | DType::Mxfp4, _) => unreachable!("refused by load_weight"),
        };
        let tile = if single { 1 } else { 8 };
        let token_tiles = n.div_ceil(tile);
        assert!(
            token_tiles <= MAX_BLOCKS,
            "linear: {n} tokens in one call is too many"
        );
        let (codes, scales, biases) = w.sections();
        let mut out = self.alloc::<f32>(op, n * l.rows)?;
        let (rows, cols, n_i) = (int(l.rows, "rows"), int(cols, "columns"), int(n, "tokens"));
        let config = LaunchConfig {
            grid_dim: (l.rows.div_ceil(LINEAR_WARPS) as u32, token_tiles as u32, 1),
            block_dim: ((LINEAR_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self, op, kernel, config, &codes, &scales, &biases, x, &mut out, &rows, &cols, &n_i
        );
        Ok(out)
    }

    /// `w · x` for one token, 16 bytes of a row per lane at a time (see
    /// linear.cu), or on the tensor cores for a q4 matrix of many rows.
    fn matvec(&self, x: &CudaSlice<f32>, w: &Matrix<'_>) -> Result<CudaSlice<f32>> {
        if let Some(out) = self.matvec_tensor_cores(x, w)? {
            return Ok(out);
        }
        let mut out = self.alloc::<f32>("linear", w.layout.rows)?;
        self.matvecs(x, &mut [(w, &mut out)], false, None)?;
        Ok(out)
    }

    /// `w · x` for one token with linear_vector_tc_q4 (matvec_tc.cu) where
    /// it applies: q4, at least [`TC_VECTOR_ROWS_MIN`] rows (an LM head),
    /// compute capability 8.0 or later, the B table within the default
    /// shared memory, codes 8-byte aligned. 79.0 vs 92.4 µs for the 30B
    /// shape's LM head on an H100 (kernel bench).
    fn matvec_tensor_cores(
        &self,
        x: &CudaSlice<f32>,
        w: &Matrix<'_>,
    ) -> Result<Option<CudaSlice<f32>>> {
        let l = w.layout;
        let shared = experts::tc_staged_bytes(l.cols);
        if l.dtype != DType::Q4
            || l.rows < TC_VECTOR_ROWS_MIN
            || self.tc_shared_limit.is_none()
            || shared > MAX_SHARED_BYTES
            || !w.offset.is_multiple_of(8)
        {
            return Ok(None);
        }
        let mut out = self.alloc::<f32>("linear", l.rows)?;
        let (codes, scales, biases) = w.sections();
        let config = LaunchConfig {
            grid_dim: ((self.sm_count * TC_VECTOR_BLOCKS_PER_SM) as u32, 1, 1),
            block_dim: ((TC_VECTOR_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let (rows, cols) = (int(l.rows, "rows"), int(l.cols, "columns"));
        launch!(
            self,
            "linear q4 (tensor cores)",
            &self.kernels.linear_vector_tc_q4,
            config,
            &codes,
            &scales,
            &biases,
            x,
            &mut out,
            &rows,
            &cols
        );
        Ok(Some(out))
    }

    /// [`CudaBackend::matvecs`] into a new one-row tensor per matrix.
    fn matvecs_to_tensors(
        &self,
        x: &CudaSlice<f32>,
        matrices: &[&Matrix<'_>],
        norm: Option<FusedNorm>,
    ) -> Result<Vec<Tensor>> {
        let mut outs: Vec<CudaSlice<f32>> = matrices
            .iter()
            .map(|m| self.alloc("linear", m.layout.rows))
            .collect::<Result<_>>()?;
        let mut jobs: Vec<(&Matrix<'_>, &mut CudaSlice<f32>)> =
            matrices.iter().copied().zip(outs.iter_mut()).collect();
        self.matvecs(x, &mut jobs, false, norm)?;
        Ok(outs
            .into_iter()
            .zip(matrices)
            .map(|(data, m)| Tensor {
                rows: 1,
                cols: m.layout.rows,
                data,
            })
            .collect())
    }

    /// Whether [`CudaBackend::matvecs`] takes these matrices for one token
    /// of width `cols`: the same type, rows a whole number of 16-byte loads.
    fn matvecs_fit(cols: usize, ws: &[&Matrix<'_>]) -> bool {
        (1..=MAX_JOBS).contains(&ws.len())
            && ws.iter().all(|w| {
                w.layout.dtype == ws[0].layout.dtype
                    && w.layout.cols == cols
                    && cols.is_multiple_of(vector_cols(w.layout.dtype))
            })
    }

    /// `out_j (+)= w_j · x` for one token `x` and up to
    /// [`MAX_JOBS`] matrices of one type, in one launch; with
    /// `accumulate` each result is added to its output. With `norm` the
    /// products take the RMSNorm of x instead (see `FusedNorm` in
    /// linear.cu), which the launch also stores where `norm` says.
    fn matvecs(
        &self,
        x: &CudaSlice<f32>,
        jobs: &mut [(&Matrix<'_>, &mut CudaSlice<f32>)],
        accumulate: bool,
        norm: Option<FusedNorm>,
    ) -> Result<()> {
        let ws: Vec<&Matrix<'_>> = jobs.iter().map(|(w, _)| *w).collect();
        let cols = ws[0].layout.cols;
        assert!(
            Self::matvecs_fit(cols, &ws),
            "linear: {} matrices of one token do not fit the one-token kernel",
            ws.len()
        );
        let dtype = ws[0].layout.dtype;
        let k = &self.kernels;
        // Whole rows per warp stream faster (12.9 vs 18.4 µs for q, k and v
        // of the 30B shape on an H100); matrices of few rows (a router) need
        // the columns split to keep enough loads in flight (5.3 vs 10.7 µs).
        let whole_rows = cols < SPLIT_COLS_MIN
            && ws.iter().map(|w| w.layout.rows).sum::<usize>() >= self.whole_rows_min;
        // Per type: columns split, whole rows, and both with the norm fused.
        let (op, kernels) = match dtype {
            DType::F32 => (
                "linear f32",
                [
                    &k.linear_vector_f32,
                    &k.linear_vector_f32_rows,
                    &k.linear_vector_f32_normed,
                    &k.linear_vector_f32_rows_normed,
                ],
            ),
            DType::Bf16 => (
                "linear bf16",
                [
                    &k.linear_vector_bf16,
                    &k.linear_vector_bf16_rows,
                    &k.linear_vector_bf16_normed,
                    &k.linear_vector_bf16_rows_normed,
                ],
            ),
            DType::Q8 => (
                "linear q8",
                [
                    &k.linear_vector_q8,
                    &k.linear_vector_q8_rows,
                    &k.linear_vector_q8_normed,
                    &k.linear_vector_q8_rows_normed,
                ],
            ),
            DType::Q4 => (
                "linear q4",
                [
                    &k.linear_vector_q4,
                    &k.linear_vector_q4_rows,
                    &k.linear_vector_q4_normed,
                    &k.linear_vector_q4_rows_normed,
                ],
            ),
            DType::Q3 | DType::Q2 | DType::Mxfp4 => unreachable!("refused by load_weight"),
        };
        let kernel = kernels[usize::from(whole_rows) + 2 * usize::from(norm.is_some())];
        let rows_per_block = if whole_rows { WHOLE_ROWS } else { VEC_ROWS };
        let (packed, blocks) = self.pack_jobs(jobs, 1, rows_per_block);
        let config = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: ((VEC_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (cols_i, accumulate_i) = (int(cols, "columns"), i32::from(accumulate));
        match &norm {
            None => launch!(self, op, kernel, config, &packed, x, &cols_i, &accumulate_i),
            Some(norm) => {
                launch!(
                    self,
                    op,
                    kernel,
                    config,
                    &packed,
                    x,
                    &cols_i,
                    &accumulate_i,
                    norm
                )
            }
        };
        Ok(())
    }
}
