//! AVX-512 kernels (F, BW, VL): 16 lanes. A 4-bit group is dequantized
//! through a 16-entry table of its values (`vpermps`), cheaper than
//! converting each code; so are q2 and q3 groups, 16 columns per shift of
//! their bit planes, q3's high bits entering as a lane mask. The int8 kernels also need VNNI: one `vpdpbusd`
//! takes 64 code × activation products (an 8-bit group, or the low or
//! high nibbles of two 4-bit groups).

use std::arch::x86_64::*;

use half::bf16;

use super::int8::GROUP_LANES;
use super::{
    Acts, FloatRows, Int8Acts, Kernels, Mxfp4Rows, PARAMS_AHEAD, QuantRows, float_rows_with,
    mean_code, mxfp4_rows_with, prefetch, prefetch_first_params, quant_rows_with, tile, tile_count,
    tile_tokens, with_bits, with_tile,
};
use crate::quant::GROUP_SIZE;
use crate::quant::lowbit::PLANE_BYTES;
use crate::quant::mxfp4::{BLOCK, exponent_scale};

struct Avx512;

/// Rows and tokens of a tile: 16 accumulators, and room for 4 rows'
/// tables, codes and weights.
const MAX_ROWS: usize = 4;
const MAX_TOKENS: usize = 4;

/// How far ahead of its reads each row prefetches its codes: a tile's
/// rows are four streams, too few for the hardware prefetcher alone to
/// keep memory busy.
const PREFETCH_BYTES: usize = 1024;

/// Sum of the lanes, in a fixed order.
#[inline]
#[target_feature(enable = "avx512f")]
fn hsum(v: __m512) -> f32 {
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let h = _mm256_add_ps(_mm512_castps512_ps256(v), high);
    let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
    let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn sums<const R: usize, const T: usize>(acc: &[[__m512; T]; R]) -> [[f32; T]; R] {
    let mut out = [[0f32; T]; R];
    for (o, a) in out.iter_mut().zip(acc) {
        for (o, &a) in o.iter_mut().zip(a) {
            *o = hsum(a);
        }
    }
    out
}

/// Adds `w[r] · x[t]` for chunk `k` (16 inputs) of group `g` to every
/// pair of the tile.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn accumulate<const R: usize, const T: usize>(
    acc: &mut [[__m512; T]; R],
    w: &[__m512; R],
    x: *const f32,
    cols: usize,
) {
    // SAFETY: the caller passes a chunk of 16 inputs of T tokens.
    let xs: [__m512; T] = std::array::from_fn(|t| unsafe { _mm512_loadu_ps(x.add(t * cols)) });
    for (acc, &w) in acc.iter_mut().zip(w) {
        for (a, &xv) in acc.iter_mut().zip(&xs) {
            *a = _mm512_fmadd_ps(w, xv, *a);
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn quant_tile<const BITS: u32, const R: usize, const T: usize>(
    w: &QuantRows<'_>,
    rows: [usize; R],
    x: &Acts<'_>,
    t0: usize,
    scales: &[f32],
    biases: &[f32],
) -> [[f32; T]; R] {
    let (cols, groups) = (x.cols, x.cols / GROUP_SIZE);
    assert!(scales.len() >= R * groups && biases.len() >= R * groups);
    let iota = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY: the caller checked that the rows and tokens exist; prefetches
    // may point past them (they never fault).
    unsafe {
        let codes = rows.map(|r| w.codes.as_ptr().add(r * w.row_bytes));
        let xs = x.x.as_ptr().add(t0 * cols);
        for g in 0..groups {
            let s = std::array::from_fn::<_, R, _>(|r| _mm512_set1_ps(scales[r * groups + g]));
            let b = std::array::from_fn::<_, R, _>(|r| _mm512_set1_ps(biases[r * groups + g]));
            let xg = xs.add(g * GROUP_SIZE);
            if BITS == 4 {
                // The group's 16 possible values, exact: q·s needs no rounding.
                let table: [__m512; R] = std::array::from_fn(|r| _mm512_fmadd_ps(iota, s[r], b[r]));
                for h in 0..2 {
                    let mut codes16 = [_mm512_setzero_si512(); R];
                    for r in 0..R {
                        let p = codes[r].add(g * GROUP_SIZE / 2 + h * 16);
                        if h == 0 && g % 2 == 0 {
                            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
                        }
                        codes16[r] = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
                    }
                    // `vpermps` reads the low 4 bits: the low nibbles as they are.
                    let lo = std::array::from_fn(|r| _mm512_permutexvar_ps(codes16[r], table[r]));
                    accumulate::<R, T>(&mut acc, &lo, xg.add(h * 32), cols);
                    let hi = std::array::from_fn(|r| {
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(codes16[r]), table[r])
                    });
                    accumulate::<R, T>(&mut acc, &hi, xg.add(h * 32 + 16), cols);
                }
            } else if BITS < 4 {
                // The group's 4 or 8 values, as for 4 bits; shift `2·plane`
                // of the planes gives columns 16·plane .. + 16.
                let table: [__m512; R] = std::array::from_fn(|r| _mm512_fmadd_ps(iota, s[r], b[r]));
                let bytes = GROUP_SIZE * BITS as usize / 8;
                let mut planes = [_mm512_setzero_si512(); R];
                let mut high = [0u64; R];
                for r in 0..R {
                    let p = codes[r].add(g * bytes);
                    if g % 2 == 0 {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
                    }
                    planes[r] = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
                    if BITS == 3 {
                        high[r] = (p.add(PLANE_BYTES) as *const u64).read_unaligned();
                    }
                }
                for plane in 0..4 {
                    let wk = std::array::from_fn(|r| {
                        let shift = _mm512_set1_epi32(2 * plane as i32);
                        let mut q = _mm512_and_si512(
                            _mm512_srlv_epi32(planes[r], shift),
                            _mm512_set1_epi32(3),
                        );
                        if BITS == 3 {
                            let mask = (high[r] >> (16 * plane)) as __mmask16;
                            q = _mm512_mask_or_epi32(q, mask, q, _mm512_set1_epi32(4));
                        }
                        _mm512_permutexvar_ps(q, table[r])
                    });
                    accumulate::<R, T>(&mut acc, &wk, xg.add(16 * plane), cols);
                }
            } else {
                for k in 0..4 {
                    let wk = std::array::from_fn(|r| {
                        let p = codes[r].add(g * GROUP_SIZE + k * 16);
                        if k == 0 {
                            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
                        }
                        let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s[r], b[r])
                    });
                    accumulate::<R, T>(&mut acc, &wk, xg.add(k * 16), cols);
                }
            }
        }
    }
    sums(&acc)
}

/// MXFP4 rows: as 4-bit ones, each block of 32 through the table of its
/// 16 values (the driver's).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn mxfp4_tile<const R: usize, const T: usize>(
    w: &Mxfp4Rows<'_>,
    rows: [usize; R],
    x: &Acts<'_>,
    t0: usize,
) -> [[f32; T]; R] {
    let (cols, blocks) = (x.cols, x.cols / BLOCK);
    let values = _mm512_setr_ps(
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
    );
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY: the caller checked that the rows and tokens exist (with
    // their exponents); prefetches may point past them.
    unsafe {
        let codes = rows.map(|r| w.codes.as_ptr().add(r * w.row_bytes));
        let xs = x.x.as_ptr().add(t0 * cols);
        for b in 0..blocks {
            let table: [__m512; R] = std::array::from_fn(|r| {
                let e = *w.exponents.get_unchecked(rows[r] * blocks + b);
                _mm512_mul_ps(values, _mm512_set1_ps(exponent_scale(e)))
            });
            let mut codes16 = [_mm512_setzero_si512(); R];
            for r in 0..R {
                let p = codes[r].add(b * BLOCK / 2);
                if b % 4 == 0 {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
                }
                codes16[r] = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
            }
            let xb = xs.add(b * BLOCK);
            let lo = std::array::from_fn(|r| _mm512_permutexvar_ps(codes16[r], table[r]));
            accumulate::<R, T>(&mut acc, &lo, xb, cols);
            let hi = std::array::from_fn(|r| {
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(codes16[r]), table[r])
            });
            accumulate::<R, T>(&mut acc, &hi, xb.add(16), cols);
        }
    }
    sums(&acc)
}

/// `count` (at most 16) bf16 values from `p` as f32, the other lanes zero.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn widen_bf16(p: *const bf16, count: usize) -> __m512 {
    let mask = if count >= 16 {
        !0
    } else {
        ((1u32 << count) - 1) as __mmask16
    };
    // SAFETY: the caller passes `count` values; the mask keeps the load
    // within them.
    let h = unsafe { _mm256_maskz_loadu_epi16(mask, p as *const i16) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// The int8 tile kernel of 2-, 3- and 8-bit rows (4-bit ones take
/// [`q4_tile`] or [`wide_tile`]). Each (row, token) pair sums
/// `s·d·Σ (q - o)·x̂` over the groups, then `(b + c·s)·Σ x` and
/// `s·offsets` in blocks of [`GROUP_LANES`] groups, as `Int8Acts` defines
/// the product. The group parameters are widened from bf16 and multiplied
/// in registers, a block of 16 groups at a time, rather than prepared in
/// memory for each tile.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn int8_tile<const BITS: u32, const R: usize, const T: usize>(
    w: &QuantRows<'_>,
    rows: [usize; R],
    x: &Int8Acts,
    t0: usize,
) -> [[f32; T]; R] {
    let (cols, groups, stride) = (x.cols, x.cols / GROUP_SIZE, x.stride);
    assert!(x.scales.len() >= (t0 + T) * stride);
    assert!(x.sums.len() >= (t0 + T) * stride && x.offsets.len() >= (t0 + T) * stride);
    assert!(BITS != 4, "4-bit rows take q4_tile or wide_tile");
    let group_bytes = GROUP_SIZE * BITS as usize / 8;
    let plane_shifts = _mm512_setr_epi64(0, 0, 2, 2, 4, 4, 6, 6);
    let (three, four) = (_mm512_set1_epi8(3), _mm512_set1_epi8(4));
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY: the caller checked that the rows and tokens exist (with their
    // `groups` parameters each), and the asserts above the activations';
    // prefetches may point past them (they never fault).
    unsafe {
        let codes = rows.map(|r| w.codes.as_ptr().add(r * w.row_bytes));
        let params = |at: &[bf16], r: usize, k: usize| {
            widen_bf16(at.as_ptr().add(rows[r] * groups + k), groups - k)
        };
        let token = |at: &[f32], t: usize, k: usize| {
            _mm512_loadu_ps(at.as_ptr().add((t0 + t) * stride + k))
        };
        let xq = x.codes.as_ptr().add(t0 * cols);
        let xs_of = |g: usize| -> [__m512i; T] {
            std::array::from_fn(|t| {
                _mm512_loadu_si512(xq.add(t * cols + g * GROUP_SIZE) as *const __m512i)
            })
        };
        let mut g = 0;
        for k in (0..groups).step_by(GROUP_LANES) {
            let end = groups.min(k + GROUP_LANES);
            // `s·d` of the block's groups for each pair of the tile.
            let d: [__m512; T] = std::array::from_fn(|t| token(&x.scales, t, k));
            let products: [[__m512; T]; R] = std::array::from_fn(|r| {
                let s = params(w.scales, r, k);
                std::array::from_fn(|t| _mm512_mul_ps(s, d[t]))
            });
            while g < end {
                let xs = xs_of(g);
                let one = _mm512_set1_epi32((g - k) as i32);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let p = codes[r].add(g * group_bytes);
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
                    let q = if BITS < 4 {
                        // The planes in every 128-bit lane, shifted 0, 2,
                        // 4, 6: the codes in column order.
                        let planes = _mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i));
                        let q = _mm512_and_si512(_mm512_srlv_epi64(planes, plane_shifts), three);
                        if BITS == 3 {
                            let high = (p.add(PLANE_BYTES) as *const u64).read_unaligned();
                            _mm512_or_si512(q, _mm512_maskz_mov_epi8(high, four))
                        } else {
                            q
                        }
                    } else {
                        _mm512_loadu_si512(p as *const __m512i)
                    };
                    for (t, (a, &xv)) in acc.iter_mut().zip(&xs).enumerate() {
                        let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv);
                        let scale = _mm512_permutexvar_ps(one, products[r][t]);
                        *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *a);
                    }
                }
                g += 1;
            }
        }
        add_group_terms::<BITS, R, T>(w, rows, x, t0, &mut acc);
    }
    sums(&acc)
}

/// The groups of a block in [`super::int8::q4_lane`] order, for `vpermps`.
#[inline]
#[target_feature(enable = "avx512f")]
fn q4_lane_groups() -> __m512i {
    _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
}

/// `Σ (a + b)` of adjacent partial sums, one level of [`q4_tile`]'s
/// reduction: within each 128-bit lane, dwords 0 and 2 of `a` and of `b`
/// into dwords 0 and 1 (`EPI64` false: 32-bit interleave) or quadwords 0
/// and 1 of each into dwords 0-1 and 2-3 (`EPI64`).
#[inline]
#[target_feature(enable = "avx512f")]
fn fold_pairs<const EPI64: bool>(a: __m512i, b: __m512i) -> __m512i {
    if EPI64 {
        _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
    } else {
        _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
    }
}

/// The int8 tile kernel of 4-bit rows for inputs not interleaved (fewer
/// than [`super::int8::WIDE_TOKENS`] tokens). A pair of groups' 64 code bytes
/// are one register, unpacked at once into their low nibbles (evens) and
/// high ones (odds); each pair of `vpdpbusd` sums both groups, the first's
/// partial sums in lanes 0-7, the second's in 8-15. Interleaving adds of a
/// block's 8 pairs (two levels of [`fold_pairs`], then one across 128-bit
/// lanes) leave each group's exact sum in its [`super::int8::q4_lane`], scaled
/// by `s·d` as [`wide_tile`] does: the two kernels give the same numbers
/// to the bit, so prefill and decode agree.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn q4_tile<const R: usize, const T: usize>(
    w: &QuantRows<'_>,
    rows: [usize; R],
    x: &Int8Acts,
    t0: usize,
) -> [[f32; T]; R] {
    let (cols, groups, stride) = (x.cols, x.cols / GROUP_SIZE, x.stride);
    assert!(x.scales.len() >= (t0 + T) * stride);
    assert!(x.codes.len() >= (t0 + T) * cols);
    let group_bytes = GROUP_SIZE / 2;
    let nibble = _mm512_set1_epi8(15);
    // A lone group's 32 code bytes go to both halves of a register; the
    // high half's 16-bit lanes shift right by 4, then masking keeps the
    // low nibbles (evens) in the low half and the high ones (odds) above.
    let shifts = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY: the caller checked that the rows exist (with their `groups`
    // parameters each), and the asserts above the tokens'; prefetches may
    // point past them (they never fault).
    unsafe {
        let codes = rows.map(|r| w.codes.as_ptr().add(r * w.row_bytes));
        let xq = x.codes.as_ptr().add(t0 * cols);
        let load = |t: usize, g: usize| {
            _mm512_loadu_si512(xq.add(t * cols + g * GROUP_SIZE) as *const __m512i)
        };
        for k in (0..groups).step_by(GROUP_LANES) {
            // Per pair of the block, partial sums of groups `g` (lanes
            // 0-7) and `g + 1` (8-15), zero past the row's end, folded as
            // they come: pairs (0, 1) into `quarters`, ..., then halves.
            let mut halves = [[[_mm512_setzero_si512(); T]; R]; 2];
            let mut quarter = [[_mm512_setzero_si512(); T]; R];
            for j in 0..4 {
                let mut pairs = [[[_mm512_setzero_si512(); T]; R]; 2];
                for (h, pair) in pairs.iter_mut().enumerate() {
                    let g = k + 4 * j + 2 * h;
                    if g + 1 < groups {
                        // Laid out by `Int8Acts` as the pair's evens, then
                        // its odds.
                        let evens: [__m512i; T] = std::array::from_fn(|t| load(t, g));
                        let odds: [__m512i; T] = std::array::from_fn(|t| load(t, g + 1));
                        for (r, dots) in pair.iter_mut().enumerate() {
                            let p = codes[r].add(g * group_bytes);
                            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
                            let both = _mm512_loadu_si512(p as *const __m512i);
                            let lo = _mm512_and_si512(both, nibble);
                            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(both), nibble);
                            for (t, d) in dots.iter_mut().enumerate() {
                                *d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, evens[t]);
                                *d = _mm512_dpbusd_epi32(*d, hi, odds[t]);
                            }
                        }
                    } else if g < groups {
                        // A lone last group, [evens, odds]: its halves'
                        // partials added into lanes 0-7.
                        let xs: [__m512i; T] = std::array::from_fn(|t| load(t, g));
                        for (r, dots) in pair.iter_mut().enumerate() {
                            let p = codes[r].add(g * group_bytes);
                            let both =
                                _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i));
                            let q = _mm512_and_si512(_mm512_srlv_epi16(both, shifts), nibble);
                            for (d, &xv) in dots.iter_mut().zip(&xs) {
                                let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv);
                                let swapped = _mm512_shuffle_i64x2::<0b01_00_11_10>(dot, dot);
                                *d = _mm512_maskz_add_epi32(0x00ff, dot, swapped);
                            }
                        }
                    }
                }
                for r in 0..R {
                    for t in 0..T {
                        let folded = fold_pairs::<false>(pairs[0][r][t], pairs[1][r][t]);
                        if j % 2 == 0 {
                            quarter[r][t] = folded;
                        } else {
                            halves[j / 2][r][t] = fold_pairs::<true>(quarter[r][t], folded);
                        }
                    }
                }
            }
            let sums: [[__m512i; T]; R] = std::array::from_fn(|r| {
                std::array::from_fn(|t| {
                    let (low, high) = (halves[0][r][t], halves[1][r][t]);
                    _mm512_add_epi32(
                        _mm512_shuffle_i32x4::<0b10_00_10_00>(low, high),
                        _mm512_shuffle_i32x4::<0b11_01_11_01>(low, high),
                    )
                })
            });
            scale_block(w, rows, x, t0, k, &sums, &mut acc);
        }
        add_group_terms::<4, R, T>(w, rows, x, t0, &mut acc);
    }
    sums(&acc)
}

/// Adds the exact sums of the block of groups from `first` (one a lane, in
/// [`super::int8::q4_lane`] order), each scaled by its `s·d`, to every pair of a
/// tile: where both 4-bit kernels scale, so they round alike.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn scale_block<const R: usize, const T: usize>(
    w: &QuantRows<'_>,
    rows: [usize; R],
    x: &Int8Acts,
    t0: usize,
    first: usize,
    sums: &[[__m512i; T]; R],
    acc: &mut [[__m512; T]; R],
) {
    let (groups, stride) = (x.cols / GROUP_SIZE, x.stride);
    assert!(x.scales.len() >= (t0 + T) * stride && first < stride);
    let lanes = q4_lane_groups();
    // SAFETY: the assert covers the tokens' scales; the caller checked the
    // rows' (`widen_bf16` reads only the block's groups of the row).
    unsafe {
        let d: [__m512; T] = std::array::from_fn(|t| {
            let d = _mm512_loadu_ps(x.scales.as_ptr().add((t0 + t) * stride + first));
            _mm512_permutexvar_ps(lanes, d)
        });
        for (r, (acc, sums)) in acc.iter_mut().zip(sums).enumerate() {
            let s = widen_bf16(
                w.scales.as_ptr().add(rows[r] * groups + first),
                groups - first,
            );
            let s = _mm512_permutexvar_ps(lanes, s);
            for ((a, &sum), &d) in acc.iter_mut().zip(sums).zip(&d) {
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, d), *a);
            }
        }
    }
}

/// Adds the terms of the int8 product that are per group rather than per
/// code, `(b + c·s)·Σ x + s·offsets` (see [`Int8Acts`]), to every pair of
/// a tile.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn add_group_terms<const BITS: u32, const R: usize, const T: usize>(
    w: &QuantRows<'_>,
    rows: [usize; R],
    x: &Int8Acts,
    t0: usize,
    acc: &mut [[__m512; T]; R],
) {
    let (groups, stride) = (x.cols / GROUP_SIZE, x.stride);
    let mean = _mm512_set1_ps(mean_code(BITS));
    // SAFETY: the caller checked the rows' parameters and the tokens'.
    unsafe {
        let params = |at: &[bf16], r: usize, k: usize| {
            widen_bf16(at.as_ptr().add(rows[r] * groups + k), groups - k)
        };
        let token = |at: &[f32], t: usize, k: usize| {
            _mm512_loadu_ps(at.as_ptr().add((t0 + t) * stride + k))
        };
        for k in (0..groups).step_by(GROUP_LANES) {
            for (r, acc) in acc.iter_mut().enumerate() {
                let s = params(w.scales, r, k);
                let b = _mm512_add_ps(params(w.biases, r, k), _mm512_mul_ps(mean, s));
                for (t, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(b, token(&x.sums, t, k), *a);
                    *a = _mm512_fmadd_ps(s, token(&x.offsets, t, k), *a);
                }
            }
        }
    }
}

/// Interleaves row `r`'s 4-bit codes as [`Int8Acts`] interleaves many
/// tokens' inputs: per block of [`GROUP_LANES`] groups, 16 vectors whose
/// lane [`super::int8::q4_lane`]`(g)` holds four codes of group `g`, one per
/// byte (the low nibbles of the group's `k`-th four bytes in vector `k`,
/// their high nibbles in vector `k + 8`). Groups past the row's end are
/// zero.
///
/// A block's 512 code bytes are eight registers of two groups' eight
/// dwords each, transposed to eight registers of one dword of each of 16
/// groups by three levels of two-register permutes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn interleave_row(w: &QuantRows<'_>, r: usize, groups: usize, out: &mut [__m512i]) {
    let group_bytes = GROUP_SIZE / 2;
    let nibble = _mm512_set1_epi8(15);
    // Level 1 gathers dwords 0-3 of four groups (lane `4·g + j`) from two
    // registers of two groups each; level 2 dwords {0, 1} of eight groups
    // (lane `2·g + j`) from two of those; level 3 dword 0 of 16 groups; each
    // `+ 4`, `+ 2`, `+ 1` the next dwords.
    let level1 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    let level2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    // Level 3 in the kernels' lane order ([`super::int8::q4_lane`]).
    let level3 = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 16, 20, 24, 28, 18, 22, 26, 30);
    let shifted = |idx: __m512i, by: i32| _mm512_add_epi32(idx, _mm512_set1_epi32(by));
    let gather = |a: __m512i, idx: __m512i, b: __m512i| _mm512_permutex2var_epi32(a, idx, b);
    // SAFETY: the caller checked the row; the masks keep the loads within
    // its groups.
    let row = unsafe { w.codes.as_ptr().add(r * w.row_bytes) };
    for (b, block) in out.chunks_exact_mut(GROUP_LANES).enumerate() {
        let first = b * GROUP_LANES;
        let whole = first + GROUP_LANES <= groups;
        let pairs: [__m512i; 8] = std::array::from_fn(|m| {
            let g = first + 2 * m;
            let at = row.wrapping_add(g * group_bytes);
            // SAFETY: as above.
            unsafe {
                if whole {
                    _mm512_loadu_si512(at as *const __m512i)
                } else {
                    let mask = match groups.saturating_sub(g) {
                        0 => 0,
                        1 => 0x00ff,
                        _ => 0xffff,
                    };
                    _mm512_maskz_loadu_epi32(mask, at as *const i32)
                }
            }
        });
        let quads: [[__m512i; 2]; 4] = std::array::from_fn(|a| {
            let (x, y) = (pairs[2 * a], pairs[2 * a + 1]);
            [gather(x, level1, y), gather(x, shifted(level1, 4), y)]
        });
        let octets: [[__m512i; 4]; 2] = std::array::from_fn(|h| {
            let (x, y) = (quads[2 * h], quads[2 * h + 1]);
            std::array::from_fn(|e| {
                let (c, odd) = (e / 2, e % 2);
                gather(x[c], shifted(level2, 2 * odd as i32), y[c])
            })
        });
        let (lows, highs) = block.split_at_mut(GROUP_LANES / 2);
        for (j, (low, high)) in lows.iter_mut().zip(highs).enumerate() {
            let (e, odd) = (j / 2, j % 2);
            let four = gather(octets[0][e], shifted(level3, odd as i32), octets[1][e]);
            *low = _mm512_and_si512(four, nibble);
            *high = _mm512_and_si512(_mm512_srli_epi16::<4>(four), nibble);
        }
    }
}

/// The int8 tile kernel of 4-bit rows for interleaved inputs: each tile row
/// interleaved in `codes` ([`interleave_row`], `blocks` blocks a row, in
/// the tile's order), each block of 16 groups summed by 16 `vpdpbusd` per
/// (row, token) pair, one lane per group, then scaled by the groups' `s·d`
/// in one conversion and one FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn wide_tile<const R: usize, const T: usize>(
    w: &QuantRows<'_>,
    rows: [usize; R],
    codes: &[__m512i],
    blocks: usize,
    x: &Int8Acts,
    t0: usize,
) -> [[f32; T]; R] {
    let stride = x.stride;
    let token_bytes = stride * GROUP_SIZE;
    assert!(x.codes.len() >= (t0 + T) * token_bytes && codes.len() >= R * blocks * GROUP_LANES);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY: the assert above covers the tokens' codes; the caller checked
    // the rows' parameters.
    unsafe {
        let xq = x.codes.as_ptr().add(t0 * token_bytes);
        for b in 0..blocks {
            let mut dots = [[_mm512_setzero_si512(); T]; R];
            for k in 0..GROUP_LANES {
                let xs: [__m512i; T] = std::array::from_fn(|t| {
                    _mm512_loadu_si512(
                        xq.add(t * token_bytes + (b * GROUP_LANES + k) * 64) as *const __m512i
                    )
                });
                for (r, dots) in dots.iter_mut().enumerate() {
                    let q = codes[(r * blocks + b) * GROUP_LANES + k];
                    for (d, &xv) in dots.iter_mut().zip(&xs) {
                        *d = _mm512_dpbusd_epi32(*d, q, xv);
                    }
                }
            }
            scale_block(w, rows, x, t0, b * GROUP_LANES, &dots, &mut acc);
        }
        add_group_terms::<4, R, T>(w, rows, x, t0, &mut acc);
    }
    sums(&acc)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn float_tile<const BF16: bool, const R: usize, const T: usize>(
    w: &FloatRows<'_>,
    rows: [usize; R],
    x: &Acts<'_>,
    t0: usize,
) -> [[f32; T]; R] {
    let cols = w.cols;
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY: the caller checked that the rows and tokens exist; the masks
    // keep the loads within them.
    unsafe {
        let mut c = 0;
        while c < cols {
            let mask = if cols - c >= 16 {
                !0
            } else {
                ((1u32 << (cols - c)) - 1) as __mmask16
            };
            let wc = rows.map(|r| {
                let at = r * cols + c;
                if BF16 {
                    let p = w.data.as_ptr().add(2 * at) as *const i16;
                    let h = _mm256_maskz_loadu_epi16(mask, p);
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                } else {
                    _mm512_maskz_loadu_ps(mask, w.data.as_ptr().add(4 * at) as *const f32)
                }
            });
            let xs: [__m512; T] = std::array::from_fn(|t| {
                _mm512_maskz_loadu_ps(mask, x.x.as_ptr().add((t0 + t) * cols + c))
            });
            for (acc, &w) in acc.iter_mut().zip(&wc) {
                for (a, &xv) in acc.iter_mut().zip(&xs) {
                    *a = _mm512_fmadd_ps(w, xv, *a);
                }
            }
            c += 16;
        }
    }
    sums(&acc)
}

impl Kernels for Avx512 {
    #[inline(always)]
    unsafe fn quant_tile<const BITS: u32, const R: usize, const T: usize>(
        w: &QuantRows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
        scales: &[f32],
        biases: &[f32],
    ) -> [[f32; T]; R] {
        // SAFETY: forwarded.
        unsafe { quant_tile::<BITS, R, T>(w, rows, x, t0, scales, biases) }
    }

    #[inline(always)]
    unsafe fn mxfp4_tile<const R: usize, const T: usize>(
        w: &Mxfp4Rows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
    ) -> [[f32; T]; R] {
        // SAFETY: forwarded.
        unsafe { mxfp4_tile::<R, T>(w, rows, x, t0) }
    }

    #[inline(always)]
    unsafe fn float_tile<const BF16: bool, const R: usize, const T: usize>(
        w: &FloatRows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
    ) -> [[f32; T]; R] {
        // SAFETY: forwarded.
        unsafe { float_tile::<BF16, R, T>(w, rows, x, t0) }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub unsafe fn mxfp4_rows(w: &Mxfp4Rows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { mxfp4_rows_with::<Avx512>(w, x, out, MAX_ROWS, MAX_TOKENS) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub unsafe fn quant_rows(w: &QuantRows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { quant_rows_with::<Avx512>(w, x, out, MAX_ROWS, MAX_TOKENS) }
}

/// The int8 products, in tiles as [`super::quant_rows_with`] walks them
/// (the shared int8 driver prepares group parameters in memory per tile,
/// which these kernels do in registers). Interleaved inputs take each
/// tile's rows interleaved once, for all its token tiles.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
pub unsafe fn int8_rows(w: &QuantRows<'_>, x: &Int8Acts, out: &mut [f32]) {
    let (n, g) = (x.n, x.cols / GROUP_SIZE);
    prefetch_first_params(w, g, MAX_ROWS);
    let blocks = x.stride / GROUP_LANES;
    let mut codes = match x.interleaved {
        true => vec![_mm512_setzero_si512(); MAX_ROWS * blocks * GROUP_LANES],
        false => Vec::new(),
    };
    let tiles = tile_count(w.rows, MAX_ROWS);
    for i in 0..tiles {
        let (tile, rows) = tile(i, w.rows, MAX_ROWS);
        for &r in &tile[..rows] {
            let ahead = (r + PARAMS_AHEAD) * g;
            prefetch(w.scales.as_ptr().wrapping_add(ahead));
            prefetch(w.biases.as_ptr().wrapping_add(ahead));
        }
        if x.interleaved {
            for (slot, &r) in tile[..rows].iter().enumerate() {
                let out = &mut codes[slot * blocks * GROUP_LANES..][..blocks * GROUP_LANES];
                // SAFETY: forwarded from the caller.
                unsafe { interleave_row(w, r, g, out) };
            }
            // The next tile's codes, on their way while this one computes.
            if i + 1 < tiles {
                let (next, count) = super::tile(i + 1, w.rows, MAX_ROWS);
                for &r in &next[..count] {
                    for line in (0..w.row_bytes).step_by(64) {
                        prefetch(w.codes.as_ptr().wrapping_add(r * w.row_bytes + line));
                    }
                }
            }
            tile_tokens!(n, MAX_TOKENS, tile, rows, out, |R, T, t0, tile| {
                // SAFETY: forwarded from the caller.
                unsafe { wide_tile::<R, T>(w, tile, &codes, blocks, x, t0) }
            });
        } else if w.bits == 4 {
            // Two tokens at most: a third's partial sums would not fit
            // the registers.
            tile_tokens!(n, 2, tile, rows, out, |R, T, t0, tile| {
                // SAFETY: forwarded from the caller.
                unsafe { q4_tile::<R, T>(w, tile, x, t0) }
            });
        } else {
            tile_tokens!(n, MAX_TOKENS, tile, rows, out, |R, T, t0, tile| {
                // SAFETY: forwarded from the caller.
                with_bits!(w.bits, |B| unsafe { int8_tile::<B, R, T>(w, tile, x, t0) })
            });
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub unsafe fn float_rows(w: &FloatRows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { float_rows_with::<Avx512>(w, x, out, MAX_ROWS, MAX_TOKENS) }
}

/// [`super::dot`] of `a` with each of `bs`, bit for bit: the same partial
/// sums in 16 lanes, then [`super::dot`]'s reduction (lanes `i` and `i + 8`,
/// then `+ 4`, `+ 2`, `+ 1`) a level at a time for all eight, two products
/// a register, then the leftover columns one by one.
#[target_feature(enable = "avx512f")]
pub unsafe fn dots8(a: &[f32], bs: [&[f32]; 8]) -> [f32; 8] {
    let len = bs.iter().fold(a.len(), |l, b| l.min(b.len()));
    let whole = len / 16 * 16;
    let mut acc = [_mm512_setzero_ps(); 8];
    for c in (0..whole).step_by(16) {
        // SAFETY: `c + 16 <= len`, within every slice.
        unsafe {
            let x = _mm512_loadu_ps(a.as_ptr().add(c));
            for (acc, b) in acc.iter_mut().zip(&bs) {
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(x, _mm512_loadu_ps(b.as_ptr().add(c))));
            }
        }
    }
    // Each level adds lane `i` and `i + width` of every product's lanes
    // still in play, packing two products' results into one register.
    let fold = |x: __m512, y: __m512, first: __m512i, width: i32| {
        let second = _mm512_add_epi32(first, _mm512_set1_epi32(width));
        _mm512_add_ps(
            _mm512_permutex2var_ps(x, first, y),
            _mm512_permutex2var_ps(x, second, y),
        )
    };
    let halves = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    let quarters = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    let eighths = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    let l1: [__m512; 4] = std::array::from_fn(|p| fold(acc[2 * p], acc[2 * p + 1], halves, 8));
    let l2: [__m512; 2] = std::array::from_fn(|p| fold(l1[2 * p], l1[2 * p + 1], quarters, 4));
    let l3 = fold(l2[0], l2[1], eighths, 2);
    // Lanes 2k and 2k + 1 hold product k's last two partial sums.
    let l4 = _mm512_add_ps(l3, _mm512_permute_ps::<0b10_11_00_01>(l3));
    let mut lanes = [0f32; 16];
    // SAFETY: 16 floats.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), l4) };
    std::array::from_fn(|k| {
        let mut sum = lanes[2 * k];
        for (x, y) in a[whole..len].iter().zip(&bs[k][whole..len]) {
            sum += x * y;
        }
        sum
    })
}

/// Runs `f` with AVX-512 enabled (see [`super::Isa::vectorize`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub unsafe fn vectorize<R>(f: impl FnOnce() -> R) -> R {
    f()
}
