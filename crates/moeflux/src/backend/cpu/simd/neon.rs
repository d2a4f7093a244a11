//! NEON kernels (baseline on aarch64): 4 lanes, each code widened,
//! converted and dequantized with one FMA. q2 and q3 groups unpack 16
//! columns per shift of their bit planes; q3's high bits become bytes by a
//! bit test against each lane's bit.

use std::arch::aarch64::*;

use super::{
    Acts, FloatRows, Kernels, Mxfp4Rows, QuantRows, float_rows_with, mxfp4_rows_with,
    quant_rows_with,
};
use crate::quant::GROUP_SIZE;
use crate::quant::lowbit::PLANE_BYTES;
use crate::quant::mxfp4::{BLOCK, exponent_scale};

struct Neon;

const MAX_ROWS: usize = 2;
const MAX_TOKENS: usize = 2;

/// Adds `w[r] · x[t]` for a chunk of 4 inputs to every pair of the tile.
#[inline(always)]
unsafe fn accumulate<const R: usize, const T: usize>(
    acc: &mut [[float32x4_t; T]; R],
    w: &[float32x4_t; R],
    x: *const f32,
    cols: usize,
) {
    // SAFETY: the caller passes a chunk of 4 inputs of T tokens.
    let xs: [float32x4_t; T] = std::array::from_fn(|t| unsafe { vld1q_f32(x.add(t * cols)) });
    for (acc, &w) in acc.iter_mut().zip(w) {
        for (a, &xv) in acc.iter_mut().zip(&xs) {
            // SAFETY: NEON is baseline on aarch64.
            *a = unsafe { vfmaq_f32(*a, w, xv) };
        }
    }
}

/// Sums of the lanes (pairwise, a fixed order).
#[inline(always)]
unsafe fn sums<const R: usize, const T: usize>(acc: &[[float32x4_t; T]; R]) -> [[f32; T]; R] {
    let mut out = [[0f32; T]; R];
    for (o, a) in out.iter_mut().zip(acc) {
        for (o, &a) in o.iter_mut().zip(a) {
            // SAFETY: NEON is baseline on aarch64.
            *o = unsafe { vaddvq_f32(a) };
        }
    }
    out
}

impl Kernels for Neon {
    #[inline(always)]
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
        // SAFETY: the caller checked that the rows and tokens exist.
        unsafe {
            let mut acc = [[vdupq_n_f32(0.0); T]; R];
            let codes = rows.map(|r| w.codes.as_ptr().add(r * w.row_bytes));
            let xs = x.x.as_ptr().add(t0 * cols);
            let bytes = GROUP_SIZE * BITS as usize / 8;
            for g in 0..groups {
                let s: [float32x4_t; R] =
                    std::array::from_fn(|r| vdupq_n_f32(scales[r * groups + g]));
                let b: [float32x4_t; R] =
                    std::array::from_fn(|r| vdupq_n_f32(biases[r * groups + g]));
                // q·s + b for 8 codes widened to u16, as two vectors of 4.
                let dequantize = |q: uint16x8_t, r: usize| {
                    let lo = vcvtq_f32_u32(vmovl_u16(vget_low_u16(q)));
                    let hi = vcvtq_f32_u32(vmovl_high_u16(q));
                    [vfmaq_f32(b[r], lo, s[r]), vfmaq_f32(b[r], hi, s[r])]
                };
                let xg = xs.add(g * GROUP_SIZE);
                if BITS < 4 {
                    let planes: [uint8x16_t; R] =
                        std::array::from_fn(|r| vld1q_u8(codes[r].add(g * bytes)));
                    let high: [u64; R] = std::array::from_fn(|r| {
                        if BITS == 3 {
                            (codes[r].add(g * bytes + PLANE_BYTES) as *const u64).read_unaligned()
                        } else {
                            0
                        }
                    });
                    let lane_bits = vld1q_u8(
                        [1u8, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128].as_ptr(),
                    );
                    // Shift `2·plane` of the planes: columns 16·plane .. + 16.
                    for plane in 0..4 {
                        let parts: [[[float32x4_t; 2]; R]; 2] = {
                            let q: [uint8x16_t; R] = std::array::from_fn(|r| {
                                let shift = vdupq_n_s8(-2 * plane as i8);
                                let mut q = vandq_u8(vshlq_u8(planes[r], shift), vdupq_n_u8(3));
                                if BITS == 3 {
                                    let bits = (high[r] >> (16 * plane)) as u16;
                                    let spread = vcombine_u8(
                                        vdup_n_u8(bits as u8),
                                        vdup_n_u8((bits >> 8) as u8),
                                    );
                                    let set = vtstq_u8(spread, lane_bits);
                                    q = vorrq_u8(q, vandq_u8(set, vdupq_n_u8(4)));
                                }
                                q
                            });
                            [
                                std::array::from_fn(|r| dequantize(vmovl_u8(vget_low_u8(q[r])), r)),
                                std::array::from_fn(|r| dequantize(vmovl_high_u8(q[r]), r)),
                            ]
                        };
                        for (p, part) in parts.iter().enumerate() {
                            let halves: [[float32x4_t; R]; 2] =
                                std::array::from_fn(|h| part.map(|row| row[h]));
                            for (half, wv) in halves.iter().enumerate() {
                                let at = xg.add(16 * plane + p * 8 + half * 4);
                                accumulate::<R, T>(&mut acc, wv, at, cols);
                            }
                        }
                    }
                    continue;
                }
                // Runs of 8 code bytes: 16 inputs for 4 bits (low nibbles,
                // then high ones), 8 for 8 bits.
                for k in 0..bytes / 8 {
                    let q: [uint16x8_t; R] =
                        std::array::from_fn(|r| vmovl_u8(vld1_u8(codes[r].add(g * bytes + k * 8))));
                    let parts: [[[float32x4_t; 2]; R]; 2] = if BITS == 4 {
                        [
                            std::array::from_fn(|r| {
                                dequantize(vandq_u16(q[r], vdupq_n_u16(15)), r)
                            }),
                            std::array::from_fn(|r| dequantize(vshrq_n_u16::<4>(q[r]), r)),
                        ]
                    } else {
                        [
                            std::array::from_fn(|r| dequantize(q[r], r)),
                            [[vdupq_n_f32(0.0); 2]; R],
                        ]
                    };
                    let (count, width) = if BITS == 4 { (2, 16) } else { (1, 8) };
                    for (p, part) in parts.iter().enumerate().take(count) {
                        // The part's 8 weights of every row, 4 at a time.
                        let halves: [[float32x4_t; R]; 2] =
                            std::array::from_fn(|h| part.map(|row| row[h]));
                        for (half, wv) in halves.iter().enumerate() {
                            let at = xg.add(k * width + p * 8 + half * 4);
                            accumulate::<R, T>(&mut acc, wv, at, cols);
                        }
                    }
                }
            }
            sums(&acc)
        }
    }

    /// MXFP4 rows: twice a code's magnitude (0 to 12) from a byte table,
    /// widened, converted and scaled by half the block's power of two
    /// (exact), its sign bit 3 moved to the float's.
    #[inline(always)]
    unsafe fn mxfp4_tile<const R: usize, const T: usize>(
        w: &Mxfp4Rows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
    ) -> [[f32; T]; R] {
        let (cols, blocks) = (x.cols, x.cols / BLOCK);
        // SAFETY: the caller checked that the rows and tokens exist (with
        // their exponents).
        unsafe {
            let mut acc = [[vdupq_n_f32(0.0); T]; R];
            let codes = rows.map(|r| w.codes.as_ptr().add(r * w.row_bytes));
            let xs = x.x.as_ptr().add(t0 * cols);
            let doubled = vld1q_u8([0u8, 1, 2, 3, 4, 6, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0].as_ptr());
            for b in 0..blocks {
                // Half the block's power of two (twice the magnitudes above).
                let half: [f32; R] = std::array::from_fn(|r| {
                    0.5 * exponent_scale(w.exponents[rows[r] * blocks + b])
                });
                let values = |q: uint8x8_t, r: usize| -> [float32x4_t; 2] {
                    let magnitude = vmovl_u8(vqtbl1_u8(doubled, vand_u8(q, vdup_n_u8(7))));
                    let sign = vmovl_u8(vand_u8(q, vdup_n_u8(8)));
                    let part = |m: uint32x4_t, s: uint32x4_t| {
                        let v = vmulq_n_f32(vcvtq_f32_u32(m), half[r]);
                        vreinterpretq_f32_u32(veorq_u32(
                            vreinterpretq_u32_f32(v),
                            vshlq_n_u32::<28>(s),
                        ))
                    };
                    [
                        part(
                            vmovl_u16(vget_low_u16(magnitude)),
                            vmovl_u16(vget_low_u16(sign)),
                        ),
                        part(vmovl_high_u16(magnitude), vmovl_high_u16(sign)),
                    ]
                };
                let xb = xs.add(b * BLOCK);
                // Runs of 8 code bytes: 16 inputs, low nibbles then high.
                for k in 0..2 {
                    let bytes: [uint8x8_t; R] =
                        std::array::from_fn(|r| vld1_u8(codes[r].add(b * BLOCK / 2 + k * 8)));
                    let parts: [[[float32x4_t; 2]; R]; 2] = [
                        std::array::from_fn(|r| values(vand_u8(bytes[r], vdup_n_u8(15)), r)),
                        std::array::from_fn(|r| values(vshr_n_u8::<4>(bytes[r]), r)),
                    ];
                    for (p, part) in parts.iter().enumerate() {
                        let halves: [[float32x4_t; R]; 2] =
                            std::array::from_fn(|h| part.map(|row| row[h]));
                        for (h, wv) in halves.iter().enumerate() {
                            let at = xb.add(k * 16 + p * 8 + h * 4);
                            accumulate::<R, T>(&mut acc, wv, at, cols);
                        }
                    }
                }
            }
            sums(&acc)
        }
    }

    #[inline(always)]
    unsafe fn float_tile<const BF16: bool, const R: usize, const T: usize>(
        w: &FloatRows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
    ) -> [[f32; T]; R] {
        let cols = w.cols;
        let whole = cols / 4 * 4;
        // SAFETY: the caller checked that the rows and tokens exist.
        let mut out = unsafe {
            let mut acc = [[vdupq_n_f32(0.0); T]; R];
            for c in (0..whole).step_by(4) {
                let wc = rows.map(|r| {
                    let at = r * cols + c;
                    if BF16 {
                        let h = vld1_u16(w.data.as_ptr().add(2 * at) as *const u16);
                        vreinterpretq_f32_u32(vshll_n_u16::<16>(h))
                    } else {
                        vld1q_f32(w.data.as_ptr().add(4 * at) as *const f32)
                    }
                });
                accumulate::<R, T>(&mut acc, &wc, x.x.as_ptr().add(t0 * cols + c), cols);
            }
            sums(&acc)
        };
        for (&r, out) in rows.iter().zip(&mut out) {
            for (t, out) in out.iter_mut().enumerate() {
                for c in whole..cols {
                    *out += w.value(r * cols + c) * x.x[(t0 + t) * cols + c];
                }
            }
        }
        out
    }
}

pub unsafe fn quant_rows(w: &QuantRows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { quant_rows_with::<Neon>(w, x, out, MAX_ROWS, MAX_TOKENS) }
}

pub unsafe fn mxfp4_rows(w: &Mxfp4Rows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { mxfp4_rows_with::<Neon>(w, x, out, MAX_ROWS, MAX_TOKENS) }
}

pub unsafe fn float_rows(w: &FloatRows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { float_rows_with::<Neon>(w, x, out, MAX_ROWS, MAX_TOKENS) }
}
