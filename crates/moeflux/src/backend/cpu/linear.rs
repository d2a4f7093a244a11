//! Matrix products against stored (possibly quantized) weights.
//!
//! Rows are computed in tiles of a few rows × a few tokens by the kernels
//! of [`super::simd`], so each weight is read from memory once per call
//! and unpacked once per tile of tokens. Blocks of rows become tasks of a
//! parallel region ([`super::pool`]) only when each has enough work to pay
//! for the split. Several products
//! (a layer's experts, attention's projections) can share one parallel
//! region ([`matmul_many_with`]): their rows are split into tasks of about
//! equal work across all of them, one fork and join for the lot.

use std::sync::OnceLock;

use super::simd::{Acts, FloatRows, Int8Acts, Isa, Mxfp4Rows, QuantRows};
use super::{CpuOptions, pool};
use crate::quant::{DType, MatrixView, mxfp4};

pub use super::simd::dot;

/// How products with quantized (q2, q3, q4, q8) weights take their
/// activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activations {
    /// As f32: exact to f32 rounding against the dequantized weights.
    #[default]
    F32,
    /// Quantized to int8 per group of 64 inputs, with integer dot products
    /// (see `simd::Int8Acts`): faster, at the accuracy cost of rounding
    /// every activation to one of 255 levels of its group. MXFP4 rows, not
    /// affine, take f32 activations still.
    Int8,
}

/// `out[t, r] = Σ_c x[t, c] · w[r, c]`; `x` is `[n, cols]`, the result
/// `[n, rows]`.
pub fn matmul(x: &[f32], n: usize, w: &MatrixView<'_>, activations: Activations) -> Vec<f32> {
    matmul_with(Isa::get(), x, n, w, activations)
}

/// [`matmul`] with the kernels of `isa`.
pub fn matmul_with(
    isa: Isa,
    x: &[f32],
    n: usize,
    w: &MatrixView<'_>,
    activations: Activations,
) -> Vec<f32> {
    let product = Product {
        x,
        n,
        w: *w,
        activations,
    };
    let mut out = matmul_many_with(isa, CpuOptions::default().pool, &[product]);
    out.pop().expect("one product")
}

/// One product of [`matmul_many_with`]: `x` (`[n, cols]`) by the rows of `w`.
#[derive(Clone, Copy)]
pub struct Product<'a> {
    pub x: &'a [f32],
    pub n: usize,
    pub w: MatrixView<'a>,
    pub activations: Activations,
}

/// Inputs below this many values in all are laid out on the calling
/// thread: a parallel region would cost more than it saves.
const MIN_PARALLEL_INPUTS: usize = 1 << 16;

/// Products below this many multiply-adds per task are not split further,
/// unless `MOEFLUX_CPU_TASK_MACS` says otherwise: a few microseconds of one
/// core, well above the cost of claiming a task, and small enough that a
/// decode step's products spread evenly over 16 threads (on the
/// qwen3-30b-a3b shape, 16 threads: 31–33 tok/s with 512K a task, 37–38
/// with 128K).
fn min_task_macs() -> usize {
    static MACS: OnceLock<usize> = OnceLock::new();
    *MACS.get_or_init(|| crate::tuning::cpu_task_macs(1 << 17))
}

/// The inputs of a product, laid out for its kernels.
enum Inputs<'a> {
    Float(Acts<'a>),
    Int8(Int8Acts),
}

impl<'a> Inputs<'a> {
    fn new(isa: Isa, p: &Product<'a>) -> Inputs<'a> {
        let cols = p.w.cols();
        assert_eq!(p.x.len(), p.n * cols, "matmul: input is not [n, cols]");
        match Inputs::layout(p) {
            (true, Some(bits)) => Inputs::Int8(Int8Acts::new(isa, p.x, p.n, cols, bits)),
            (_, bits) => Inputs::Float(Acts::new(isa, p.x, p.n, cols, bits)),
        }
    }

    /// How a product takes its inputs: int8 or not, and laid out for rows
    /// of which code width (MXFP4's codes are packed as 4-bit ones).
    fn layout(p: &Product<'_>) -> (bool, Option<u32>) {
        let dtype = p.w.layout.dtype;
        match dtype.bits() {
            Some(bits) => (p.activations == Activations::Int8, Some(bits)),
            None if dtype == DType::Mxfp4 => (false, Some(4)),
            None => (false, None),
        }
    }
}

/// Rows `[first, first + len)` of `w` by `inputs` into `out` (`[len, n]`).
fn block(
    isa: Isa,
    w: &MatrixView<'_>,
    inputs: &Inputs<'_>,
    first: usize,
    len: usize,
    out: &mut [f32],
) {
    let l = &w.layout;
    let data = &w.bytes[first * l.row_bytes..(first + len) * l.row_bytes];
    if l.dtype == DType::Mxfp4 {
        let Inputs::Float(acts) = inputs else {
            unreachable!("MXFP4 rows take f32 inputs")
        };
        let blocks = w.cols() / mxfp4::BLOCK;
        let rows = Mxfp4Rows {
            rows: len,
            codes: data,
            row_bytes: l.row_bytes,
            exponents: &w.bytes[l.scales_offset + first * blocks..][..len * blocks],
        };
        isa.mxfp4_rows(&rows, acts, out);
        return;
    }
    match l.dtype.bits() {
        Some(bits) => {
            let groups = l.groups_per_row();
            let params = |offset: usize| {
                let bytes = &w.bytes[offset + 2 * first * groups..][..2 * len * groups];
                bytemuck::cast_slice(bytes)
            };
            let rows = QuantRows {
                bits,
                rows: len,
                codes: data,
                row_bytes: l.row_bytes,
                scales: params(l.scales_offset),
                biases: params(l.biases_offset),
            };
            match inputs {
                Inputs::Float(acts) => isa.quant_rows(&rows, acts, out),
                Inputs::Int8(acts) => isa.int8_rows(&rows, acts, out),
            }
        }
        None => {
            let Inputs::Float(acts) = inputs else {
                unreachable!("int8 inputs only for quantized rows")
            };
            let rows = FloatRows {
                bf16: l.dtype == DType::Bf16,
                rows: len,
                cols: w.cols(),
                data,
            };
            isa.float_rows(&rows, acts, out);
        }
    }
}

/// Each product's result as [`matmul`] gives it, bit for bit, all computed
/// in one parallel region (on moeflux's workers where `on_pool`), with the
/// kernels of `isa`. Products whose
/// inputs are the same slice (and whose weights take inputs in the same
/// layout) share one preparation of them, e.g. one int8 quantization for
/// an expert's gate and up.
#[track_caller]
pub fn matmul_many_with(isa: Isa, on_pool: bool, products: &[Product<'_>]) -> Vec<Vec<f32>> {
    let (inputs, input_of) = prepare_inputs(isa, on_pool, products);
    let mut outs: Vec<Vec<f32>> = products
        .iter()
        .map(|p| vec![0f32; p.n * p.w.rows()])
        .collect();
    let task_macs = task_macs(products);
    let tasks = row_tasks(
        task_macs,
        products
            .iter()
            .enumerate()
            .filter(|(_, p)| p.n > 0)
            .map(|(i, p)| (i, p.w.rows(), p.w.cols() * p.n)),
    );
    let targets: Vec<Columns> = outs.iter_mut().map(|o| Columns::new(o)).collect();
    pool::run(on_pool, tasks.len(), |t| {
        let (i, first, len) = tasks[t];
        let p = &products[i];
        let inputs = &inputs[input_of[i]];
        if p.n == 1 {
            // SAFETY: the tasks' row ranges of one product are disjoint.
            let out = unsafe { targets[i].rows(first, len) };
            return block(isa, &p.w, inputs, first, len, out);
        }
        // The kernels write by weight row ([len, n]), each tile's outputs
        // contiguous; this thread then places them into the product's
        // [n, rows] result, so the reordering is as parallel as the
        // products.
        let mut by_row = vec![0f32; len * p.n];
        block(isa, &p.w, inputs, first, len, &mut by_row);
        // SAFETY: as above.
        unsafe { targets[i].scatter(first, len, p.n, &by_row) };
    });
    outs
}

/// One-token products in pairs of as many rows (an expert's gate and up),
/// in one parallel region: a task computes the same rows of both and
/// `combine(pair, first_row, a, b)` folds them into `a` there, while they
/// are in its core's cache (a decode step's expert activation). Returns
/// each pair's combined rows; each product's values are [`matmul`]'s.
#[track_caller]
pub fn matmul_pairs_with(
    isa: Isa,
    on_pool: bool,
    pairs: &[[Product<'_>; 2]],
    combine: impl Fn(usize, usize, &mut [f32], &[f32]) + Sync,
) -> Vec<Vec<f32>> {
    let products: Vec<Product<'_>> = pairs.iter().flatten().copied().collect();
    assert!(
        pairs
            .iter()
            .all(|[a, b]| a.n == 1 && b.n == 1 && a.w.rows() == b.w.rows()),
        "paired products take one token and have as many rows"
    );
    let (inputs, input_of) = prepare_inputs(isa, on_pool, &products);
    let mut outs: Vec<Vec<f32>> = pairs.iter().map(|[a, _]| vec![0f32; a.w.rows()]).collect();
    let tasks = row_tasks(
        task_macs(&products),
        pairs
            .iter()
            .enumerate()
            .map(|(i, [a, b])| (i, a.w.rows(), a.w.cols() + b.w.cols())),
    );
    let targets: Vec<Columns> = outs.iter_mut().map(|o| Columns::new(o)).collect();
    pool::run(on_pool, tasks.len(), |t| {
        let (i, first, len) = tasks[t];
        let [a, b] = &pairs[i];
        // SAFETY: the tasks' row ranges of one pair are disjoint.
        let out = unsafe { targets[i].rows(first, len) };
        block(isa, &a.w, &inputs[input_of[2 * i]], first, len, out);
        let mut second = vec![0f32; len];
        block(
            isa,
            &b.w,
            &inputs[input_of[2 * i + 1]],
            first,
            len,
            &mut second,
        );
        combine(i, first, out, &second);
    });
    outs
}

/// The tasks `(item, first row, rows)` of items given as `(item, rows,
/// multiply-adds a row)`: runs of rows of about `task_macs` each, whole
/// multiples of 4 rows (the kernels' tiles) but the last.
fn row_tasks(
    task_macs: usize,
    items: impl Iterator<Item = (usize, usize, usize)>,
) -> Vec<(usize, usize, usize)> {
    let mut tasks = Vec::new();
    for (i, rows, row_macs) in items {
        let per_task = task_macs.div_ceil(row_macs.max(1)).next_multiple_of(4);
        for first in (0..rows).step_by(per_task) {
            tasks.push((i, first, per_task.min(rows - first)));
        }
    }
    tasks
}

/// Multiply-adds a task of these products takes: enough to pay for a task
/// ([`min_task_macs`]), and about eight tasks a thread, so threads that
/// finish early take more.
fn task_macs(products: &[Product<'_>]) -> usize {
    let total: usize = products.iter().map(|p| p.w.rows() * p.w.cols() * p.n).sum();
    min_task_macs().max(total.div_ceil(8 * rayon::current_num_threads()))
}

/// The products' inputs laid out for their kernels, and each product's
/// index among them: the first product with the same input slice and
/// layout prepares it for all.
fn prepare_inputs<'a>(
    isa: Isa,
    on_pool: bool,
    products: &[Product<'a>],
) -> (Vec<Inputs<'a>>, Vec<usize>) {
    let mut firsts: Vec<usize> = Vec::new();
    let mut input_of = Vec::with_capacity(products.len());
    for (i, p) in products.iter().enumerate() {
        let same = |q: &Product<'_>| {
            std::ptr::eq(q.x, p.x) && q.n == p.n && Inputs::layout(q) == Inputs::layout(p)
        };
        match products[..i].iter().position(same) {
            Some(j) => input_of.push(input_of[j]),
            None => {
                input_of.push(firsts.len());
                firsts.push(i);
            }
        }
    }
    // Several inputs of many tokens (a prefill chunk's experts) are laid
    // out in parallel, one task each.
    let values: usize = firsts.iter().map(|&i| products[i].x.len()).sum();
    let inputs: Vec<Inputs<'_>> = if firsts.len() > 1 && values >= MIN_PARALLEL_INPUTS {
        let slots: Vec<OnceLock<Inputs<'_>>> = firsts.iter().map(|_| OnceLock::new()).collect();
        pool::run(on_pool, firsts.len(), |k| {
            let _ = slots[k].set(Inputs::new(isa, &products[firsts[k]]));
        });
        let prepared = slots.into_iter().map(OnceLock::into_inner);
        prepared.map(|i| i.expect("every input prepared")).collect()
    } else {
        firsts
            .iter()
            .map(|&i| Inputs::new(isa, &products[i]))
            .collect()
    };
    (inputs, input_of)
}

/// A product's `[n, rows]` result, whose tasks each write the columns of
/// their own rows from whichever thread runs them.
struct Columns {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: tasks write disjoint elements (see the methods), and the result
// outlives the parallel region.
unsafe impl Sync for Columns {}

impl Columns {
    fn new(out: &mut [f32]) -> Columns {
        Columns {
            ptr: out.as_mut_ptr(),
            len: out.len(),
        }
    }

    /// Rows `[first, first + len)` of a one-token result.
    ///
    /// # Safety
    /// No other task may touch these rows while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn rows(&self, first: usize, len: usize) -> &mut [f32] {
        assert!(first + len <= self.len);
        // SAFETY: in bounds (asserted); exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(first), len) }
    }

    /// Stores `by_row` (`[len, n]`) into columns `[first, first + len)` of
    /// every token's row.
    ///
    /// # Safety
    /// No other task may write these columns.
    unsafe fn scatter(&self, first: usize, len: usize, n: usize, by_row: &[f32]) {
        let rows = self.len / n;
        assert!(by_row.len() == len * n && first + len <= rows);
        for t in 0..n {
            // SAFETY: in bounds (asserted); exclusive by the caller's
            // contract.
            let out =
                unsafe { std::slice::from_raw_parts_mut(self.ptr.add(t * rows + first), len) };
            for (o, &v) in out.iter_mut().zip(by_row[t..].iter().step_by(n)) {
                *o = v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::quant::{GROUP_SIZE, MatrixLayout, RowEncoder};
    use crate::util::AlignedBuf;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::util::SplitMix64(seed);
        (0..n).map(|_| rng.next_unit() - 0.5).collect()
    }

    /// Every dtype, every available instruction set, awkward sizes: the
    /// product matches an f64 reference on the dequantized weights within
    /// f32 rounding.
    #[test]
    fn matmul_matches_reference_on_awkward_sizes() {
        let shapes = [
            (1, 1, 64),
            (2, 5, 128),
            (3, 7, 192),
            (7, 13, 64),
            (1, 37, 2048),
            (64, 9, 128),
            (5, 130, 192),
            (64, 66, 320),
        ];
        for isa in Isa::available() {
            for dtype in [
                DType::F32,
                DType::Bf16,
                DType::Q8,
                DType::Q4,
                DType::Q3,
                DType::Q2,
                DType::Mxfp4,
            ] {
                for &(n, rows, cols) in &shapes {
                    // Unquantized types also take widths of no whole group.
                    let cols = if dtype.is_quantized() { cols } else { cols + 3 };
                    check(isa, dtype, n, rows, cols);
                }
            }
        }
    }

    /// A matrix large enough to be split into tasks.
    #[test]
    fn matmul_splits_large_matrices_correctly() {
        for isa in Isa::available() {
            check(isa, DType::Q4, 1, 4100, 256);
            check(isa, DType::Q3, 2, 2050, 128);
            check(isa, DType::Mxfp4, 2, 2050, 128);
            check(isa, DType::Bf16, 3, 1030, 200);
        }
    }

    fn check(isa: Isa, dtype: DType, n: usize, rows: usize, cols: usize) {
        let w = values(rows * cols, (rows * cols) as u64);
        let mut x = values(n * cols, n as u64 + 7);
        // An outlier, as real activations have.
        x[cols / 3] = 9.0;
        let layout = MatrixLayout::new(dtype, rows, cols).unwrap();
        let bytes = AlignedBuf::from_slice(&RowEncoder::new(layout).encode_matrix(&w));
        let view = MatrixView::new(layout, &bytes);
        let got = matmul_with(isa, &x, n, &view, Activations::F32);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            view.dequantize_row(r, &mut row);
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                let want: f64 = row.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                let scale: f64 = row
                    .iter()
                    .zip(xt)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let tol = scale * 1e-6;
                let g = got[t * rows + r] as f64;
                assert!(
                    (g - want).abs() <= tol,
                    "{isa:?} {dtype:?} n={n} {rows}x{cols} [{t},{r}]: {g} vs {want} (tol {tol:.2e})"
                );
            }
        }
    }

    /// The int8 products on every instruction set and awkward sizes: each
    /// equals the definition of `simd::Int8Acts` (computed here in f64)
    /// within f32 rounding, and stays within that definition's error bound
    /// of the exact product, `Σ_g |s|·d/2·Σ |q - c|`.
    #[test]
    fn int8_products_match_their_definition_and_error_bound() {
        let shapes = [
            (1, 1, 64),
            (2, 5, 128),
            (3, 7, 192),
            (1, 37, 2048),
            (5, 130, 1088),
        ];
        for isa in Isa::available() {
            for dtype in [DType::Q8, DType::Q4, DType::Q3, DType::Q2] {
                for &(n, rows, cols) in &shapes {
                    check_int8(isa, dtype, n, rows, cols);
                }
            }
            check_int8(isa, DType::Q4, 1, 4100, 256);
        }
    }

    fn check_int8(isa: Isa, dtype: DType, n: usize, rows: usize, cols: usize) {
        let w = values(rows * cols, (rows * cols) as u64);
        let mut x = values(n * cols, n as u64 + 7);
        x[cols / 3] = 9.0;
        // A group of zeros (scale 0).
        x[..64].fill(0.0);
        let layout = MatrixLayout::new(dtype, rows, cols).unwrap();
        let bytes = AlignedBuf::from_slice(&RowEncoder::new(layout).encode_matrix(&w));
        let view = MatrixView::new(layout, &bytes);
        let got = matmul_with(isa, &x, n, &view, Activations::Int8);
        let groups = cols / GROUP_SIZE;
        let params = |offset: usize| -> &[bf16] {
            bytemuck::cast_slice(&bytes[offset..][..2 * rows * groups])
        };
        let (scales, biases) = (params(layout.scales_offset), params(layout.biases_offset));
        let mean = ((1u32 << dtype.bits().unwrap()) - 1) as f64 / 2.0;
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            view.dequantize_row(r, &mut row);
            for t in 0..n {
                let (mut exact, mut defined, mut bound, mut magnitude) = (0f64, 0f64, 0f64, 0f64);
                for g in 0..groups {
                    let xs = &x[t * cols + g * GROUP_SIZE..][..GROUP_SIZE];
                    let ws = &row[g * GROUP_SIZE..][..GROUP_SIZE];
                    let s = scales[r * groups + g].to_f32() as f64;
                    let centre = biases[r * groups + g].to_f32() as f64 + mean * s;
                    let max = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let inv = if max > 0.0 { 127.0 / max } else { 0.0 };
                    let d = (max / 127.0) as f64;
                    let sum: f64 = xs.iter().map(|&v| v as f64).sum();
                    defined += centre * sum;
                    magnitude += (centre * sum).abs();
                    for (&w, &v) in ws.iter().zip(xs) {
                        let code = (v * inv).round_ties_even() as f64;
                        exact += w as f64 * v as f64;
                        defined += (w as f64 - centre) * d * code;
                        magnitude += (w as f64 * v as f64).abs();
                        bound += (w as f64 - centre).abs() * d / 2.0;
                    }
                }
                let tol = magnitude * 1e-6;
                let g = got[t * rows + r] as f64;
                let at = format!("{isa:?} {dtype:?} n={n} {rows}x{cols} [{t},{r}]");
                assert!(
                    (g - defined).abs() <= tol,
                    "{at}: {g} vs {defined} (tol {tol:.2e})"
                );
                assert!(
                    (g - exact).abs() <= bound + tol,
                    "{at}: {g} vs exact {exact}"
                );
            }
        }
    }

    /// One token at a time gives exactly the same numbers as a batch, so
    /// prefill and decode agree bit for bit.
    #[test]
    fn batched_and_single_token_products_are_identical() {
        let (rows, cols, n) = (11, 192, 7);
        for isa in Isa::available() {
            for (dtype, activations) in [
                (DType::F32, Activations::F32),
                (DType::Bf16, Activations::F32),
                (DType::Q8, Activations::F32),
                (DType::Q4, Activations::F32),
                (DType::Q8, Activations::Int8),
                (DType::Q4, Activations::Int8),
                (DType::Q3, Activations::F32),
                (DType::Q2, Activations::F32),
                (DType::Q3, Activations::Int8),
                (DType::Q2, Activations::Int8),
                (DType::Mxfp4, Activations::F32),
                (DType::Mxfp4, Activations::Int8),
            ] {
                let w = values(rows * cols, 5);
                let x = values(n * cols, 6);
                let layout = MatrixLayout::new(dtype, rows, cols).unwrap();
                let bytes = AlignedBuf::from_slice(&RowEncoder::new(layout).encode_matrix(&w));
                let view = MatrixView::new(layout, &bytes);
                let batch = matmul_with(isa, &x, n, &view, activations);
                for t in 0..n {
                    let one = matmul_with(isa, &x[t * cols..(t + 1) * cols], 1, &view, activations);
                    assert_eq!(
                        one,
                        batch[t * rows..(t + 1) * rows],
                        "{isa:?} {dtype:?} {activations:?} token {t}"
                    );
                }
            }
        }
    }

    /// The paired products with their combination equal each product
    /// computed alone and combined afterwards, bit for bit, whichever
    /// threads take their tasks (a decode step's experts and the same
    /// experts in a prefill chunk).
    #[test]
    fn paired_products_equal_products_alone() {
        let (rows, cols, experts) = (1088, 256, 3);
        let matrix = |dtype, rows, cols, seed| {
            let layout = MatrixLayout::new(dtype, rows, cols).unwrap();
            let w = values(rows * cols, seed);
            (
                layout,
                AlignedBuf::from_slice(&RowEncoder::new(layout).encode_matrix(&w)),
            )
        };
        let combine = |a: &mut [f32], b: &[f32], k: usize, first: usize| {
            for (i, (a, b)) in a.iter_mut().zip(b).enumerate() {
                *a = *a * 0.5 + b * (k + first + i) as f32;
            }
        };
        for isa in Isa::available() {
            for (dtype, activations) in [
                (DType::Q4, Activations::Int8),
                (DType::Q4, Activations::F32),
                (DType::Q8, Activations::Int8),
                (DType::Bf16, Activations::F32),
            ] {
                let gate_up: Vec<_> = (0..2 * experts as u64)
                    .map(|seed| matrix(dtype, rows, cols, seed))
                    .collect();
                let x = values(cols, 9);
                fn one<'a>(
                    x: &'a [f32],
                    (layout, bytes): &'a (MatrixLayout, AlignedBuf),
                    activations: Activations,
                ) -> Product<'a> {
                    Product {
                        x,
                        n: 1,
                        w: MatrixView::new(*layout, bytes),
                        activations,
                    }
                }
                let mut alone: Vec<Vec<f32>> = Vec::new();
                for k in 0..experts {
                    let mut a =
                        matmul_many_with(isa, false, &[one(&x, &gate_up[2 * k], activations)]);
                    let b =
                        matmul_many_with(isa, false, &[one(&x, &gate_up[2 * k + 1], activations)]);
                    combine(&mut a[0], &b[0], k, 0);
                    alone.push(a.pop().unwrap());
                }
                for threads in [1, 3] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    pool.install(|| {
                        let pairs: Vec<[Product<'_>; 2]> = (0..experts)
                            .map(|k| {
                                [
                                    one(&x, &gate_up[2 * k], activations),
                                    one(&x, &gate_up[2 * k + 1], activations),
                                ]
                            })
                            .collect();
                        let act = matmul_pairs_with(isa, true, &pairs, |k, first, a, b| {
                            combine(a, b, k, first)
                        });
                        let at = format!("{isa:?} {dtype:?} {activations:?} {threads} threads");
                        assert_eq!(act, alone, "pairs: {at}");
                    });
                }
            }
        }
    }

    /// MXFP4's codes are not affine, so its products take f32 activations
    /// even when int8 ones are asked: the same numbers either way.
    #[test]
    fn mxfp4_products_ignore_int8_activations() {
        let (rows, cols, n) = (9, 128, 3);
        let layout = MatrixLayout::new(DType::Mxfp4, rows, cols).unwrap();
        let bytes =
            AlignedBuf::from_slice(&RowEncoder::new(layout).encode_matrix(&values(rows * cols, 3)));
        let view = MatrixView::new(layout, &bytes);
        let x = values(n * cols, 4);
        for isa in Isa::available() {
            assert_eq!(
                matmul_with(isa, &x, n, &view, Activations::Int8),
                matmul_with(isa, &x, n, &view, Activations::F32),
                "{isa:?}"
            );
        }
    }
}
