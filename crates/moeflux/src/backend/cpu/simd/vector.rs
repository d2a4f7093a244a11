//! Whole-slice f32 helpers written so the compiler vectorises them with
//! results that do not depend on the vector width: sums, maxima, dot
//! products and `exp` over a fixed number of lanes.

use half::bf16;

/// Sum in [`DOT_LANES`] partial sums, a fixed order that vectorises.
#[inline(always)]
pub(super) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; DOT_LANES];
    let whole = x.len() / DOT_LANES * DOT_LANES;
    for c in x[..whole].chunks_exact(DOT_LANES) {
        for i in 0..DOT_LANES {
            acc[i] += c[i];
        }
    }
    reduce_lanes(acc) + x[whole..].iter().sum::<f32>()
}

/// The largest of `x` (minus infinity for none), over [`DOT_LANES`] lanes
/// so it vectorises.
#[inline(always)]
pub fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; DOT_LANES];
    let (chunks, rest) = x.as_chunks::<DOT_LANES>();
    for c in chunks {
        for i in 0..DOT_LANES {
            acc[i] = acc[i].max(c[i]);
        }
    }
    acc.into_iter()
        .chain(rest.iter().copied())
        .fold(f32::NEG_INFINITY, f32::max)
}

/// `e^x` within about an ulp (Cephes' single-precision polynomial after
/// reducing by powers of two), in plain f32 operations: it vectorises, and
/// every instruction set gives it the same bits. Below -87 it is 0 (the
/// true value is under f32's smallest normal), above 88 infinity.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Adding 1.5·2^23 rounds a float below 2^22 to an integer.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let c = x.clamp(-87.0, 88.0);
    let n = (c * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = c - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let e = y * f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else if x > 88.0 {
        f32::INFINITY
    } else {
        e
    }
}

/// Replaces each `x` by `e^(x - shift)` ([`exp`]) and returns their sum
/// (over [`DOT_LANES`] lanes, a fixed order).
#[inline(always)]
pub fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
    for v in x.iter_mut() {
        *v = exp(*v - shift);
    }
    sum(x)
}

/// Lanes of [`dot`]'s partial sums: a whole AVX-512 register, two AVX2
/// ones, four NEON ones.
pub(super) const DOT_LANES: usize = 16;

/// f32 dot product with `DOT_LANES` partial sums added in a fixed order,
/// so any vector width gives the same result.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let len = a.len().min(b.len());
    let (a, b) = (&a[..len], &b[..len]);
    let mut acc = [0f32; DOT_LANES];
    let (chunks_a, _) = a.as_chunks::<DOT_LANES>();
    let (chunks_b, _) = b.as_chunks::<DOT_LANES>();
    for (ca, cb) in chunks_a.iter().zip(chunks_b) {
        for i in 0..DOT_LANES {
            acc[i] += ca[i] * cb[i];
        }
    }
    let whole = chunks_a.len() * DOT_LANES;
    let mut sum = reduce_lanes(acc);
    for (x, y) in a[whole..].iter().zip(&b[whole..]) {
        sum += x * y;
    }
    sum
}

/// Pairwise sum of the lanes, the shape of a vector register reduction.
#[inline(always)]
pub(super) fn reduce_lanes(acc: [f32; DOT_LANES]) -> f32 {
    let mut acc: [f32; DOT_LANES / 2] = std::array::from_fn(|i| acc[i] + acc[i + DOT_LANES / 2]);
    // Opaque to the optimiser: seeing the whole reduction tree, LLVM's SLP
    // vectoriser built the loops feeding it (in `dot`, `sum`) from pairs of
    // lanes, 2-wide code even on AVX-512; with the tree cut here they use
    // full registers.
    acc = std::hint::black_box(acc);
    let mut width = DOT_LANES / 4;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `dst = src` as f32.
#[inline(always)]
pub(super) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}
