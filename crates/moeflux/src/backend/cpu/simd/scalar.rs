//! Portable kernels: the fallback, and the plainest statement of what the
//! vector kernels compute (in another summation order).

use super::{
    Acts, FloatRows, Int8Acts, Int8Kernel, Int8Params, Kernels, Mxfp4Rows, QuantRows, dot,
    float_rows_with, int8_rows_with, mxfp4_rows_with, quant_rows_with,
};
use crate::quant::GROUP_SIZE;
use crate::quant::lowbit;
use crate::quant::mxfp4::{BLOCK, E2M1, exponent_scale};

struct Scalar;

/// The code of column `c` of a row of `BITS`-bit codes.
#[inline(always)]
fn code<const BITS: u32>(codes: &[u8], c: usize) -> u8 {
    match BITS {
        8 => codes[c],
        4 => (codes[c / 2] >> (4 * (c % 2))) & 15,
        _ => {
            let group = &codes[c / GROUP_SIZE * lowbit::group_bytes(BITS)..];
            lowbit::code_at(BITS, group, c % GROUP_SIZE)
        }
    }
}

impl Int8Kernel for Scalar {
    unsafe fn int8_tile<const BITS: u32, const R: usize, const T: usize>(
        w: &QuantRows<'_>,
        rows: [usize; R],
        x: &Int8Acts,
        t0: usize,
        params: &Int8Params<'_>,
    ) -> [[f32; T]; R] {
        let (cols, groups, stride) = (x.cols, x.cols / GROUP_SIZE, x.stride);
        let mut out = [[0f32; T]; R];
        for (i, (&r, out)) in rows.iter().zip(&mut out).enumerate() {
            let codes = &w.codes[r * w.row_bytes..][..w.row_bytes];
            for (t, out) in out.iter_mut().enumerate() {
                let xs = &x.codes[(t0 + t) * cols..][..cols];
                let mut acc = 0f32;
                for g in 0..groups {
                    let xg = &xs[g * GROUP_SIZE..][..GROUP_SIZE];
                    let dot: i32 = if BITS == 4 {
                        // Byte j holds inputs 2j and 2j + 1, which the
                        // activations keep at j and 32 + j.
                        let (evens, odds) = xg.split_at(GROUP_SIZE / 2);
                        codes[g * GROUP_SIZE / 2..][..GROUP_SIZE / 2]
                            .iter()
                            .zip(evens.iter().zip(odds))
                            .map(|(&q, (&e, &o))| {
                                (q & 15) as i32 * e as i32 + (q >> 4) as i32 * o as i32
                            })
                            .sum()
                    } else {
                        // 8, 3 or 2 bits: inputs in their order.
                        xg.iter()
                            .enumerate()
                            .map(|(c, &v)| {
                                code::<BITS>(codes, g * GROUP_SIZE + c) as i32 * v as i32
                            })
                            .sum()
                    };
                    acc += params.products[(i * T + t) * x.stride + g] * dot as f32;
                }
                let row = i * stride;
                let token = (t0 + t) * stride;
                for k in 0..stride {
                    acc += params.biases[row + k] * x.sums[token + k];
                    acc += params.scales[row + k] * x.offsets[token + k];
                }
                *out = acc;
            }
        }
        out
    }
}

impl Kernels for Scalar {
    unsafe fn quant_tile<const BITS: u32, const R: usize, const T: usize>(
        w: &QuantRows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
        scales: &[f32],
        biases: &[f32],
    ) -> [[f32; T]; R] {
        let (cols, groups) = (x.cols, x.cols / GROUP_SIZE);
        let mut row = vec![0f32; cols];
        let mut out = [[0f32; T]; R];
        for (i, (&r, out)) in rows.iter().zip(&mut out).enumerate() {
            let codes = &w.codes[r * w.row_bytes..][..w.row_bytes];
            for (c, v) in row.iter_mut().enumerate() {
                let q = code::<BITS>(codes, c);
                let g = i * groups + c / GROUP_SIZE;
                *v = q as f32 * scales[g] + biases[g];
            }
            for (t, out) in out.iter_mut().enumerate() {
                *out = dot(&row, &x.x[(t0 + t) * cols..][..cols]);
            }
        }
        out
    }

    unsafe fn mxfp4_tile<const R: usize, const T: usize>(
        w: &Mxfp4Rows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
    ) -> [[f32; T]; R] {
        let (cols, blocks) = (x.cols, x.cols / BLOCK);
        let mut row = vec![0f32; cols];
        let mut out = [[0f32; T]; R];
        for (&r, out) in rows.iter().zip(&mut out) {
            let codes = &w.codes[r * w.row_bytes..][..w.row_bytes];
            let exponents = &w.exponents[r * blocks..][..blocks];
            for (c, v) in row.iter_mut().enumerate() {
                let q = (codes[c / 2] >> (4 * (c % 2))) & 15;
                *v = E2M1[q as usize] * exponent_scale(exponents[c / BLOCK]);
            }
            for (t, out) in out.iter_mut().enumerate() {
                *out = dot(&row, &x.x[(t0 + t) * cols..][..cols]);
            }
        }
        out
    }

    unsafe fn float_tile<const BF16: bool, const R: usize, const T: usize>(
        w: &FloatRows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
    ) -> [[f32; T]; R] {
        let cols = w.cols;
        let mut row = vec![0f32; cols];
        let mut out = [[0f32; T]; R];
        for (&r, out) in rows.iter().zip(&mut out) {
            for (c, v) in row.iter_mut().enumerate() {
                *v = w.value(r * cols + c);
            }
            for (t, out) in out.iter_mut().enumerate() {
                *out = dot(&row, &x.x[(t0 + t) * cols..][..cols]);
            }
        }
        out
    }
}

pub fn quant_rows(w: &QuantRows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: the scalar kernels index with bounds checks.
    unsafe { quant_rows_with::<Scalar>(w, x, out, 1, 4) }
}

pub fn mxfp4_rows(w: &Mxfp4Rows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { mxfp4_rows_with::<Scalar>(w, x, out, 1, 4) }
}

pub fn float_rows(w: &FloatRows<'_>, x: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { float_rows_with::<Scalar>(w, x, out, 1, 4) }
}

pub fn int8_rows(w: &QuantRows<'_>, x: &Int8Acts, out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { int8_rows_with::<Scalar>(w, x, out, 1, 4) }
}
