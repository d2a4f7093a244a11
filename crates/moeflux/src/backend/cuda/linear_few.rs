//! Products of a few tokens with q4 matrices on the tensor cores
//! (kernels/linear_few.cu): the dense projections of a decode step of
//! several sequences or of a check of drafted tokens.
//!
//! gemm.rs's tiles are 64 tokens wide and a matrix of a layer has few of
//! them, so such a product spent most of its time in one tile's barriers
//! (20 µs for 16 tokens of a 4096 × 2048 matrix). Here each warp streams
//! a 16-row tile's codes straight into the MMAs, the columns are split
//! over blocks until the device is full, and up to [`MAX_JOBS`] matrices
//! of one input (q, k and v) share a launch. Each block splits its part of
//! the input into bf16 halves as gemm.rs does, so the results are within
//! f32 rounding of the other kernels' and each output is the same
//! sequence of operations for a call of the same shape.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::geometry::{FEW_LINEAR_TOKENS, FEW_LINEAR_WARPS, MAX_JOBS};
use super::{CudaBackend, Matrix, int};
use crate::error::Result;
use crate::quant::{DType, GROUP_SIZE};

/// Most tokens whose q4 products take linear_few.cu's kernels, unless
/// `MOEFLUX_CUDA_FEW_LINEAR_MAX` says otherwise; more take gemm.rs's
/// 64-token tiles.
pub(super) const FEW_LINEAR_MAX_TOKENS: usize = 32;
/// Blocks per multiprocessor the column splits aim for: as many as the
/// kernel's launch bound lets one hold (`FEW_LINEAR_MIN_BLOCKS`).
const BLOCKS_PER_SM: usize = 3;
/// Most 64-column groups a block's split takes: its staged inputs stay
/// within the default 48 KiB of shared memory.
const MAX_SPLIT_GROUPS: usize = 8;

/// Bytes of dynamic shared memory a block of `linear_few_q4_*` takes for a
/// split of `groups` groups: per token of a pass, 32 8-byte words a group
/// and 64 bytes of padding (`few_linear_stride`), then Σ x per token and
/// group.
fn staged_bytes(groups: usize) -> usize {
    FEW_LINEAR_TOKENS * (groups * 32 + 8) * 8 + FEW_LINEAR_TOKENS * groups * 4
}

/// The groups per split and the splits of `groups` 64-column groups for
/// a launch of `tiles` blocks before splitting: enough splits for
/// [`BLOCKS_PER_SM`] blocks a multiprocessor, at most
/// [`MAX_SPLIT_GROUPS`] groups a split, none empty.
fn column_splits(groups: usize, tiles: usize, sm_count: usize) -> (usize, usize) {
    let wanted = (BLOCKS_PER_SM * sm_count / tiles.max(1)).clamp(1, groups.max(1));
    let split_groups = groups.div_ceil(wanted).clamp(1, MAX_SPLIT_GROUPS);
    (split_groups, groups.div_ceil(split_groups))
}

impl CudaBackend {
    /// Whether [`CudaBackend::few_products`] takes these matrices for `n`
    /// tokens `cols` wide: 2 to `few_linear_max` tokens, compute
    /// capability 8.0 or later, one to [`MAX_JOBS`] q4 matrices of that
    /// width whose codes start 8-byte aligned.
    pub(super) fn few_products_fit(&self, n: usize, cols: usize, ws: &[&Matrix<'_>]) -> bool {
        (2..=self.few_linear_max).contains(&n)
            && self.tc_shared_limit.is_some()
            && (1..=MAX_JOBS).contains(&ws.len())
            && ws.iter().all(|w| {
                w.layout.dtype == DType::Q4 && w.layout.cols == cols && w.offset.is_multiple_of(8)
            })
    }

    /// `out_j (+)= x · w_jᵀ` for `x` `[n, cols]` and each job's matrix
    /// (`out_j` `[n, rows_j]`), in one launch, or two where the columns
    /// are split; with `accumulate` the products are added to the outputs.
    /// The caller checked [`CudaBackend::few_products_fit`].
    pub(super) fn few_products(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        cols: usize,
        jobs: &mut [(&Matrix<'_>, &mut CudaSlice<f32>)],
        accumulate: bool,
    ) -> Result<()> {
        let op = "linear q4 (few tokens)";
        let groups = cols / GROUP_SIZE;
        let (n_i, cols_i) = (int(n, "tokens"), int(cols, "columns"));
        // Column tiles of four tokens a pass.
        let (pass_tokens, kernel) = match n {
            ..=4 => (4, &self.kernels.linear_few_q4_1),
            5..=8 => (8, &self.kernels.linear_few_q4_2),
            _ => (FEW_LINEAR_TOKENS, &self.kernels.linear_few_q4_4),
        };
        let (packed, blocks) = self.pack_jobs(jobs, n, 16 * FEW_LINEAR_WARPS);
        let passes = n.div_ceil(pass_tokens);
        let (split_groups, splits) = column_splits(groups, blocks * passes, self.sm_count);
        let mut parts = self.split_parts(op, jobs, n, splits)?;
        let partial_ptr = parts.pointer(&self.stream);
        let (split_groups_i, accumulate_i) =
            (int(split_groups, "groups per split"), i32::from(accumulate));
        let config = LaunchConfig {
            grid_dim: (blocks as u32, passes as u32, splits as u32),
            block_dim: ((FEW_LINEAR_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: staged_bytes(split_groups) as u32,
        };
        launch!(
            self,
            op,
            kernel,
            config,
            &packed,
            x,
            &partial_ptr,
            &n_i,
            &cols_i,
            &split_groups_i,
            &accumulate_i
        );
        self.add_split_parts(
            "linear q4 (few tokens): adding the splits",
            &parts,
            &packed,
            n,
            accumulate,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::MAX_SHARED_BYTES;
    use super::*;

    /// Every split has groups, together they cover the columns once, and
    /// a split's staged inputs fit the shared memory a block has without
    /// opting in.
    #[test]
    fn column_splits_cover_the_columns_within_shared_memory() {
        assert!(staged_bytes(MAX_SPLIT_GROUPS) <= MAX_SHARED_BYTES);
        for groups in 1..=160 {
            for tiles in [1, 3, 40, 132, 500, 5000] {
                for sm_count in [1, 78, 132] {
                    let (split_groups, splits) = column_splits(groups, tiles, sm_count);
                    assert!((1..=MAX_SPLIT_GROUPS).contains(&split_groups));
                    assert!(
                        splits * split_groups >= groups,
                        "{groups} {tiles} {sm_count}"
                    );
                    assert!((splits - 1) * split_groups < groups, "an empty split");
                    assert!(staged_bytes(split_groups) <= MAX_SHARED_BYTES);
                }
            }
        }
    }
}
