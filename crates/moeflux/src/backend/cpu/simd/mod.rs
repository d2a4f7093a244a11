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
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;

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

/// Per-token and per-row arrays over a row's groups are padded with zeros
/// to a multiple of this many, so the kernels read them in whole vectors.
const GROUP_LANES: usize = 16;

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
    bits: u32,
    kernels: Int8Kernels,
    /// Laid out per block of groups, as above.
    interleaved: bool,
    codes: Vec<i8>,
    /// Per token, `stride` values each: `d` of each group,
    scales: Vec<f32>,
    /// `Σ x`,
    sums: Vec<f32>,
    /// and `-(c - o)·d·Σ x̂`.
    offsets: Vec<f32>,
    /// Groups per token, padded to [`GROUP_LANES`].
    stride: usize,
}

/// The middle of the code range of `bits`-bit weights: the `c` of
/// [`Int8Acts`].
fn mean_code(bits: u32) -> f32 {
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
const fn q4_lane(g: usize) -> usize {
    (g & 8) | ((g & 1) << 2) | ((g & 7) >> 1)
}

/// Rewrites one token's 4-bit codes, laid out [evens, odds] per group in
/// its first `cols` bytes, into the interleaved layout of [`Int8Acts`]
/// over the whole of `token` (every block of [`GROUP_LANES`] groups, the
/// padding zero).
fn interleave_groups(token: &mut [i8]) {
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

/// Sum in [`DOT_LANES`] partial sums, a fixed order that vectorises.
#[inline(always)]
fn sum(x: &[f32]) -> f32 {
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
const DOT_LANES: usize = 16;

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
fn reduce_lanes(acc: [f32; DOT_LANES]) -> f32 {
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
    /// `scales·offsets` in blocks of [`GROUP_LANES`] groups. Safety: the
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
                let got = isa.vectorize(
                    #[inline(always)]
                    || dot(&a, &b),
                );
                assert_eq!(got.to_bits(), plain.to_bits(), "{isa:?} len {len}");
            }
        }
    }

    /// `dots8` is `dot` of each vector, bit for bit, on every instruction
    /// set.
    #[test]
    fn dots8_are_dot_bit_for_bit() {
        for len in [0, 1, 15, 16, 17, 64, 100, 128] {
            let row = |seed: usize| -> Vec<f32> {
                (0..len)
                    .map(|i| ((i * (31 + seed) % 97) as f32 - 48.0) / (3 + seed) as f32)
                    .collect()
            };
            let a = row(0);
            let bs: Vec<Vec<f32>> = (1..=8).map(row).collect();
            let refs: [&[f32]; 8] = std::array::from_fn(|k| bs[k].as_slice());
            for isa in Isa::available() {
                let got = isa.dots8(&a, refs);
                for (k, b) in bs.iter().enumerate() {
                    let want = dot(&a, b).to_bits();
                    assert_eq!(got[k].to_bits(), want, "{isa:?} len {len} #{k}");
                }
            }
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_the_true_value() {
        let mut worst = 0f64;
        // Every 97th float bit pattern between -87 and 88.
        let (lo, hi) = (87f32.to_bits(), 88f32.to_bits());
        let negatives = (0u32..lo).step_by(97).map(|b| f32::from_bits(b | 1 << 31));
        let positives = (0u32..hi).step_by(97).map(f32::from_bits);
        for x in negatives.chain(positives) {
            let want = (x as f64).exp();
            let ulp = f32::from_bits((want as f32).to_bits() + 1) as f64 - want as f32 as f64;
            worst = worst.max((exp(x) as f64 - want).abs() / ulp);
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn max_and_exp_sum_cover_every_value() {
        for len in [0, 1, 15, 16, 17, 100] {
            let x: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 3.0)
                .collect();
            let want = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&x), want, "len {len}");
            let mut e = x.clone();
            let total = exp_sum(&mut e, want);
            for (e, &x) in e.iter().zip(&x) {
                assert_eq!(*e, exp(x - want));
            }
            let plain: f32 = e.iter().sum();
            assert!((total - plain).abs() <= 1e-5 * plain.max(1.0), "len {len}");
        }
    }

    /// NEON is baseline on aarch64, so there the kernel tests (here and in
    /// `linear`) run its kernels, not only the scalar ones.
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn neon_is_the_first_choice_on_aarch64() {
        assert_eq!(Isa::available(), [Isa::Neon, Isa::Scalar]);
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
