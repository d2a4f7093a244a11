//! Matrix products against stored (possibly quantized) weights.
//!
//! Each weight row is dequantized once into a thread-local f32 buffer and
//! then dotted with every token of the batch, so a prefill chunk pays the
//! dequantization once per row, and rows are spread across threads.

use rayon::prelude::*;

use crate::quant::MatrixView;

/// `out[t, r] = Σ_c x[t, c] · w[r, c]`; `x` is `[n, cols]`, the result
/// `[n, rows]`.
pub fn matmul(x: &[f32], n: usize, w: &MatrixView<'_>) -> Vec<f32> {
    let (rows, cols) = (w.rows(), w.cols());
    debug_assert_eq!(x.len(), n * cols);
    let block = rows_per_task(rows);
    // Computed row-major by weight row ([rows, n]) so each task owns a
    // contiguous slice; transposed afterwards when n > 1.
    let mut by_row = vec![0f32; rows * n];
    by_row.par_chunks_mut(block * n).enumerate().for_each_init(
        || vec![0f32; cols],
        |row_buf, (task, out)| {
            for (i, out_row) in out.chunks_exact_mut(n).enumerate() {
                w.dequantize_row(task * block + i, row_buf);
                for (t, o) in out_row.iter_mut().enumerate() {
                    *o = dot(row_buf, &x[t * cols..(t + 1) * cols]);
                }
            }
        },
    );
    if n == 1 {
        return by_row;
    }
    let mut out = vec![0f32; n * rows];
    for r in 0..rows {
        for t in 0..n {
            out[t * rows + r] = by_row[r * n + t];
        }
    }
    out
}

fn rows_per_task(rows: usize) -> usize {
    (rows / (rayon::current_num_threads() * 8)).clamp(1, 64)
}

/// f32 dot product with independent partial sums, which the compiler
/// vectorises.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let (a_chunks, a_tail) = a.split_at(a.len() / LANES * LANES);
    let (b_chunks, b_tail) = b.split_at(a_chunks.len());
    for (ca, cb) in a_chunks
        .chunks_exact(LANES)
        .zip(b_chunks.chunks_exact(LANES))
    {
        for i in 0..LANES {
            acc[i] += ca[i] * cb[i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (x, y) in a_tail.iter().zip(b_tail) {
        sum += x * y;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{DType, MatrixLayout, RowEncoder};
    use crate::util::AlignedBuf;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 1000.0 - 0.5)
            .collect()
    }

    #[test]
    fn matmul_matches_reference_on_awkward_sizes() {
        for dtype in [DType::F32, DType::Bf16, DType::Q8, DType::Q4] {
            for (n, rows, cols) in [(1, 1, 64), (3, 37, 128), (5, 130, 192), (2, 7, 64)] {
                let w = values(rows * cols, 3);
                let x = values(n * cols, 11);
                let layout = MatrixLayout::new(dtype, rows, cols).unwrap();
                let bytes = AlignedBuf::from_slice(&RowEncoder::new(layout).encode_matrix(&w));
                let view = MatrixView::new(layout, &bytes);
                let got = matmul(&x, n, &view);
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    view.dequantize_row(r, &mut row);
                    for t in 0..n {
                        let want: f64 = (0..cols)
                            .map(|c| row[c] as f64 * x[t * cols + c] as f64)
                            .sum();
                        let g = got[t * rows + r] as f64;
                        assert!(
                            (g - want).abs() < 1e-4,
                            "{dtype:?} {n}x{rows}x{cols}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
