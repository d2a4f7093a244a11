//! RMSNorm and its variants (kernels/norm.cu): the norm of rows or heads,
//! Gated DeltaNet's gated norm, and attention's per-head q/k norm with
//! RoPE in one launch.

use super::geometry::{NORM_THREADS, QK_WARPS};
use super::{CudaBackend, Tensor, Weight, block_per_item, int, long};
use crate::backend::{RmsNorm, Rope};
use crate::error::Result;

/// Heads of q and k per multiprocessor from which `qk_norm_rope_warps`
/// (a warp per head) prepares them instead of `qk_norm_rope` (a block per
/// head). On an H200 (132 multiprocessors): 576 heads 4.43 µs a warp per
/// head against 3.73 a block, 2304 heads 5.58 against 10.95; the lines
/// through them cross near 6 a multiprocessor.
const QK_WARPS_MIN_HEADS_PER_SM: usize = 6;

impl CudaBackend {
    pub(super) fn rms_norm(&self, x: &Tensor, weight: &Weight, norm: RmsNorm) -> Result<Tensor> {
        let offset = if norm.unit_offset { 1.0 } else { 0.0 };
        self.norm(x, weight, None, norm.eps, offset)
    }

    pub(super) fn gated_rms_norm(
        &self,
        x: &Tensor,
        gate: &Tensor,
        weight: &Weight,
        eps: f32,
    ) -> Result<Tensor> {
        self.norm(x, weight, Some(gate), eps, 0.0)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn qk_norm_rope(
        &self,
        q: Tensor,
        k: Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        norm: RmsNorm,
        rope: Rope,
        start_pos: usize,
    ) -> Result<(Tensor, Tensor)> {
        self.qk_norm_rope_at(q, k, q_norm, k_norm, norm, rope, start_pos, 0)
    }

    /// [`Backend::qk_norm_rope`], row `t` at position `start_pos + t`, or
    /// at `positions[t]` when given (the device address of an i64 per row:
    /// rows of several sequences).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qk_norm_rope_at(
        &self,
        mut q: Tensor,
        mut k: Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        norm: RmsNorm,
        rope: Rope,
        start_pos: usize,
        positions: u64,
    ) -> Result<(Tensor, Tensor)> {
        let head_dim = rope.head_dim;
        assert!(
            q_norm.vector_len("qk_norm_rope") == head_dim
                && k_norm.vector_len("qk_norm_rope") == head_dim
                && q.rows == k.rows
                && q.cols.is_multiple_of(head_dim)
                && k.cols.is_multiple_of(head_dim)
                && rope.rotary_dim <= head_dim
                && rope.rotary_dim.is_multiple_of(2),
            "qk_norm_rope: q [{}, {}], k [{}, {}], head_dim {head_dim}, rotary_dim {}",
            q.rows,
            q.cols,
            k.rows,
            k.cols,
            rope.rotary_dim
        );
        let op = "qk_norm_rope";
        let position = match positions {
            0 => self.recorded_position(),
            _ => 0,
        };
        let frequencies = self.rope_frequencies(rope)?;
        let scale = rope.attention_factor();
        let (q_heads, k_heads) = (q.cols / head_dim, k.cols / head_dim);
        let offset = if norm.unit_offset { 1.0f32 } else { 0.0 };
        let (rows, q_heads_i, k_heads_i, head_dim_i, half, start) = (
            long(q.rows),
            int(q_heads, "query heads"),
            int(k_heads, "key heads"),
            int(head_dim, "head_dim"),
            int(rope.rotary_dim / 2, "rotary half"),
            long(start_pos),
        );
        // A block per head, or for many heads a warp per head adding in the
        // order of that block's threads.
        let block_threads = if head_dim <= 128 { 128 } else { 256 };
        let heads = q.rows * (q_heads + k_heads);
        let (kernel, config) = if heads < QK_WARPS_MIN_HEADS_PER_SM * self.sm_count {
            (
                &self.kernels.qk_norm_rope,
                block_per_item(heads, block_threads, (head_dim * 4) as u32),
            )
        } else {
            (
                &self.kernels.qk_norm_rope_warps,
                block_per_item(
                    heads.div_ceil(QK_WARPS),
                    (QK_WARPS * 32) as u32,
                    (QK_WARPS * head_dim * 4) as u32,
                ),
            )
        };
        let block_threads = int(block_threads as usize, "threads");
        launch!(
            self,
            op,
            kernel,
            config,
            &mut q.data,
            &mut k.data,
            &q_norm.data,
            &k_norm.data,
            &*frequencies,
            &rows,
            &q_heads_i,
            &k_heads_i,
            &head_dim_i,
            &half,
            &norm.eps,
            &offset,
            &start,
            &position,
            &positions,
            &scale,
            &block_threads
        );
        Ok((q, k))
    }

    /// RMSNorm of each group of `weight`'s length; `z` adds the gate of
    /// Gated DeltaNet's norm.
    fn norm(
        &self,
        x: &Tensor,
        weight: &Weight,
        z: Option<&Tensor>,
        eps: f32,
        offset: f32,
    ) -> Result<Tensor> {
        let op = if z.is_some() {
            "gated_rms_norm"
        } else {
            "rms_norm"
        };
        let group = weight.vector_len(op);
        let total = x.rows * x.cols;
        assert!(
            group > 0 && total.is_multiple_of(group),
            "{op}: {} values are not groups of {group} ({})",
            total,
            weight.name
        );
        let groups = total / group;
        // Few long groups (a decode step's rows) take wide blocks: each
        // thread's loads are serial, so fewer per thread is faster.
        let threads = match group {
            0..=128 => 128,
            129..=512 => 256,
            _ if groups < 64 => NORM_THREADS,
            _ => 256,
        };
        let config = block_per_item(groups, threads, 0);
        let mut out = self.tensor(op, x.rows, x.cols)?;
        let (groups, group) = (long(groups), int(group, "norm group"));
        match z {
            None => launch!(
                self,
                op,
                &self.kernels.rms_norm,
                config,
                &x.data,
                &weight.data,
                &mut out.data,
                &groups,
                &group,
                &eps,
                &offset
            ),
            Some(z) => {
                assert_eq!(z.rows * z.cols, total, "gated_rms_norm: gate shape");
                launch!(
                    self,
                    op,
                    &self.kernels.gated_rms_norm,
                    config,
                    &x.data,
                    &z.data,
                    &weight.data,
                    &mut out.data,
                    &groups,
                    &group,
                    &eps
                )
            }
        }
        Ok(out)
    }
}
