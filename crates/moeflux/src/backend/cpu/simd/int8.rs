//! Activations quantized to int8 per weight group for the int8 kernels
//! ([`Int8Acts`]), and the layout the AVX-512 kernels read many tokens'
//! 4-bit inputs in.

use super::vector::{DOT_LANES, sum};
use super::{Int8Kernels, Isa};
use crate::quant::GROUP_SIZE;

/// Per-token and per-row arrays over a row's groups are padded with zeros
/// to a multiple of this many, so the kernels read them in whole vectors.
pub(super) const GROUP_LANES: usize = 16;

/// Tokens (`[n, cols]`) quantized for the int8 kernels, per group of
/// [`GROUP_SIZE`] inputs (a weight group's span): `x ≈ d·x̂` with
/// `d = max|x| / 127` and `x̂ = round(x / d)`, an int8. For a weight group
/// `w = s·q + b` the product is then
///
/// ```text
/// Σ w·x = s·Σ q·x + b·Σ x
///       ≈ s·d·Σ (q - o)·x̂ + (b + c·s)·Σ x - (c - o)·s·d·Σ x̂
/// ```
///
/// - `Σ x` is the exact f32 sum, so the bias term (often the largest) is
///   exact;
/// - `Σ (q - o)·x̂` is an exact integer from the kernels (`o` as
///   [`Int8Kernels::q8_offset`]);
/// - the rounding error `e = x - d·x̂` enters only as `s·Σ (q - c)·e`: its
///   part along the mean code `c` (the middle of the code range), known
///   exactly from `Σ x - d·Σ x̂`, is restored, which halves the error
///   against plain `s·d·Σ q·x̂` for evenly spread codes.
///
/// For 4-bit rows each group's codes are reordered [evens, odds], the
/// order in which the kernels unpack a group's low then high nibbles; for
/// the AVX-512 kernels, which unpack two groups at once, each pair of
/// groups is [evens, evens of the next, odds, odds of the next]. For
/// [`WIDE_TOKENS`] tokens or more the AVX-512 kernels take 4-bit rows
/// another way (`interleaved`): each block of [`GROUP_LANES`] groups is 16
/// vectors of 64 codes, vector `k` holding four codes of every group of
/// the block (group `g` in bytes `4i..4i + 4`, its lane `i = q4_lane(g)`):
/// the evens' `k`-th four for `k < 8`, the odds' `(k - 8)`-th four after,
/// so that one integer dot product sums each group in its own lane.
pub struct Int8Acts {
    pub n: usize,
    pub cols: usize,
    pub(super) bits: u32,
    pub(super) kernels: Int8Kernels,
    /// Laid out per block of groups, as above.
    pub(super) interleaved: bool,
    pub(super) codes: Vec<i8>,
    /// Per token, `stride` values each: `d` of each group,
    pub(super) scales: Vec<f32>,
    /// `Σ x`,
    pub(super) sums: Vec<f32>,
    /// and `-(c - o)·d·Σ x̂`.
    pub(super) offsets: Vec<f32>,
    /// Groups per token, padded to [`GROUP_LANES`].
    pub(super) stride: usize,
}

/// The middle of the code range of `bits`-bit weights: the `c` of
/// [`Int8Acts`].
pub(super) fn mean_code(bits: u32) -> f32 {
    ((1u32 << bits) - 1) as f32 / 2.0
}

impl Int8Acts {
    /// For rows of `bits` bits (2, 3, 4 or 8) and `isa`'s int8 kernels.
    pub fn new(isa: Isa, x: &[f32], n: usize, cols: usize, bits: u32) -> Int8Acts {
        assert!(x.len() >= n * cols && cols.is_multiple_of(GROUP_SIZE));
        let kernels = isa.int8_kernels();
        let groups = cols / GROUP_SIZE;
        let stride = groups.next_multiple_of(GROUP_LANES);
        let interleaved = bits == 4 && n >= WIDE_TOKENS && kernels.interleaves();
        let mut acts = Int8Acts {
            n,
            cols,
            bits,
            kernels,
            interleaved,
            codes: vec![
                0;
                n * if interleaved {
                    stride * GROUP_SIZE
                } else {
                    cols
                }
            ],
            scales: vec![0.0; n * stride],
            sums: vec![0.0; n * stride],
            offsets: vec![0.0; n * stride],
            stride,
        };
        let offset = if bits == 8 { kernels.q8_offset() } else { 0 };
        let shift = mean_code(bits) - offset as f32;
        isa.vectorize(
            #[inline(always)]
            || acts.quantize(&x[..n * cols], shift),
        );
        acts
    }

    /// Fills the codes and per-group values from `x`; plain loops,
    /// vectorised by [`Isa::vectorize`].
    #[inline(always)]
    fn quantize(&mut self, x: &[f32], shift: f32) {
        let cols = self.cols;
        let token_codes = self.codes.len() / self.n.max(1);
        for (t, (x, token)) in x
            .chunks_exact(cols)
            .zip(self.codes.chunks_exact_mut(token_codes))
            .enumerate()
        {
            let (codes, _) = token.split_at_mut(cols);
            for (g, (x, codes)) in x
                .chunks_exact(GROUP_SIZE)
                .zip(codes.chunks_exact_mut(GROUP_SIZE))
                .enumerate()
            {
                let mut max = [0f32; DOT_LANES];
                for c in x.chunks_exact(DOT_LANES) {
                    for (m, v) in max.iter_mut().zip(c) {
                        *m = m.max(v.abs());
                    }
                }
                let max = max.iter().fold(0f32, |a, &b| a.max(b));
                let d = max / 127.0;
                let inv = if max > 0.0 { 127.0 / max } else { 0.0 };
                // Rounded to the nearest (ties to even) by adding 1.5·2^23,
                // whose float spacing is 1, and read from the low mantissa
                // bits: unlike `as` conversions this vectorises.
                const MAGIC: f32 = 12_582_912.0;
                let mut quantized = [0i32; GROUP_SIZE];
                for (q, &v) in quantized.iter_mut().zip(x) {
                    *q = (v * inv + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32;
                }
                if self.bits == 4 {
                    // Each pair as one u64, even input in the low half (a
                    // layout change rather than strided reads, which vectorise
                    // poorly).
                    let pairs: [u64; GROUP_SIZE / 2] = bytemuck::cast(quantized);
                    let (evens, odds) = codes.split_at_mut(GROUP_SIZE / 2);
                    for ((e, o), &pair) in evens.iter_mut().zip(odds).zip(&pairs) {
                        *e = pair as i8;
                        *o = (pair >> 32) as i8;
                    }
                } else {
                    for (c, &q) in codes.iter_mut().zip(&quantized) {
                        *c = q as i8;
                    }
                }
                let code_sum: i32 = quantized.iter().sum();
                let at = t * self.stride + g;
                self.scales[at] = d;
                self.sums[at] = sum(x);
                self.offsets[at] = -shift * d * code_sum as f32;
            }
            if self.interleaved {
                interleave_groups(token);
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            if self.bits == 4 && self.kernels == Int8Kernels::Avx512Vnni {
                for pair in codes.chunks_exact_mut(2 * GROUP_SIZE) {
                    let (odds, evens) =
                        pair[GROUP_SIZE / 2..][..GROUP_SIZE].split_at_mut(GROUP_SIZE / 2);
                    odds.swap_with_slice(evens);
                }
            }
        }
    }
}

/// Tokens from which [`Int8Acts`] interleaves 4-bit inputs for the
/// AVX-512 kernels: each tile of rows is then interleaved likewise once and
/// read by every token tile, which pays for itself from a few tokens on.
pub const WIDE_TOKENS: usize = 4;

/// The lane of a block of 16 groups that holds group `g` in the
/// interleaved inputs of [`Int8Acts`], and its sum in the AVX-512 4-bit
/// int8 kernels: the order in which the few-token kernel's reduction
/// leaves the sums (128-bit lane 0 groups 0, 2, 4, 6; lane 1 groups 1, 3,
/// 5, 7; lanes 2 and 3 likewise for 8-15), so that both kernels scale and
/// add each group in the same lane.
pub(super) const fn q4_lane(g: usize) -> usize {
    (g & 8) | ((g & 1) << 2) | ((g & 7) >> 1)
}

/// Rewrites one token's 4-bit codes, laid out [evens, odds] per group in
/// its first `cols` bytes, into the interleaved layout of [`Int8Acts`]
/// over the whole of `token` (every block of [`GROUP_LANES`] groups, the
/// padding zero).
pub(super) fn interleave_groups(token: &mut [i8]) {
    const BLOCK: usize = GROUP_LANES * GROUP_SIZE;
    for block in token.chunks_exact_mut(BLOCK) {
        let grouped: [i8; BLOCK] = block.try_into().expect("whole blocks");
        for (g, group) in grouped.chunks_exact(GROUP_SIZE).enumerate() {
            let lane = q4_lane(g);
            for (k, four) in group.chunks_exact(4).enumerate() {
                block[k * 4 * GROUP_LANES + 4 * lane..][..4].copy_from_slice(four);
            }
        }
    }
}
