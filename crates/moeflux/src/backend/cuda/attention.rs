//! Attention over the KV caches (kernels/attention.cu): a block per
//! (token, head) for a few tokens; one token's decode kernels, which store
//! its key and value into the cache themselves, take a KV head's group of
//! query heads per block where they can (each key and value read once),
//! and split long contexts over several blocks per head (flash-decoding);
//! the decode step of several sequences, each over its own cache; and
//! from [`FLASH_MIN_TOKENS`] tokens FlashAttention's tiles on the tensor
//! cores (bf16 MMAs of operands split in two, about f32 accuracy; sm_80
//! and later).

use cudarc::driver::{CudaFunction, DevicePtr, LaunchConfig};

use super::geometry::{
    ATTN_MAX_PER_LANE, ATTN_WARPS, DECODE_ATTN_WARPS, FA_KEYS, FA_ROWS_PER_WARP, FA_WARPS,
    FA_WORD_PAD, GD_WARPS,
};
use super::{CudaBackend, KvCache, Tensor, Weight, block_per_item, int, long};
use crate::backend::{AttentionShape, KvType, RmsNorm, Rope, attention_decode_each};
use crate::error::Result;

/// Threads per block of the attention kernel.
const ATTENTION_THREADS: u32 = (ATTN_WARPS * 32) as u32;
/// Threads per block of its one-token variant.
const ATTENTION_DECODE_THREADS: u32 = (DECODE_ATTN_WARPS * 32) as u32;
/// Largest head dimension of the attention kernels.
const MAX_HEAD_DIM: usize = ATTN_MAX_PER_LANE * 32;
/// Query rows per block of the prefill attention kernels (`FA_ROWS` in
/// attention.cu).
const FA_ROWS: usize = FA_WARPS * FA_ROWS_PER_WARP;
/// Largest head dimension of the prefill attention kernels.
const FLASH_MAX_HEAD_DIM: usize = 256;
/// Tokens from which attention takes the prefill kernels: with fewer, the
/// (token, head) blocks of the other kernel are more parallel.
const FLASH_MIN_TOKENS: usize = 16;

/// The head dimension a prefill attention kernel is compiled for: the
/// smallest of 128 and 256 that holds `head_dim`.
fn flash_kernel_dim(head_dim: usize) -> usize {
    if head_dim <= 128 {
        128
    } else {
        FLASH_MAX_HEAD_DIM
    }
}

/// Dynamic shared memory of a prefill attention block whose kernel is
/// compiled for `kernel_dim`, over a cache of type `kv`: its query rows, a
/// tile of keys and the tile's values transposed, each as bf16 hi and lo
/// words, every row padded; then, if it `copies` its tiles, the next
/// tile's keys and values as the cache holds them (q8: and a scale for
/// every four values).
fn flash_attention_shared_bytes(kernel_dim: usize, kv: KvType, copies: bool) -> usize {
    let words = (FA_ROWS + FA_KEYS) * (kernel_dim / 2 + FA_WORD_PAD)
        + kernel_dim * (FA_KEYS / 2 + FA_WORD_PAD);
    let raw_row = kernel_dim * kv.value_bytes()
        + match kv {
            KvType::Q8 => kernel_dim,
            _ => 0,
        };
    2 * 4 * words + if copies { 2 * FA_KEYS * raw_row } else { 0 }
}

/// Positions from which a decode step of one sequence takes the grouped
/// kernels on the CUDA cores, unless `MOEFLUX_CUDA_GROUPED_DECODE_MIN` says
/// otherwise (a tuning knob): with fewer, a block per query head spreads
/// the work over more blocks. The tensor-core kernel of bf16 caches is
/// faster than a block per query head from the first position (H200,
/// qwen3-30b-a3b: after 1024 positions 392.9 tok/s against 362.6, after
/// 4000 377.5 against 369.7, level after 128) and is taken at every
/// length; that of f32 caches from [`GROUPED_DECODE_TC_F32_MIN`]. A step
/// of several sequences has blocks enough for every multiprocessor at any
/// length and takes the grouped kernels always: the per-head kernels'
/// blocks of 16 warps, one a multiprocessor, made 4 waves of 16 sequences'
/// 512 (H200, qwen3-30b-a3b shape: 16 sequences 1559.2, 1562.7 tok/s
/// against 1508.1, 1517.2; 64 sequences 3432.2, 3371.8 against 2986.5,
/// 2996.3).
pub(super) const GROUPED_DECODE_MIN: usize = 2048;

/// Positions from which one sequence's decode step over an f32 cache takes
/// the tensor-core grouped kernel, whose steps load the values after the
/// scores: against a block per query head (H200, qwen3-30b-a3b) it is
/// slower after 128 positions (404.0, 409.6 tok/s against 423.1, 424.7),
/// level after 256 (402.9 against 399.5) and faster from 384 (406.0
/// against 374.4; after 512 392.1 against 337.0).
pub(super) const GROUPED_DECODE_TC_F32_MIN: usize = 256;

/// A decode step's attention kernels: after long contexts, a block per KV
/// head and its group of query heads, which reads each key and value once,
/// where a kernel exists for the head size and group; else a block per
/// query head.
#[derive(Clone, Copy)]
enum DecodeKernels {
    /// `attention_decode_grouped_*`: the group's size bound.
    Grouped {
        max_group: usize,
    },
    PerHead,
}

impl DecodeKernels {
    /// The kernels for a step of one sequence attending to `positions`.
    fn choose(shape: AttentionShape, positions: usize, grouped_min: usize) -> DecodeKernels {
        match positions >= grouped_min {
            true => DecodeKernels::at_every_length(shape),
            false => DecodeKernels::PerHead,
        }
    }

    /// The grouped kernels where `shape` has them, else a block per head.
    fn at_every_length(shape: AttentionShape) -> DecodeKernels {
        let group = shape.num_heads / shape.num_kv_heads;
        let hd = shape.head_dim;
        if group < 2 || !hd.is_multiple_of(4) {
            return DecodeKernels::PerHead;
        }
        match (hd, group) {
            (..=128, ..=8) => DecodeKernels::Grouped { max_group: 8 },
            (..=128, ..=16) => DecodeKernels::Grouped { max_group: 16 },
            (129..=256, ..=8) => DecodeKernels::Grouped { max_group: 8 },
            _ => DecodeKernels::PerHead,
        }
    }

    /// Blocks per sequence and split, and threads per block.
    fn blocks(self, shape: AttentionShape) -> (usize, u32) {
        match self {
            DecodeKernels::Grouped { .. } => (shape.num_kv_heads, (GD_WARPS * 32) as u32),
            DecodeKernels::PerHead => (shape.num_heads, ATTENTION_DECODE_THREADS),
        }
    }
}

impl CudaBackend {
    /// Blocks a head's positions are split over in a decode step with
    /// `blocks` (head, sequence) blocks: enough for about two per
    /// multiprocessor. The kernels use fewer while the context is short.
    pub(super) fn decode_splits(&self, blocks: usize) -> usize {
        (2 * self.sm_count)
            .div_ceil(blocks.max(1))
            .clamp(1, self.decode_splits_max)
    }

    /// Whether the grouped kernels of `shape` over a `kv` cache run on the
    /// tensor cores: bf16 and f32 caches, heads of 128 and groups up to 8.
    fn grouped_on_tensor_cores(&self, shape: AttentionShape, kv: KvType) -> bool {
        self.grouped_decode_tc
            && matches!(kv, KvType::Bf16 | KvType::F32)
            && shape.head_dim == 128
            && matches!(
                DecodeKernels::at_every_length(shape),
                DecodeKernels::Grouped { max_group: 8 }
            )
    }

    /// Positions from which one sequence's decode step over a `kv` cache of
    /// `shape` takes the grouped kernels (see [`GROUPED_DECODE_MIN`]).
    fn grouped_decode_min(&self, shape: AttentionShape, kv: KvType) -> usize {
        match (
            self.grouped_decode_min,
            self.grouped_on_tensor_cores(shape, kv),
        ) {
            (Some(min), _) => min,
            (None, true) if kv == KvType::Bf16 => 0,
            (None, true) => GROUPED_DECODE_TC_F32_MIN,
            (None, false) => GROUPED_DECODE_MIN,
        }
    }

    /// Whether one sequence's next decode step over `cache` takes the
    /// grouped kernels when its shape has them (so recorded steps are told
    /// apart).
    pub(super) fn grouped_decode(&self, cache: &KvCache) -> bool {
        cache.attended_next() >= self.grouped_decode_min(cache.shape(), cache.kv_type())
    }

    fn decode_kernel(
        &self,
        kernels: DecodeKernels,
        shape: AttentionShape,
        many: bool,
        kv: KvType,
    ) -> &CudaFunction {
        let head_dim = shape.head_dim;
        if matches!(kernels, DecodeKernels::Grouped { .. })
            && self.grouped_on_tensor_cores(shape, kv)
        {
            let k = &self.kernels;
            return match (kv, many) {
                (KvType::Bf16, false) => &k.attention_decode_grouped_tc_bf16,
                (KvType::Bf16, true) => &k.attention_decode_batch_grouped_tc_bf16,
                (_, false) => &k.attention_decode_grouped_tc_f32,
                (_, true) => &k.attention_decode_batch_grouped_tc_f32,
            };
        }
        let k = self.kernels.kv(kv);
        match (kernels, head_dim, many) {
            (DecodeKernels::Grouped { max_group: 8 }, ..=128, false) => {
                &k.attention_decode_grouped_128_g8
            }
            (DecodeKernels::Grouped { max_group: 8 }, ..=128, true) => {
                &k.attention_decode_batch_grouped_128_g8
            }
            (DecodeKernels::Grouped { .. }, ..=128, false) => &k.attention_decode_grouped_128_g16,
            (DecodeKernels::Grouped { .. }, ..=128, true) => {
                &k.attention_decode_batch_grouped_128_g16
            }
            (DecodeKernels::Grouped { .. }, _, false) => &k.attention_decode_grouped_256_g8,
            (DecodeKernels::Grouped { .. }, _, true) => &k.attention_decode_batch_grouped_256_g8,
            (DecodeKernels::PerHead, ..=128, false) => &k.attention_decode_128,
            (DecodeKernels::PerHead, 129..=256, false) => &k.attention_decode_256,
            (DecodeKernels::PerHead, _, false) => &k.attention_decode_512,
            (DecodeKernels::PerHead, ..=128, true) => &k.attention_decode_batch_128,
            (DecodeKernels::PerHead, 129..=256, true) => &k.attention_decode_batch_256,
            (DecodeKernels::PerHead, _, true) => &k.attention_decode_batch_512,
        }
    }

    pub(super) fn attention(
        &self,
        cache: &mut KvCache,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        shape: AttentionShape,
        sinks: Option<&Weight>,
    ) -> Result<Tensor> {
        let (heads, kv_heads, head_dim) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let n = q.rows;
        assert!(
            kv_heads > 0 && heads.is_multiple_of(kv_heads) && head_dim <= MAX_HEAD_DIM,
            "attention: {heads} heads over {kv_heads} KV heads of {head_dim} (at most {MAX_HEAD_DIM})"
        );
        assert_eq!(q.cols, heads * head_dim, "attention: query width");
        assert!(
            k.cols == kv_heads * head_dim && v.cols == k.cols && k.rows == n && v.rows == n,
            "attention: key/value shapes"
        );
        if let Some(sinks) = sinks {
            assert_eq!(
                sinks.vector_len("attention"),
                heads,
                "attention: one sink per head"
            );
        }
        // One token: the attention kernel stores its key and value itself.
        // `start` is the cache row of the first new position; a recorded
        // step reads it from a sliding window's row word, or else from the
        // position word (the row of a cache without a window).
        let (start, position) = if n == 1 {
            self.kv_claim(cache, 1)?
        } else {
            self.kv_append(cache, &k.data, &v.data, n)?;
            let position = match self.recorded_position() {
                0 => 0,
                word => cache.row_word(self).unwrap_or(word),
            };
            (cache.held() - n, position)
        };
        let window = int(shape.window.unwrap_or(0), "window");
        let sinks = sinks.map_or(0, |w| w.data.device_ptr(&self.stream).0);
        let mut out = self.tensor("attention", n, heads * head_dim)?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (n_i, heads_i, kv_heads_i, head_dim_i, start_l) = (
            int(n, "tokens"),
            int(heads, "heads"),
            int(kv_heads, "KV heads"),
            int(head_dim, "head_dim"),
            long(start),
        );
        let kernels = self.kernels.kv(cache.kv_type());
        let flash_dim = flash_kernel_dim(head_dim);
        // Tiles copied ahead where a block holds the copy (and it is not
        // turned off), else staged straight from the cache.
        let flash = self.tc_shared_limit.and_then(|limit| {
            let fits = |copies| {
                let bytes = flash_attention_shared_bytes(flash_dim, cache.kv_type(), copies);
                (bytes <= limit).then_some((copies, bytes))
            };
            self.attention_copies
                .then(|| fits(true))
                .flatten()
                .or_else(|| fits(false))
        });
        if n >= FLASH_MIN_TOKENS
            && head_dim <= FLASH_MAX_HEAD_DIM
            && head_dim.is_multiple_of(4)
            && let Some((copies, flash_shared)) = flash
        {
            // Its start is the host's: a recording could not move it on.
            self.note_unrecordable();
            let kernel = match (flash_dim, copies) {
                (128, true) => &kernels.flash_attention_128,
                (_, true) => &kernels.flash_attention_256,
                (128, false) => &kernels.flash_attention_128_direct,
                (_, false) => &kernels.flash_attention_256_direct,
            };
            let rows = n * (heads / kv_heads);
            let config = LaunchConfig {
                grid_dim: (
                    u32::try_from(rows.div_ceil(FA_ROWS)).expect("attention: too many tokens"),
                    u32::try_from(kv_heads).expect("attention: too many KV heads"),
                    1,
                ),
                block_dim: ((FA_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: flash_shared as u32,
            };
            launch!(
                self,
                "attention (prefill)",
                kernel,
                config,
                &q.data,
                cache.keys(),
                cache.key_scales(),
                cache.values(),
                cache.value_scales(),
                &mut out.data,
                &n_i,
                &heads_i,
                &kv_heads_i,
                &head_dim_i,
                &start_l,
                &scale,
                &window,
                &sinks
            );
            return Ok(out);
        }
        if n > 1 {
            launch!(
                self,
                "attention",
                &kernels.attention,
                block_per_item(n * heads, ATTENTION_THREADS, 0),
                &q.data,
                cache.keys(),
                cache.key_scales(),
                cache.values(),
                cache.value_scales(),
                &mut out.data,
                &n_i,
                &heads_i,
                &kv_heads_i,
                &head_dim_i,
                &start_l,
                &position,
                &scale,
                &window,
                &sinks
            );
            return Ok(out);
        }
        // One token: the kernel reads the token's key and value from k and
        // v and writes them into the cache.
        let attended = shape.window.map_or(start + 1, |w| w.min(start + 1));
        let kv = cache.kv_type();
        let kernels = DecodeKernels::choose(shape, attended, self.grouped_decode_min(shape, kv));
        let kernel = self.decode_kernel(kernels, shape, false, kv);
        let (new_k, new_v) = (
            k.data.device_ptr(&self.stream).0,
            v.data.device_ptr(&self.stream).0,
        );
        let (blocks, threads) = kernels.blocks(shape);
        let splits = self.decode_splits(blocks);
        let config = LaunchConfig {
            grid_dim: (
                u32::try_from(blocks).expect("attention: too many heads"),
                1,
                splits as u32,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let splits_i = int(splits, "splits");
        launch!(
            self,
            "attention",
            kernel,
            config,
            &q.data,
            cache.keys(),
            cache.key_scales(),
            cache.values(),
            cache.value_scales(),
            &mut out.data,
            &n_i,
            &heads_i,
            &kv_heads_i,
            &head_dim_i,
            &start_l,
            &position,
            &scale,
            &new_k,
            &new_v,
            &window,
            &sinks,
            &splits_i,
            cache.partials(),
            cache.tickets()
        );
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_decode_many(
        &self,
        caches: &mut [&mut KvCache],
        q: Tensor,
        k: Tensor,
        v: &Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        norm: RmsNorm,
        rope: Rope,
        shape: AttentionShape,
    ) -> Result<Tensor> {
        let (heads, kv_heads, head_dim) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let n = caches.len();
        assert!(
            kv_heads > 0 && heads.is_multiple_of(kv_heads) && head_dim <= MAX_HEAD_DIM,
            "attention: {heads} heads over {kv_heads} KV heads of {head_dim} (at most {MAX_HEAD_DIM})"
        );
        assert!(
            q.rows == n
                && k.rows == n
                && v.rows == n
                && q.cols == heads * head_dim
                && k.cols == kv_heads * head_dim
                && v.cols == k.cols,
            "attention: {n} sequences' query, key and value shapes"
        );
        let kv = caches.first().map_or(KvType::F32, |c| c.kv_type());
        if caches.iter().any(|c| c.kv_type() != kv) {
            // Sequences of several KV types: each in its own launches.
            return attention_decode_each(self, caches, q, k, v, q_norm, k_norm, norm, rope, shape);
        }
        let op = "attention (batched decode)";
        let starts = self.kv_claim_each(caches)?;
        // A recorded step reads the positions from the device.
        let recorded = self.recorded_positions(n);
        let uploaded = match recorded {
            Some(_) => None,
            None => Some(self.upload(op, &starts)?),
        };
        let positions = recorded.unwrap_or_else(|| {
            let uploaded = uploaded.as_ref().expect("uploaded without a recording");
            uploaded.device_ptr(&self.stream).0
        });
        let (q, k) = self.qk_norm_rope_at(q, k, q_norm, k_norm, norm, rope, 0, positions)?;
        // Each cache's keys, key scales, values, value scales, partials and
        // tickets, one table after another.
        let parts: [fn(&CudaBackend, &KvCache) -> u64; 6] = [
            |b, c| c.keys().device_ptr(&b.stream).0,
            |b, c| c.key_scales().device_ptr(&b.stream).0,
            |b, c| c.values().device_ptr(&b.stream).0,
            |b, c| c.value_scales().device_ptr(&b.stream).0,
            |b, c| c.partials().device_ptr(&b.stream).0,
            |b, c| c.tickets().device_ptr(&b.stream).0,
        ];
        let mut pointers: Vec<u64> = Vec::with_capacity(parts.len() * n);
        for part in parts {
            pointers.extend(caches.iter().map(|c| part(self, c)));
        }
        let tables = self.device_table(op, &pointers)?;
        let table = |i: usize| tables.slice(i * n..(i + 1) * n);
        let (keys, key_scales, values, value_scales, partials, tickets) =
            (table(0), table(1), table(2), table(3), table(4), table(5));
        let kernels = DecodeKernels::at_every_length(shape);
        let (blocks, threads) = kernels.blocks(shape);
        let splits = self.decode_splits(blocks * n);
        let splits_i = int(splits, "splits");
        let mut out = self.tensor(op, n, heads * head_dim)?;
        let kernel = self.decode_kernel(kernels, shape, true, kv);
        let config = LaunchConfig {
            grid_dim: (
                u32::try_from(blocks).expect("attention: too many heads"),
                u32::try_from(n).expect("attention: too many sequences"),
                splits as u32,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (heads_i, kv_heads_i, head_dim_i) = (
            int(heads, "heads"),
            int(kv_heads, "KV heads"),
            int(head_dim, "head_dim"),
        );
        launch!(
            self,
            op,
            kernel,
            config,
            &q.data,
            &keys,
            &key_scales,
            &values,
            &value_scales,
            &mut out.data,
            &heads_i,
            &kv_heads_i,
            &head_dim_i,
            &positions,
            &scale,
            &k.data,
            &v.data,
            &splits_i,
            &partials,
            &tickets
        );
        Ok(out)
    }
}
