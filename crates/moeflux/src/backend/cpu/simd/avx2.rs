//! AVX2 + FMA kernels: 8 lanes, each code converted and dequantized with
//! one FMA. The int8 kernels multiply codes by activations with
//! `vpmaddubsw` (unsigned × signed bytes, pairs summed to 16 bits) and
//! widen with `vpmaddwd`. q2 and q3 codes come out of their bit planes by
//! variable shifts; q3's high bits are spread over the lanes by a shift
//! per lane (f32 kernels) or a byte shuffle and compare (int8 kernels).

use std::arch::x86_64::*;

use super::int8::GROUP_LANES;
use super::{
    Acts, FloatRows, Int8Acts, Int8Kernel, Int8Params, Kernels, Mxfp4Rows, QuantRows,
    float_rows_with, int8_rows_with, mxfp4_rows_with, quant_rows_with,
};
use crate::quant::GROUP_SIZE;
use crate::quant::lowbit::PLANE_BYTES;
use crate::quant::mxfp4::{BLOCK, exponent_scale};

struct Avx2;

/// Rows and tokens of a tile, within the 16 registers.
const MAX_ROWS: usize = 2;
const MAX_TOKENS: usize = 2;

/// How far ahead of its reads each row prefetches its codes.
const PREFETCH_BYTES: usize = 1024;

// The int8 kernels read the group parameters 8 at a time.
const _: () = assert!(GROUP_LANES.is_multiple_of(8));

/// Sum of the lanes, in a fixed order.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)))
}

#[inline]
#[target_feature(enable = "avx2")]
fn sums<const R: usize, const T: usize>(acc: &[[__m256; T]; R]) -> [[f32; T]; R] {
    let mut out = [[0f32; T]; R];
    for (o, a) in out.iter_mut().zip(acc) {
        for (o, &a) in o.iter_mut().zip(a) {
            *o = hsum(a);
        }
    }
    out
}

/// Adds `w[r] · x[t]` for a chunk of 8 inputs to every pair of the tile.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate<const R: usize, const T: usize>(
    acc: &mut [[__m256; T]; R],
    w: &[__m256; R],
    x: *const f32,
    cols: usize,
) {
    // SAFETY: the caller passes a chunk of 8 inputs of T tokens.
    let xs: [__m256; T] = std::array::from_fn(|t| unsafe { _mm256_loadu_ps(x.add(t * cols)) });
    for (acc, &w) in acc.iter_mut().zip(w) {
        for (a, &xv) in acc.iter_mut().zip(&xs) {
            *a = _mm256_fmadd_ps(w, xv, *a);
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
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
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // SAFETY: the caller checked that the rows and tokens exist; prefetches
    // may point past them (they never fault).
    unsafe {
        let codes = rows.map(|r| w.codes.as_ptr().add(r * w.row_bytes));
        let xs = x.x.as_ptr().add(t0 * cols);
        for g in 0..groups {
            let s = std::array::from_fn::<_, R, _>(|r| _mm256_set1_ps(scales[r * groups + g]));
            let b = std::array::from_fn::<_, R, _>(|r| _mm256_set1_ps(biases[r * groups + g]));
            let dequantize =
                |q: __m256i, r: usize| _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s[r], b[r]);
            let xg = xs.add(g * GROUP_SIZE);
            let bytes = GROUP_SIZE * BITS as usize / 8;
            for &row in &codes {
                let p = row.add(g * bytes).wrapping_add(PREFETCH_BYTES);
                _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
            }
            if BITS < 4 {
                // Bit planes: runs of 8 bytes, shift `2·plane` giving columns
                // 16·plane + 8k .. + 8; q3 adds bit 2 from the group's high bits.
                let high: [u64; R] = std::array::from_fn(|r| {
                    if BITS == 3 {
                        (codes[r].add(g * bytes + PLANE_BYTES) as *const u64).read_unaligned()
                    } else {
                        0
                    }
                });
                let lane_bits = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                for k in 0..2 {
                    let planes: [__m256i; R] = std::array::from_fn(|r| {
                        let p = codes[r].add(g * bytes + k * 8) as *const __m128i;
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64(p))
                    });
                    for plane in 0..4 {
                        let wk = std::array::from_fn(|r| {
                            let shift = _mm256_set1_epi32(2 * plane as i32);
                            let mut q = _mm256_and_si256(
                                _mm256_srlv_epi32(planes[r], shift),
                                _mm256_set1_epi32(3),
                            );
                            if BITS == 3 {
                                let byte = ((high[r] >> (16 * plane + 8 * k)) & 0xff) as i32;
                                let bit = _mm256_and_si256(
                                    _mm256_srlv_epi32(_mm256_set1_epi32(byte), lane_bits),
                                    _mm256_set1_epi32(1),
                                );
                                q = _mm256_or_si256(q, _mm256_slli_epi32::<2>(bit));
                            }
                            dequantize(q, r)
                        });
                        accumulate::<R, T>(&mut acc, &wk, xg.add(16 * plane + 8 * k), cols);
                    }
                }
                continue;
            }
            // Runs of 8 code bytes: 16 inputs for 4 bits (low nibbles, then
            // high ones), 8 for 8 bits.
            for k in 0..bytes / 8 {
                let q: [__m256i; R] = std::array::from_fn(|r| {
                    let p = codes[r].add(g * bytes + k * 8) as *const __m128i;
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p))
                });
                if BITS == 4 {
                    let lo = std::array::from_fn(|r| {
                        dequantize(_mm256_and_si256(q[r], _mm256_set1_epi32(15)), r)
                    });
                    accumulate::<R, T>(&mut acc, &lo, xg.add(k * 16), cols);
                    let hi = std::array::from_fn(|r| dequantize(_mm256_srli_epi32::<4>(q[r]), r));
                    accumulate::<R, T>(&mut acc, &hi, xg.add(k * 16 + 8), cols);
                } else {
                    let wk = std::array::from_fn(|r| dequantize(q[r], r));
                    accumulate::<R, T>(&mut acc, &wk, xg.add(k * 8), cols);
                }
            }
        }
    }
    sums(&acc)
}

/// `Σ (q - o)·x̂` of one group's 64 codes against its 64 activations `x`
/// (`[evens, odds]` for 4 bits), in 8 lanes. `q` is the low nibbles then
/// the high ones (4 bits), the codes in column order (2 and 3 bits), or
/// the codes minus 128 with their absolute values in `abs` (8 bits:
/// `vpmaddubsw` takes the signs from the activations, and its 16-bit pair
/// sums stay below 2·128·127).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn group_dot<const BITS: u32>(q: [__m256i; 2], abs: [__m256i; 2], x: *const i8) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the caller passes a group of 64 activations.
    let xs = unsafe {
        [
            _mm256_loadu_si256(x as *const __m256i),
            _mm256_loadu_si256(x.add(32) as *const __m256i),
        ]
    };
    if BITS != 8 {
        // At most 4·15·127 per 16-bit lane.
        let pairs = _mm256_add_epi16(
            _mm256_maddubs_epi16(q[0], xs[0]),
            _mm256_maddubs_epi16(q[1], xs[1]),
        );
        _mm256_madd_epi16(pairs, ones)
    } else {
        let half = |h: usize| {
            let pairs = _mm256_maddubs_epi16(abs[h], _mm256_sign_epi8(xs[h], q[h]));
            _mm256_madd_epi16(pairs, ones)
        };
        _mm256_add_epi32(half(0), half(1))
    }
}

/// The 64 codes of a q2 or q3 group at `p` as bytes in column order:
/// the 16 plane bytes in both halves of a register, shifted by 0 and 2
/// (columns 0–31), then 4 and 6 (32–63); q3's high bits spread to bytes by
/// a shuffle (bit `i` of the mask to byte `i`) and a compare.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn low_bit_codes<const BITS: u32>(p: *const u8) -> [__m256i; 2] {
    let three = _mm256_set1_epi8(3);
    // SAFETY: the caller passes a whole group.
    let planes = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(p as *const __m128i) });
    let mut q = [
        _mm256_and_si256(
            _mm256_srlv_epi64(planes, _mm256_setr_epi64x(0, 0, 2, 2)),
            three,
        ),
        _mm256_and_si256(
            _mm256_srlv_epi64(planes, _mm256_setr_epi64x(4, 4, 6, 6)),
            three,
        ),
    ];
    if BITS == 3 {
        // SAFETY: as above (a q3 group has 8 bytes after its planes).
        let high = unsafe { (p.add(PLANE_BYTES) as *const u64).read_unaligned() };
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        );
        let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        for (q, half) in q.iter_mut().zip([high as u32, (high >> 32) as u32]) {
            let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(half as i32), spread);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bits), bits);
            *q = _mm256_or_si256(*q, _mm256_and_si256(set, _mm256_set1_epi8(4)));
        }
    }
    q
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn int8_tile<const BITS: u32, const R: usize, const T: usize>(
    w: &QuantRows<'_>,
    rows: [usize; R],
    x: &Int8Acts,
    t0: usize,
    params: &Int8Params<'_>,
) -> [[f32; T]; R] {
    let (cols, groups, stride) = (x.cols, x.cols / GROUP_SIZE, x.stride);
    assert!(params.products.len() >= R * T * stride);
    assert!(params.scales.len() >= R * stride && params.biases.len() >= R * stride);
    assert!(x.sums.len() >= (t0 + T) * stride && x.offsets.len() >= (t0 + T) * stride);
    let group_bytes = GROUP_SIZE * BITS as usize / 8;
    let nibble = _mm256_set1_epi8(15);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // SAFETY: the caller checked that the rows and tokens exist, and the
    // asserts above the parameters; prefetches may point past them (they
    // never fault).
    unsafe {
        let codes = rows.map(|r| w.codes.as_ptr().add(r * w.row_bytes));
        let xq = x.codes.as_ptr().add(t0 * cols);
        for g in 0..groups {
            for (r, acc) in acc.iter_mut().enumerate() {
                let p = codes[r].add(g * group_bytes);
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
                let (q, abs) = if BITS == 4 {
                    let first = _mm256_loadu_si256(p as *const __m256i);
                    let q = [
                        _mm256_and_si256(first, nibble),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(first), nibble),
                    ];
                    (q, q)
                } else if BITS < 4 {
                    let q = low_bit_codes::<BITS>(p);
                    (q, q)
                } else {
                    let first = _mm256_loadu_si256(p as *const __m256i);
                    let flip = _mm256_set1_epi8(-128);
                    let q = [
                        _mm256_xor_si256(first, flip),
                        _mm256_xor_si256(_mm256_loadu_si256(p.add(32) as *const __m256i), flip),
                    ];
                    (q, q.map(|v| _mm256_abs_epi8(v)))
                };
                for (t, a) in acc.iter_mut().enumerate() {
                    let dot = group_dot::<BITS>(q, abs, xq.add(t * cols + g * GROUP_SIZE));
                    let scale =
                        _mm256_set1_ps(*params.products.get_unchecked((r * T + t) * stride + g));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *a);
                }
            }
        }
        for k in (0..stride).step_by(8) {
            for (r, acc) in acc.iter_mut().enumerate() {
                let s = _mm256_loadu_ps(params.scales.as_ptr().add(r * stride + k));
                let b = _mm256_loadu_ps(params.biases.as_ptr().add(r * stride + k));
                for (t, a) in acc.iter_mut().enumerate() {
                    let token = (t0 + t) * stride + k;
                    *a = _mm256_fmadd_ps(b, _mm256_loadu_ps(x.sums.as_ptr().add(token)), *a);
                    *a = _mm256_fmadd_ps(s, _mm256_loadu_ps(x.offsets.as_ptr().add(token)), *a);
                }
            }
        }
    }
    sums(&acc)
}

/// MXFP4 rows: a code's magnitude from the block's 8 non-negative values
/// (`vpermps` reads the low 3 bits), its sign bit 3 moved to the float's.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn mxfp4_tile<const R: usize, const T: usize>(
    w: &Mxfp4Rows<'_>,
    rows: [usize; R],
    x: &Acts<'_>,
    t0: usize,
) -> [[f32; T]; R] {
    let (cols, blocks) = (x.cols, x.cols / BLOCK);
    let magnitudes = _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // SAFETY: the caller checked that the rows and tokens exist (with
    // their exponents); prefetches may point past them.
    unsafe {
        let codes = rows.map(|r| w.codes.as_ptr().add(r * w.row_bytes));
        let xs = x.x.as_ptr().add(t0 * cols);
        for b in 0..blocks {
            let table: [__m256; R] = std::array::from_fn(|r| {
                let e = *w.exponents.get_unchecked(rows[r] * blocks + b);
                _mm256_mul_ps(magnitudes, _mm256_set1_ps(exponent_scale(e)))
            });
            let value = |q: __m256i, r: usize| {
                let magnitude = _mm256_permutevar8x32_ps(table[r], q);
                let sign = _mm256_slli_epi32::<28>(_mm256_and_si256(q, _mm256_set1_epi32(8)));
                _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(magnitude), sign))
            };
            for &row in &codes {
                let p = row.add(b * BLOCK / 2).wrapping_add(PREFETCH_BYTES);
                _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
            }
            let xb = xs.add(b * BLOCK);
            // Runs of 8 code bytes: 16 inputs, low nibbles then high ones.
            for k in 0..2 {
                let q: [__m256i; R] = std::array::from_fn(|r| {
                    let p = codes[r].add(b * BLOCK / 2 + k * 8) as *const __m128i;
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p))
                });
                let lo = std::array::from_fn(|r| {
                    value(_mm256_and_si256(q[r], _mm256_set1_epi32(15)), r)
                });
                accumulate::<R, T>(&mut acc, &lo, xb.add(k * 16), cols);
                let hi = std::array::from_fn(|r| value(_mm256_srli_epi32::<4>(q[r]), r));
                accumulate::<R, T>(&mut acc, &hi, xb.add(k * 16 + 8), cols);
            }
        }
    }
    sums(&acc)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn float_tile<const BF16: bool, const R: usize, const T: usize>(
    w: &FloatRows<'_>,
    rows: [usize; R],
    x: &Acts<'_>,
    t0: usize,
) -> [[f32; T]; R] {
    let cols = w.cols;
    let whole = cols / 8 * 8;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // SAFETY: the caller checked that the rows and tokens exist.
    unsafe {
        for c in (0..whole).step_by(8) {
            let wc = rows.map(|r| {
                let at = r * cols + c;
                if BF16 {
                    let h = _mm_loadu_si128(w.data.as_ptr().add(2 * at) as *const __m128i);
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                } else {
                    _mm256_loadu_ps(w.data.as_ptr().add(4 * at) as *const f32)
                }
            });
            accumulate::<R, T>(&mut acc, &wc, x.x.as_ptr().add(t0 * cols + c), cols);
        }
    }
    let mut out = sums(&acc);
    for (&r, out) in rows.iter().zip(&mut out) {
        for (t, out) in out.iter_mut().enumerate() {
            for c in whole..cols {
                *out += w.value(r * cols + c) * x.x[(t0 + t) * cols + c];
            }
        }
    }
    out
}

impl Kernels for Avx2 {
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

#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_rows(w: &Mxfp4Rows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { mxfp4_rows_with::<Avx2>(w, x, out, MAX_ROWS, MAX_TOKENS) }
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn quant_rows(w: &QuantRows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { quant_rows_with::<Avx2>(w, x, out, MAX_ROWS, MAX_TOKENS) }
}

impl Int8Kernel for Avx2 {
    #[inline(always)]
    unsafe fn int8_tile<const BITS: u32, const R: usize, const T: usize>(
        w: &QuantRows<'_>,
        rows: [usize; R],
        x: &Int8Acts,
        t0: usize,
        params: &Int8Params<'_>,
    ) -> [[f32; T]; R] {
        // SAFETY: forwarded.
        unsafe { int8_tile::<BITS, R, T>(w, rows, x, t0, params) }
    }
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn int8_rows(w: &QuantRows<'_>, x: &Int8Acts, out: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { int8_rows_with::<Avx2>(w, x, out, MAX_ROWS, MAX_TOKENS) }
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn float_rows(w: &FloatRows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { float_rows_with::<Avx2>(w, x, out, MAX_ROWS, MAX_TOKENS) }
}

/// Runs `f` with AVX2 enabled (see [`super::Isa::vectorize`]).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn vectorize<R>(f: impl FnOnce() -> R) -> R {
    f()
}
