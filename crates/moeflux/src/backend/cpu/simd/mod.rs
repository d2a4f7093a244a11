//! SIMD kernels behind one runtime dispatch: AVX-512 or AVX2+FMA on
//! x86-64, NEON on aarch64, portable scalar code elsewhere. The best
//! instruction set is detected once; tests force each available one.
//!
//! Products with quantized rows dequantize each weight exactly as
//! [`crate::quant`] defines it (`q·scale + bias`, where `q·scale` is exact
//! so one FMA rounds like the reference's multiply then add) and
//! accumulate `w·x` in f32: the default, exact to f32 rounding. q2 and
//! q3 rows unpack 16 consecutive columns per shift of their bit planes
//! (see [`crate::quant::lowbit`]), so their inputs keep their order.
//!
//! The int8 kernels ([`Isa::int8_rows`]) instead quantize each token's
//! activations to int8 per weight group ([`Int8Acts`]) and take integer
//! dot products of codes and activations, much cheaper per weight
//! (`vpdpbusd` multiplies and adds 64 byte pairs). They are opt-in: the
//! rounding of the activations moves the fixture models' logits by about
//! 1e-2 relative to transformers (1e-1 at the odd position where it flips
//! an expert choice), against 1e-6 for f32, beyond the default's
//! tolerances; on a trained model it costs next to nothing in perplexity
//! (docs/PERFORMANCE.md).
//!
//! Each (row, token) pair of a tile gets the same operations in the same
//! order whatever the tile's shape, so a matrix-vector product equals the
//! matching row of a many-token product bit for bit: prefill and decode
//! agree exactly.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod int8;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;
mod vector;

pub use int8::Int8Acts;
use int8::mean_code;
use vector::widen_bf16;
pub use vector::{dot, exp, exp_sum, max};

use std::borrow::Cow;
use std::sync::OnceLock;

use half::bf16;

use crate::quant::GROUP_SIZE;
use crate::quant::mxfp4::BLOCK;

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
            crate::tuning::cpu_kernels()
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

    /// As [`Isa::quant_rows`] for MXFP4 rows (inputs laid out as for 4-bit
    /// rows: the codes are packed alike).
    pub fn mxfp4_rows(self, w: &Mxfp4Rows<'_>, x: &Acts<'_>, out: &mut [f32]) {
        assert_eq!(x.run, self.q4_run(), "inputs laid out for another ISA");
        assert!(out.len() >= w.rows * x.n);
        w.check(x.cols);
        match self {
            Isa::Scalar => scalar::mxfp4_rows(w, x, out),
            // SAFETY (all arms): as in `quant_rows`, bounds checked above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::mxfp4_rows(w, x, out) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::mxfp4_rows(w, x, out) },
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::mxfp4_rows(w, x, out) },
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

    /// `[dot(a, b) for b in bs]` (each as long as `a`), bit for bit: on
    /// AVX-512 the eight products' lanes are reduced together, a level of
    /// [`dot`]'s tree at a time across all of them.
    #[inline(always)]
    pub fn dots8(self, a: &[f32], bs: [&[f32]; 8]) -> [f32; 8] {
        assert!(
            bs.iter().all(|b| b.len() == a.len()),
            "dots8: lengths differ"
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the features were detected.
            Isa::Avx512 => unsafe { avx512::dots8(a, bs) },
            _ => bs.map(|b| dot(a, b)),
        }
    }

    /// `out[r·n + t] ≈ Σ_c w[r, c] · x[t, c]` as [`Isa::quant_rows`], from
    /// activations quantized to int8.
    pub fn int8_rows(self, w: &QuantRows<'_>, x: &Int8Acts, out: &mut [f32]) {
        assert_eq!(x.bits, w.bits, "inputs laid out for other rows");
        assert_eq!(
            x.kernels,
            self.int8_kernels(),
            "inputs laid out for another ISA"
        );
        assert!(out.len() >= w.rows * x.n);
        w.check(x.cols);
        match x.kernels {
            Int8Kernels::Scalar => scalar::int8_rows(w, x, out),
            // SAFETY (both arms): `int8_kernels` detected the features, and
            // `check` verified the buffers the kernels index.
            #[cfg(target_arch = "x86_64")]
            Int8Kernels::Avx2 => unsafe { avx2::int8_rows(w, x, out) },
            #[cfg(target_arch = "x86_64")]
            Int8Kernels::Avx512Vnni => unsafe { avx512::int8_rows(w, x, out) },
        }
    }

    /// The int8 kernels this set runs: AVX-512's need VNNI (AVX2's serve
    /// AVX-512 machines without it); NEON has none yet and runs the
    /// portable ones.
    fn int8_kernels(self) -> Int8Kernels {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if is_x86_feature_detected!("avx512vnni") => Int8Kernels::Avx512Vnni,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx2 => Int8Kernels::Avx2,
            _ => Int8Kernels::Scalar,
        }
    }

    fn q4_run_for(self, bits: u32) -> usize {
        if bits == 4 { self.q4_run() } else { 1 }
    }

    /// Runs `f` compiled for this instruction set: plain loops in `f`
    /// (element-wise updates, [`dot`]) vectorise to its full width and give
    /// the same results as scalar code, having no reassociation to exploit.
    /// `f` must be an `#[inline(always)]` closure (calling `#[inline(always)]`
    /// functions): only code inlined into the entry point gets its
    /// features, and the inliner declines large closures otherwise, which
    /// then run as baseline x86-64 code.
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

/// Rows of a q2, q3, q4 or q8 matrix (see [`crate::quant`]), starting at
/// the first row of the block.
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
        assert!(matches!(self.bits, 2 | 3 | 4 | 8));
        assert_eq!(self.row_bytes, cols * self.bits as usize / 8);
        assert!(self.codes.len() >= self.rows * self.row_bytes);
        assert!(self.scales.len() >= self.rows * groups && self.biases.len() >= self.rows * groups);
    }
}

/// Rows of an MXFP4 matrix (see [`crate::quant::mxfp4`]), starting at the
/// first row of the block.
pub struct Mxfp4Rows<'a> {
    pub rows: usize,
    pub codes: &'a [u8],
    pub row_bytes: usize,
    /// `cols / 32` exponent bytes per row.
    pub exponents: &'a [u8],
}

impl Mxfp4Rows<'_> {
    fn check(&self, cols: usize) {
        assert!(cols.is_multiple_of(GROUP_SIZE));
        assert_eq!(self.row_bytes, cols / 2);
        assert!(self.codes.len() >= self.rows * self.row_bytes);
        assert!(self.exponents.len() >= self.rows * cols / BLOCK);
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

/// The int8 kernel families (see [`Isa::int8_kernels`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Int8Kernels {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

impl Int8Kernels {
    /// What the kernels subtract from each 8-bit code before multiplying:
    /// AVX2's `vpmaddubsw` would saturate on unsigned codes up to 255, so
    /// those kernels use `q - 128` (a signed byte).
    fn q8_offset(self) -> i32 {
        match self {
            #[cfg(target_arch = "x86_64")]
            Int8Kernels::Avx2 => 128,
            _ => 0,
        }
    }

    /// Whether these kernels take many tokens' 4-bit inputs interleaved
    /// (see [`Int8Acts`]).
    fn interleaves(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self == Int8Kernels::Avx512Vnni {
            return true;
        }
        false
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

    /// MXFP4 rows `rows` against tokens `t0..t0 + T`: each block of 32
    /// through its values, `E2M1` times the block's power of two (one
    /// multiply a block, in registers).
    unsafe fn mxfp4_tile<const R: usize, const T: usize>(
        w: &Mxfp4Rows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
    ) -> [[f32; T]; R];

    /// Rows `rows` against tokens `t0..t0 + T`.
    unsafe fn float_tile<const BF16: bool, const R: usize, const T: usize>(
        w: &FloatRows<'_>,
        rows: [usize; R],
        x: &Acts<'_>,
        t0: usize,
    ) -> [[f32; T]; R];
}

/// The group parameters of one tile of the int8 kernels: per row
/// (`[R, stride]`, zero-padded like [`Int8Acts`]'s arrays) its scales `s`
/// and its biases shifted by the mean code, `b + c·s`; per (row, token)
/// pair (`[R·T, stride]`, row-major by pair, zero-padded) the products
/// `s·d` of each group that the integer sums are scaled by: one plain
/// vector loop fills them, and the kernels take a vector of them at once.
struct Int8Params<'a> {
    scales: &'a [f32],
    biases: &'a [f32],
    products: &'a [f32],
}

/// The int8 tile kernels of an instruction set whose group parameters
/// [`int8_rows_with`] prepares in memory per tile (AVX2, scalar; the
/// AVX-512 kernels widen them in registers and have their own driver).
trait Int8Kernel {
    /// Rows `rows` against tokens `t0..t0 + T`: each (row, token) pair sums
    /// `products·Σ (q - o)·x̂` over the groups, then `biases·Σ x` and
    /// `scales·offsets` in blocks of [`int8::GROUP_LANES`] groups. Safety: the
    /// caller checked the buffers and the features.
    unsafe fn int8_tile<const BITS: u32, const R: usize, const T: usize>(
        w: &QuantRows<'_>,
        rows: [usize; R],
        x: &Int8Acts,
        t0: usize,
        params: &Int8Params<'_>,
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
// By path, for the AVX-512 int8 driver (declared above the macro).
#[cfg(target_arch = "x86_64")]
use with_tile;

/// Calls `$body` with `const $b` bound to the code width `$bits` (2, 3, 4
/// or 8, as [`QuantRows::check`] allows): kernels are instantiated per
/// width.
macro_rules! with_bits {
    ($bits:expr, |$b:ident| $body:expr) => {
        match $bits {
            2 => {
                const $b: u32 = 2;
                $body
            }
            3 => {
                const $b: u32 = 3;
                $body
            }
            4 => {
                const $b: u32 = 4;
                $body
            }
            8 => {
                const $b: u32 = 8;
                $body
            }
            other => unreachable!("{other}-bit codes"),
        }
    };
}
#[cfg(target_arch = "x86_64")]
use with_bits;

/// Walks the tokens of one tile of rows (`$tile`, its first `$rows`
/// entries) in tiles of at most `$max_tokens`: `$kernel`, an expression of
/// `const $r`, `const $t`, the first token `$t0` and the tile's rows as an
/// array `$tile_rows`, gives each tile's `[[f32; T]; R]`, stored into
/// `$out` (row-major by weight row, `$n` tokens).
macro_rules! tile_tokens {
    ($n:expr, $max_tokens:expr, $tile:expr, $rows:expr, $out:expr,
        |$r:ident, $t:ident, $t0:ident, $tile_rows:ident| $kernel:expr) => {{
        let n = $n;
        let mut $t0 = 0;
        while $t0 < n {
            let tokens = $max_tokens.min(n - $t0);
            with_tile!($rows, tokens, |$r, $t| {
                let mut rows_of = [0; $r];
                rows_of.copy_from_slice(&$tile[..$r]);
                let $tile_rows = rows_of;
                let acc = $kernel;
                for (&r, acc) in $tile_rows.iter().zip(&acc) {
                    $out[r * n + $t0..][..$t].copy_from_slice(acc);
                }
            });
            $t0 += tokens;
        }
    }};
}
#[cfg(target_arch = "x86_64")]
use tile_tokens;

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

/// Rows ahead of the current tile's whose group parameters the quantized
/// drivers prefetch: the scales and biases are two more streams per tile
/// row, which the hardware prefetchers follow less well than the codes
/// (the kernels prefetch the codes themselves).
const PARAMS_AHEAD: usize = 8;

/// Asks for the cache line at `p` (a hint: never faults).
#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch does not access memory architecturally.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Prefetches the group parameters of the rows of the first
/// [`PARAMS_AHEAD`] tiles, which the tile loop's look-ahead does not reach
/// (int8 drivers only: in the f32 ones, whose kernels are bound by compute
/// rather than memory, it measured no faster).
#[inline(always)]
fn prefetch_first_params(w: &QuantRows<'_>, groups: usize, max_rows: usize) {
    for i in 0..tile_count(w.rows, max_rows).min(PARAMS_AHEAD) {
        let (tile, rows) = tile(i, w.rows, max_rows);
        for &r in &tile[..rows] {
            prefetch(w.scales.as_ptr().wrapping_add(r * groups));
            prefetch(w.biases.as_ptr().wrapping_add(r * groups));
        }
    }
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
            let ahead = (r + PARAMS_AHEAD) * g;
            prefetch(w.scales.as_ptr().wrapping_add(ahead));
            prefetch(w.biases.as_ptr().wrapping_add(ahead));
            widen_bf16(&w.scales[r * g..(r + 1) * g], &mut scales[i * g..]);
            widen_bf16(&w.biases[r * g..(r + 1) * g], &mut biases[i * g..]);
        }
        tile_tokens!(n, max_tokens, tile, rows, out, |R, T, t0, tile| {
            // SAFETY: forwarded from the caller.
            with_bits!(w.bits, |B| unsafe {
                K::quant_tile::<B, R, T>(w, tile, x, t0, &scales, &biases)
            })
        });
    }
}

/// [`quant_rows_with`] for MXFP4 rows.
#[inline(always)]
unsafe fn mxfp4_rows_with<K: Kernels>(
    w: &Mxfp4Rows<'_>,
    x: &Acts<'_>,
    out: &mut [f32],
    max_rows: usize,
    max_tokens: usize,
) {
    for i in 0..tile_count(w.rows, max_rows) {
        let (tile, rows) = tile(i, w.rows, max_rows);
        tile_tokens!(x.n, max_tokens, tile, rows, out, |R, T, t0, tile| {
            // SAFETY: forwarded from the caller.
            unsafe { K::mxfp4_tile::<R, T>(w, tile, x, t0) }
        });
    }
}

/// [`quant_rows_with`] for the int8 kernels.
#[inline(always)]
unsafe fn int8_rows_with<K: Int8Kernel>(
    w: &QuantRows<'_>,
    x: &Int8Acts,
    out: &mut [f32],
    max_rows: usize,
    max_tokens: usize,
) {
    let (n, g, stride) = (x.n, x.cols / GROUP_SIZE, x.stride);
    let mean = mean_code(w.bits);
    let mut scales = vec![0f32; max_rows * stride];
    let mut biases = vec![0f32; max_rows * stride];
    let mut products = vec![0f32; max_rows * max_tokens * stride];
    prefetch_first_params(w, g, max_rows);
    for i in 0..tile_count(w.rows, max_rows) {
        let (tile, rows) = tile(i, w.rows, max_rows);
        for (i, &r) in tile[..rows].iter().enumerate() {
            let ahead = (r + PARAMS_AHEAD) * g;
            prefetch(w.scales.as_ptr().wrapping_add(ahead));
            prefetch(w.biases.as_ptr().wrapping_add(ahead));
            let (s, b) = (
                &mut scales[i * stride..][..g],
                &mut biases[i * stride..][..g],
            );
            widen_bf16(&w.scales[r * g..(r + 1) * g], s);
            widen_bf16(&w.biases[r * g..(r + 1) * g], b);
            for (b, &s) in b.iter_mut().zip(s.iter()) {
                *b += mean * s;
            }
        }
        tile_tokens!(n, max_tokens, tile, rows, out, |R, T, t0, tile| {
            for (i, p) in products.chunks_exact_mut(T * stride).take(R).enumerate() {
                let s = &scales[i * stride..][..stride];
                for (t, p) in p.chunks_exact_mut(stride).enumerate() {
                    let d = &x.scales[(t0 + t) * stride..][..stride];
                    for ((p, &s), &d) in p.iter_mut().zip(s).zip(d) {
                        *p = s * d;
                    }
                }
            }
            let params = Int8Params {
                scales: &scales,
                biases: &biases,
                products: &products,
            };
            // SAFETY: forwarded from the caller.
            with_bits!(w.bits, |B| unsafe {
                K::int8_tile::<B, R, T>(w, tile, x, t0, &params)
            })
        });
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
        tile_tokens!(n, max_tokens, tile, rows, out, |R, T, t0, tile| {
            // SAFETY: forwarded from the caller.
            unsafe {
                if w.bf16 {
                    K::float_tile::<true, R, T>(w, tile, x, t0)
                } else {
                    K::float_tile::<false, R, T>(w, tile, x, t0)
                }
            }
        });
    }
}

#[cfg(test)]
mod tests;
