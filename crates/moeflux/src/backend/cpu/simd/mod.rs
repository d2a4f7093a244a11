//! SIMD kernels behind one runtime dispatch: AVX-512 or AVX2+FMA on
//! x86-64, NEON on aarch64, portable scalar code elsewhere. The best
//! instruction set is detected once; tests force each available one.
//!
//! Products with quantized rows dequantize each weight exactly as
//! [`crate::quant`] defines it (`q·scale + bias`, where `q·scale` is exact
//! so one FMA rounds like the reference's multiply then add) and
//! accumulate `w·x` in f32. Integer dot products on int8 or int16
//! activations would be faster but are not accurate enough: the fixture
//! models amplify activation rounding about a hundredfold (int8 gives 1e-1
//! relative error on the logits, int16 1e-3, against 1e-6 for f32).
//!
//! Each (row, token) pair of a tile gets the same operations in the same
//! order whatever the tile's shape, so a matrix-vector product equals the
//! matching row of a many-token product bit for bit: prefill and decode
//! agree exactly.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;

use std::borrow::Cow;
use std::sync::OnceLock;

use half::bf16;

use crate::quant::GROUP_SIZE;

/// An instruction set the kernels are written for. Values come only from
/// [`Isa::get`] and [`Isa::available`], which check the CPU: the kernels'
/// safety rests on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl Isa {
    /// The fastest available set, detected once. `MOEFLUX_CPU_KERNELS`
    /// (`scalar`, `avx2`, `avx512`, `neon`) picks a slower one, to compare
    /// or rule kernels out; an unavailable choice is ignored.
    pub fn get() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let available = Isa::available();
            std::env::var("MOEFLUX_CPU_KERNELS")
                .ok()
                .and_then(|name| available.iter().copied().find(|i| i.name() == name))
                .unwrap_or(available[0])
        })
    }

    /// Every set this machine runs, fastest first.
    pub fn available() -> Vec<Isa> {
        let mut all = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("fma")
            {
                all.push(Isa::Avx512);
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                all.push(Isa::Avx2);
            }
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            all.push(Isa::Neon);
        }
        all.push(Isa::Scalar);
        all
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => "avx512",
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => "neon",
        }
    }

    /// Code bytes one unpacking step of 4-bit codes covers: within each run
    /// of that many bytes, the low nibbles (even weights) come out first,
    /// then the high nibbles, and [`Acts`] orders the inputs to match.
    fn q4_run(self) -> usize {
        match self {
            // One byte: [low, high], i.e. the stored order.
            Isa::Scalar => 1,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => 8,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => 16,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => 8,
        }
    }

    /// `out[r·n + t] = Σ_c w[r, c] · x[t, c]` for every row of `w` and
    /// token of `x` (`out` is row-major by weight row).
    pub fn quant_rows(self, w: &QuantRows<'_>, x: &Acts<'_>, out: &mut [f32]) {
        assert_eq!(
            x.run,
            self.q4_run_for(w.bits),
            "inputs laid out for another ISA"
        );
        assert!(out.len() >= w.rows * x.n);
        w.check(x.cols);
        match self {
            Isa::Scalar => scalar::quant_rows(w, x, out),
            // SAFETY (all arms): `available()` detected the features, and
            // `check` verified the buffers the kernels index.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::quant_rows(w, x, out) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::quant_rows(w, x, out) },
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::quant_rows(w, x, out) },
        }
    }

    /// As [`Isa::quant_rows`] for f32 or bf16 rows.
    pub fn float_rows(self, w: &FloatRows<'_>, x: &Acts<'_>, out: &mut [f32]) {
        let n = x.n;
        assert!(x.cols == w.cols && out.len() >= w.rows * n);
        assert!(w.data.len() >= w.rows * w.cols * if w.bf16 { 2 } else { 4 });
        match self {
            Isa::Scalar => scalar::float_rows(w, x, out),
            // SAFETY (all arms): as in `quant_rows`, bounds checked above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::float_rows(w, x, out) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::float_rows(w, x, out) },
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::float_rows(w, x, out) },
        }
    }

    fn q4_run_for(self, bits: u32) -> usize {
        if bits == 4 { self.q4_run() } else { 1 }
    }

    /// Runs `f` compiled for this instruction set: plain loops in `f`
    /// (element-wise updates, [`dot`]) vectorise to its full width and give
    /// the same results as scalar code, having no reassociation to exploit.
    #[inline(always)]
    pub fn vectorize<R>(self, f: impl FnOnce() -> R) -> R {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the features were detected.
            Isa::Avx512 => unsafe { avx512::vectorize(f) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the features were detected.
            Isa::Avx2 => unsafe { avx2::vectorize(f) },
            _ => f(),
        }
    }
}

/// Rows of a q4 or q8 matrix (see [`crate::quant`]), starting at the first
/// row of the block.
pub struct QuantRows<'a> {
    pub bits: u32,
    pub rows: usize,
    pub codes: &'a [u8],
    pub row_bytes: usize,
    pub scales: &'a [bf16],
    pub biases: &'a [bf16],
}

impl QuantRows<'_> {
    fn check(&self, cols: usize) {
        let groups = cols / GROUP_SIZE;
        assert!(self.bits == 4 || self.bits == 8);
        assert_eq!(self.row_bytes, cols * self.bits as usize / 8);
        assert!(self.codes.len() >= self.rows * self.row_bytes);
        assert!(self.scales.len() >= self.rows * groups && self.biases.len() >= self.rows * groups);
    }
}

/// Rows of an f32 or bf16 matrix, `rows × cols` values from the first row
/// of the block.
pub struct FloatRows<'a> {
    pub bf16: bool,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl FloatRows<'_> {
    /// Value `at` (row-major index), for the scalar kernels and row tails.
    #[inline(always)]
    fn value(&self, at: usize) -> f32 {
        if self.bf16 {
            let b = &self.data[2 * at..];
            f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
        } else {
            let b = &self.data[4 * at..];
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }
    }
}

/// Tokens (`[n, cols]`) laid out for one instruction set's kernels: for
/// 4-bit rows, each run of inputs that one unpacking step covers is
/// reordered to [evens, odds] (see [`Isa::q4_run`]).
pub struct Acts<'a> {
    pub n: usize,
    pub cols: usize,
    pub x: Cow<'a, [f32]>,
    run: usize,
}

impl<'a> Acts<'a> {
    /// For rows of `bits` bits (`None`: f32 or bf16) and `isa`'s kernels.
    pub fn new(isa: Isa, x: &'a [f32], n: usize, cols: usize, bits: Option<u32>) -> Acts<'a> {
        assert!(x.len() >= n * cols);
        let run = bits.map_or(1, |b| isa.q4_run_for(b));
        let x = &x[..n * cols];
        let x = if run == 1 {
            Cow::Borrowed(x)
        } else {
            let mut out = vec![0f32; x.len()];
            for (src, dst) in x.chunks_exact(2 * run).zip(out.chunks_exact_mut(2 * run)) {
                let (evens, odds) = dst.split_at_mut(run);
                for (j, pair) in src.chunks_exact(2).enumerate() {
                    evens[j] = pair[0];
                    odds[j] = pair[1];
                }
            }
            Cow::Owned(out)
        };
        Acts { n, cols, x, run }
    }
}

/// Lanes of [`dot`]'s partial sums: a whole AVX-512 register, two AVX2
/// ones, four NEON ones.
const DOT_LANES: usize = 16;

/// f32 dot product with [`DOT_LANES`] partial sums added in a fixed order,
/// so any vector width gives the same result.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let len = a.len().min(b.len());
    let (a, b) = (&a[..len], &b[..len]);
    let mut acc = [0f32; DOT_LANES];
    let whole = len / DOT_LANES * DOT_LANES;
    for (ca, cb) in a[..whole]
        .chunks_exact(DOT_LANES)
        .zip(b[..whole].chunks_exact(DOT_LANES))
    {
        for i in 0..DOT_LANES {
            acc[i] += ca[i] * cb[i];
        }
    }
    let mut sum = reduce_lanes(acc);
    for (x, y) in a[whole..].iter().zip(&b[whole..]) {
        sum += x * y;
    }
    sum
}

/// Pairwise sum of the lanes, the shape of a vector register reduction.
#[inline(always)]
fn reduce_lanes(mut acc: [f32; DOT_LANES]) -> f32 {
    let mut width = DOT_LANES / 2;
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
fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

/// The tile kernels of one instruction set. A tile is `R` weight rows ×
/// `T` tokens; every (row, token) pair gets the same operations in the same
/// order whatever the tile's shape, so results do not depend on tiling.
trait Kernels {
    /// Rows `rows` against tokens `t0..t0 + T`; `scales` and `biases` are
    /// the tile rows' group parameters, `[R, groups]`. Safety: the caller
    /// checked the buffers and the features.
    unsafe fn quant_tile<const BITS: u32, const R: usize, const T: usize>(
        w: &QuantRows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
        scales: &[f32],
        biases: &[f32],
    ) -> [[f32; T]; R];

    /// Rows `rows` against tokens `t0..t0 + T`.
    unsafe fn float_tile<const BF16: bool, const R: usize, const T: usize>(
        w: &FloatRows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
    ) -> [[f32; T]; R];
}

/// Calls `$body` with `const $r` and `const $t` bound to `$rows` (4, 2 or
/// 1) and `$tokens` (1 to 4): kernels are instantiated per tile shape.
macro_rules! with_tile {
    ($rows:expr, $tokens:expr, |$r:ident, $t:ident| $body:expr) => {
        match ($rows, $tokens) {
            (4, 4) => {
                const $r: usize = 4;
                const $t: usize = 4;
                $body
            }
            (4, 3) => {
                const $r: usize = 4;
                const $t: usize = 3;
                $body
            }
            (4, 2) => {
                const $r: usize = 4;
                const $t: usize = 2;
                $body
            }
            (4, 1) => {
                const $r: usize = 4;
                const $t: usize = 1;
                $body
            }
            (2, 4) => {
                const $r: usize = 2;
                const $t: usize = 4;
                $body
            }
            (2, 3) => {
                const $r: usize = 2;
                const $t: usize = 3;
                $body
            }
            (2, 2) => {
                const $r: usize = 2;
                const $t: usize = 2;
                $body
            }
            (2, 1) => {
                const $r: usize = 2;
                const $t: usize = 1;
                $body
            }
            (1, 4) => {
                const $r: usize = 1;
                const $t: usize = 4;
                $body
            }
            (1, 3) => {
                const $r: usize = 1;
                const $t: usize = 3;
                $body
            }
            (1, 2) => {
                const $r: usize = 1;
                const $t: usize = 2;
                $body
            }
            (1, 1) => {
                const $r: usize = 1;
                const $t: usize = 1;
                $body
            }
            other => unreachable!("tile {other:?}"),
        }
    };
}

/// The tiles of a block of `rows` rows: `max_rows` rows at a time taken
/// from `max_rows` equal stretches of the block (so each tile row reads
/// one long sequential stream, which hardware prefetchers follow, rather
/// than many short interleaved ones), then the rows left over one by one.
/// Returns tile `i`'s rows (the first `count` entries) and `count`.
/// (Plain loops over this, not closures: a closure in the generic drivers
/// would compile without the instruction set's features.)
#[inline(always)]
fn tile(i: usize, rows: usize, max_rows: usize) -> ([usize; 4], usize) {
    let stretch = rows / max_rows;
    if i < stretch {
        let mut tile = [0; 4];
        for (k, r) in tile.iter_mut().enumerate().take(max_rows) {
            *r = i + k * stretch;
        }
        (tile, max_rows)
    } else {
        ([max_rows * stretch + i - stretch, 0, 0, 0], 1)
    }
}

/// Number of tiles [`tile`] splits `rows` rows into.
#[inline(always)]
fn tile_count(rows: usize, max_rows: usize) -> usize {
    let stretch = rows / max_rows;
    stretch + rows - max_rows * stretch
}

/// Walks `w` in tiles of at most `max_rows` × `max_tokens`: each tile of
/// rows is read once for all tokens. Inlined into each instruction set's
/// entry point so the tiles compile with its features.
#[inline(always)]
unsafe fn quant_rows_with<K: Kernels>(
    w: &QuantRows<'_>,
    x: &Acts<'_>,
    out: &mut [f32],
    max_rows: usize,
    max_tokens: usize,
) {
    let (n, g) = (x.n, x.cols / GROUP_SIZE);
    let mut scales = vec![0f32; max_rows * g];
    let mut biases = vec![0f32; max_rows * g];
    for i in 0..tile_count(w.rows, max_rows) {
        let (tile, rows) = tile(i, w.rows, max_rows);
        for (i, &r) in tile[..rows].iter().enumerate() {
            widen_bf16(&w.scales[r * g..(r + 1) * g], &mut scales[i * g..]);
            widen_bf16(&w.biases[r * g..(r + 1) * g], &mut biases[i * g..]);
        }
        let mut t0 = 0;
        while t0 < n {
            let tokens = max_tokens.min(n - t0);
            with_tile!(rows, tokens, |R, T| {
                let mut rows_of = [0; R];
                rows_of.copy_from_slice(&tile[..R]);
                let tile = rows_of;
                // SAFETY: forwarded from the caller.
                let acc = unsafe {
                    if w.bits == 4 {
                        K::quant_tile::<4, R, T>(w, tile, x, t0, &scales, &biases)
                    } else {
                        K::quant_tile::<8, R, T>(w, tile, x, t0, &scales, &biases)
                    }
                };
                for (&r, acc) in tile.iter().zip(&acc) {
                    out[r * n + t0..][..T].copy_from_slice(acc);
                }
            });
            t0 += tokens;
        }
    }
}

/// [`quant_rows_with`] for f32 and bf16 rows.
#[inline(always)]
unsafe fn float_rows_with<K: Kernels>(
    w: &FloatRows<'_>,
    x: &Acts<'_>,
    out: &mut [f32],
    max_rows: usize,
    max_tokens: usize,
) {
    let n = x.n;
    for i in 0..tile_count(w.rows, max_rows) {
        let (tile, rows) = tile(i, w.rows, max_rows);
        let mut t0 = 0;
        while t0 < n {
            let tokens = max_tokens.min(n - t0);
            with_tile!(rows, tokens, |R, T| {
                let mut rows_of = [0; R];
                rows_of.copy_from_slice(&tile[..R]);
                let tile = rows_of;
                // SAFETY: forwarded from the caller.
                let acc = unsafe {
                    if w.bf16 {
                        K::float_tile::<true, R, T>(w, tile, x, t0)
                    } else {
                        K::float_tile::<false, R, T>(w, tile, x, t0)
                    }
                };
                for (&r, acc) in tile.iter().zip(&acc) {
                    out[r * n + t0..][..T].copy_from_slice(acc);
                }
            });
            t0 += tokens;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dot` has one summation order: vectorised for any instruction set
    /// it gives the scalar result bit for bit (what keeps attention and
    /// Gated DeltaNet identical across machines).
    #[test]
    fn dot_is_identical_on_every_isa() {
        for len in [0, 1, 15, 16, 17, 64, 100, 1000] {
            let a: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let b: Vec<f32> = (0..len)
                .map(|i| ((i * 53 % 89) as f32 - 44.0) / 3.0)
                .collect();
            let plain = dot(&a, &b);
            let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            let scale: f64 = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| (x as f64 * y as f64).abs())
                .sum();
            assert!((plain as f64 - exact).abs() <= scale * 1e-6, "len {len}");
            for isa in Isa::available() {
                let got = isa.vectorize(|| dot(&a, &b));
                assert_eq!(got.to_bits(), plain.to_bits(), "{isa:?} len {len}");
            }
        }
    }

    #[test]
    fn tiles_cover_every_row_once() {
        for rows in 0..40 {
            for max_rows in [1, 2, 4] {
                let mut seen = vec![0; rows];
                for i in 0..tile_count(rows, max_rows) {
                    let (tile, count) = tile(i, rows, max_rows);
                    tile[..count].iter().for_each(|&r| seen[r] += 1);
                }
                assert!(seen.iter().all(|&s| s == 1), "{rows} rows by {max_rows}");
            }
        }
    }

    #[test]
    fn four_bit_inputs_are_reordered_per_run() {
        let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
        for isa in Isa::available() {
            let run = isa.q4_run();
            let acts = Acts::new(isa, &x, 1, 64, Some(4));
            for (i, chunk) in acts.x.chunks(2 * run).enumerate() {
                let first = (2 * run * i) as f32;
                let evens: Vec<f32> = (0..run).map(|j| first + 2.0 * j as f32).collect();
                let odds: Vec<f32> = evens.iter().map(|v| v + 1.0).collect();
                assert_eq!(chunk, [evens, odds].concat(), "{isa:?}");
            }
            assert_eq!(*Acts::new(isa, &x, 1, 64, Some(8)).x, x[..]);
        }
    }
}
