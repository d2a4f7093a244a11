//! Multi-head latent attention over a latent cache (kernels/mla.cu):
//! `kv_b` absorbed into the queries and the output, so neither decode nor
//! prefill expands the cached positions into keys and values. Three
//! launches per call whatever its tokens: the absorbed queries (which also
//! store the new positions' latents and rotary keys), attention over the
//! latent rows (a decode step's long context split over blocks), and the
//! value rows applied to the weighted latents.

use cudarc::driver::LaunchConfig;

use super::geometry::{
    MLA_ABSORB_COLUMNS, MLA_ABSORB_THREADS, MLA_ABSORB_TOKENS, MLA_KEY_PAD, MLA_KEYS, MLA_MAX_NOPE,
    MLA_OUT_TOKENS, MLA_OUT_WARPS, MLA_ROWS_PER_WARP, MLA_VALUES_PER_LANE, MLA_WARPS,
};
use super::{CudaBackend, KvCache, Tensor, Weight, int, long};
use crate::config::MlaConfig;
use crate::error::{Error, Result};

/// Query rows (token, head) per block of `mla_attention`.
const MLA_ROWS: usize = MLA_WARPS * MLA_ROWS_PER_WARP;
/// The widest latent the kernels take.
const MAX_LATENT: usize = 32 * MLA_VALUES_PER_LANE;
/// The widest rotary key the kernels take (DeepSeek-V3's and Kimi K2's
/// 64); with [`MAX_LATENT`], what `mla_attention`'s shared memory is
/// allowed for.
const MAX_ROTARY: usize = 64;

// `mla_absorb_query`'s threads cover the widest latent.
const _: () = assert!(MLA_ABSORB_THREADS as usize * MLA_ABSORB_COLUMNS >= MAX_LATENT);

/// Dynamic shared memory of an `mla_attention` block for cache rows of
/// `width` values: the query rows, a tile of cached rows (padded) and each
/// warp's probabilities.
const fn mla_shared_bytes(width: usize) -> usize {
    4 * (MLA_ROWS * width
        + MLA_KEYS * (width + MLA_KEY_PAD)
        + MLA_WARPS * MLA_KEYS * MLA_ROWS_PER_WARP)
}

/// The shared memory `mla_attention` is allowed at most.
pub(super) const MLA_MAX_SHARED_BYTES: usize = mla_shared_bytes(MAX_LATENT + MAX_ROTARY);

/// A refusal of a latent geometry the kernels do not cover.
fn unsupported(mla: &MlaConfig, why: &str) -> Error {
    Error::invalid(
        "--device cuda",
        format!(
            "multi-head latent attention with kv_lora_rank {}, qk_rope_head_dim {} and \
             qk_nope_head_dim {}: {why}; run this model with --device cpu",
            mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim
        ),
    )
}

impl CudaBackend {
    /// [`crate::backend::Backend::mla_attention`] (see the module
    /// documentation).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_attention(
        &self,
        cache: &mut KvCache,
        q: &Tensor,
        latent: &Tensor,
        k_rot: &Tensor,
        kv_b: &Weight,
        mla: &MlaConfig,
        heads: usize,
    ) -> Result<Tensor> {
        let (lora, rope, nope, v) = (
            mla.kv_lora_rank,
            mla.qk_rope_head_dim,
            mla.qk_nope_head_dim,
            mla.v_head_dim,
        );
        let width = lora + rope;
        if lora > MAX_LATENT || rope > MAX_ROTARY {
            return Err(unsupported(
                mla,
                &format!(
                    "the CUDA kernels take latents up to {MAX_LATENT} and rotary keys up to {MAX_ROTARY} wide"
                ),
            ));
        }
        if nope > MLA_MAX_NOPE || !width.is_multiple_of(4) {
            return Err(unsupported(
                mla,
                &format!(
                    "the CUDA kernels take non-rotary query parts up to {MLA_MAX_NOPE} wide and \
                     latent rows of a multiple of 4 values"
                ),
            ));
        }
        let n = q.rows;
        let shape = cache.shape();
        assert!(
            shape.latent
                && shape.num_kv_heads == 1
                && shape.head_dim == width
                && shape.num_heads == heads,
            "mla_attention: the cache is not a latent cache of {width}-value rows for {heads} heads"
        );
        assert!(
            q.cols == heads * (rope + nope)
                && latent.rows == n
                && latent.cols == lora
                && k_rot.rows == n
                && k_rot.cols == rope,
            "mla_attention: query, latent and rotary key shapes"
        );
        let l = kv_b.layout;
        assert!(
            l.rows == heads * (nope + v) && l.cols == lora,
            "mla_attention: kv_b {} is {}x{}, not {}x{lora}",
            kv_b.name,
            l.rows,
            l.cols,
            heads * (nope + v)
        );
        let op = "mla_attention";
        let (start, position) = self.kv_claim(cache, n)?;
        let (codes, scales, biases) = kv_b.matrix().sections();
        let dtype = kv_b.matrix().dtype_code();
        let (n_i, heads_i, lora_i, rope_i, nope_i, v_i, start_l) = (
            int(n, "tokens"),
            int(heads, "heads"),
            int(lora, "kv_lora_rank"),
            int(rope, "qk_rope_head_dim"),
            int(nope, "qk_nope_head_dim"),
            int(v, "v_head_dim"),
            long(start),
        );

        let mut q_abs = self.tensor(op, n, heads * width)?;
        let grid =
            |tokens: usize| u32::try_from(tokens).unwrap_or_else(|_| panic!("{op}: {n} tokens"));
        launch!(
            self,
            "mla_absorb_query",
            &self.kernels.mla_absorb_query,
            LaunchConfig {
                grid_dim: (grid(heads), grid(n.div_ceil(MLA_ABSORB_TOKENS)), 1),
                block_dim: (MLA_ABSORB_THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
            &q.data,
            &codes,
            &scales,
            &biases,
            &dtype,
            &mut q_abs.data,
            cache.keys(),
            &latent.data,
            &k_rot.data,
            &n_i,
            &heads_i,
            &lora_i,
            &rope_i,
            &nope_i,
            &v_i,
            &start_l,
            &position
        );

        // A decode step splits the context over blocks (a ticket per row
        // tile in the cache, whose `num_heads` words outnumber the tiles).
        let tiles = (n * heads).div_ceil(MLA_ROWS);
        let splits = match n {
            1 => self.decode_splits(tiles),
            _ => 1,
        };
        let partials = self.alloc::<f32>(
            op,
            if splits > 1 {
                n * heads * splits * (lora + 2)
            } else {
                0
            },
        )?;
        let mut o_lat = self.tensor(op, n, heads * lora)?;
        let splits_i = int(splits, "splits");
        launch!(
            self,
            op,
            &self.kernels.mla_attention,
            LaunchConfig {
                grid_dim: (grid(tiles), 1, splits as u32),
                block_dim: ((MLA_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: mla_shared_bytes(width) as u32,
            },
            &q_abs.data,
            cache.keys(),
            &mut o_lat.data,
            &n_i,
            &heads_i,
            &lora_i,
            &rope_i,
            &start_l,
            &position,
            &mla.softmax_scale,
            &splits_i,
            &partials,
            cache.tickets()
        );

        let mut out = self.tensor(op, n, heads * v)?;
        launch!(
            self,
            "mla_value_out",
            &self.kernels.mla_value_out,
            LaunchConfig {
                grid_dim: (grid(heads), grid(n.div_ceil(MLA_OUT_TOKENS)), 1),
                block_dim: ((MLA_OUT_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            &o_lat.data,
            &codes,
            &scales,
            &biases,
            &dtype,
            &mut out.data,
            &n_i,
            &heads_i,
            &lora_i,
            &nope_i,
            &v_i
        );
        Ok(out)
    }
}
