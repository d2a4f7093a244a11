//! Weight storage formats and group-wise affine quantization (MLX's scheme).
//!
//! A quantized matrix `[rows, cols]` stores, per group of [`GROUP_SIZE`]
//! consecutive input weights of a row, a bf16 `scale` and `bias`, and per
//! weight an unsigned code `q` so that `w ≈ q * scale + bias`. The bytes of
//! one matrix are three sections, each starting on a 64-byte boundary:
//!
//! ```text
//! codes   rows × cols·bits/8 bytes; 4-bit codes packed eight to a
//!         little-endian u32, lowest nibble first; 2- and 3-bit codes
//!         in bit planes per group of 64 ([`lowbit`])
//! scales  rows × cols/64 bf16
//! biases  rows × cols/64 bf16
//! ```
//!
//! The same layout is used in the dense weight file and inside expert blobs.
//! q2 and q3 exist for routed experts, whose bulk dominates a model's size;
//! so does MXFP4 ([`mxfp4`]), gpt-oss's experts kept as they are stored.

pub mod lowbit;
pub mod mxfp4;

use half::bf16;
use serde::{Deserialize, Serialize};

/// Input weights sharing one scale and bias.
pub const GROUP_SIZE: usize = 64;

/// Section alignment inside a matrix and tensor alignment in weight files.
pub const ALIGN: usize = 64;

pub fn align_up(n: usize, align: usize) -> usize {
    n.div_ceil(align) * align
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    Bf16,
    Q8,
    Q4,
    Q3,
    Q2,
    Mxfp4,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::Q8 => "q8",
            DType::Q4 => "q4",
            DType::Q3 => "q3",
            DType::Q2 => "q2",
            DType::Mxfp4 => "mxfp4",
        }
    }

    pub fn parse(s: &str) -> Option<DType> {
        [
            DType::F32,
            DType::Bf16,
            DType::Q8,
            DType::Q4,
            DType::Q3,
            DType::Q2,
            DType::Mxfp4,
        ]
        .into_iter()
        .find(|d| d.name() == s)
    }

    /// Code width of an affine quantized type (`q·scale + bias`; MXFP4's
    /// codes are not affine and have none).
    pub fn bits(self) -> Option<u32> {
        match self {
            DType::Q2 => Some(2),
            DType::Q3 => Some(3),
            DType::Q4 => Some(4),
            DType::Q8 => Some(8),
            _ => None,
        }
    }

    /// Codes with a scales section, in whole groups of 64 inputs.
    pub fn is_quantized(self) -> bool {
        self.bits().is_some() || self == DType::Mxfp4
    }

    /// q2, q3 and MXFP4: encodings for routed experts, which the CUDA
    /// backend takes nowhere else (every CPU product takes them).
    pub fn experts_only(self) -> bool {
        matches!(self, DType::Q2 | DType::Q3 | DType::Mxfp4)
    }
}

/// Byte layout of one stored matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixLayout {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// Bytes of codes (or plain values) per row.
    pub row_bytes: usize,
    pub scales_offset: usize,
    pub biases_offset: usize,
    pub total_bytes: usize,
}

impl MatrixLayout {
    /// `None` when a quantized type is asked for a matrix whose input
    /// dimension is not a multiple of [`GROUP_SIZE`].
    pub fn new(dtype: DType, rows: usize, cols: usize) -> Option<MatrixLayout> {
        let (row_bytes, scales_offset, biases_offset, end) = match dtype.bits() {
            None if dtype == DType::Mxfp4 => {
                if !cols.is_multiple_of(GROUP_SIZE) {
                    return None;
                }
                // Exponent bytes in place of scales, no biases.
                let row_bytes = cols / 2;
                let scales = align_up(rows * row_bytes, ALIGN);
                let end = scales + rows * cols / mxfp4::BLOCK;
                (row_bytes, scales, end, end)
            }
            None => {
                let width = if dtype == DType::F32 { 4 } else { 2 };
                let bytes = rows * cols * width;
                (cols * width, bytes, bytes, bytes)
            }
            Some(bits) => {
                if !cols.is_multiple_of(GROUP_SIZE) {
                    return None;
                }
                let row_bytes = cols * bits as usize / 8;
                let group_bytes = rows * (cols / GROUP_SIZE) * 2;
                let scales = align_up(rows * row_bytes, ALIGN);
                let biases = align_up(scales + group_bytes, ALIGN);
                (row_bytes, scales, biases, biases + group_bytes)
            }
        };
        Some(MatrixLayout {
            dtype,
            rows,
            cols,
            row_bytes,
            scales_offset,
            biases_offset,
            total_bytes: align_up(end, ALIGN),
        })
    }

    pub fn groups_per_row(&self) -> usize {
        self.cols / GROUP_SIZE
    }

    /// The bytes of a whole matrix from its encoded rows.
    pub fn assemble(&self, enc: &EncodedRows) -> Vec<u8> {
        let mut bytes = vec![0u8; self.total_bytes];
        bytes[..enc.codes.len()].copy_from_slice(&enc.codes);
        bytes[self.scales_offset..][..enc.scales.len()].copy_from_slice(&enc.scales);
        bytes[self.biases_offset..][..enc.biases.len()].copy_from_slice(&enc.biases);
        bytes
    }
}

/// A stored matrix borrowed from a weight file or an expert blob.
#[derive(Clone, Copy, Debug)]
pub struct MatrixView<'a> {
    pub layout: MatrixLayout,
    pub bytes: &'a [u8],
}

impl<'a> MatrixView<'a> {
    /// `bytes` must hold at least `layout.total_bytes` bytes, 64-byte aligned
    /// (both guaranteed by the format's validation on open).
    pub fn new(layout: MatrixLayout, bytes: &'a [u8]) -> MatrixView<'a> {
        debug_assert!(bytes.len() >= layout.total_bytes);
        debug_assert_eq!(bytes.as_ptr() as usize % ALIGN, 0);
        MatrixView { layout, bytes }
    }

    pub fn rows(&self) -> usize {
        self.layout.rows
    }

    pub fn cols(&self) -> usize {
        self.layout.cols
    }

    fn group_params(&self, row: usize) -> (&'a [bf16], &'a [bf16]) {
        let l = &self.layout;
        let g = l.groups_per_row();
        let n = l.rows * g;
        let scales: &[bf16] =
            bytemuck::cast_slice(&self.bytes[l.scales_offset..l.scales_offset + 2 * n]);
        let biases: &[bf16] =
            bytemuck::cast_slice(&self.bytes[l.biases_offset..l.biases_offset + 2 * n]);
        (
            &scales[row * g..(row + 1) * g],
            &biases[row * g..(row + 1) * g],
        )
    }

    /// Writes row `row` as f32 into `out` (`cols` long).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let l = &self.layout;
        let raw = &self.bytes[row * l.row_bytes..(row + 1) * l.row_bytes];
        match l.dtype {
            DType::Mxfp4 => {
                let blocks = l.cols / mxfp4::BLOCK;
                let exponents = &self.bytes[l.scales_offset + row * blocks..][..blocks];
                for ((codes, out), &e) in raw
                    .chunks_exact(mxfp4::BLOCK / 2)
                    .zip(out.chunks_exact_mut(mxfp4::BLOCK))
                    .zip(exponents)
                {
                    let table = mxfp4::block_table(e);
                    for (pair, &byte) in out.chunks_exact_mut(2).zip(codes) {
                        pair[0] = table[(byte & 15) as usize];
                        pair[1] = table[(byte >> 4) as usize];
                    }
                }
            }
            DType::F32 => out.copy_from_slice(bytemuck::cast_slice(raw)),
            DType::Bf16 => {
                let src: &[bf16] = bytemuck::cast_slice(raw);
                for (o, s) in out.iter_mut().zip(src) {
                    *o = s.to_f32();
                }
            }
            DType::Q8 => {
                let (scales, biases) = self.group_params(row);
                for (g, (codes, out)) in raw
                    .chunks_exact(GROUP_SIZE)
                    .zip(out.chunks_exact_mut(GROUP_SIZE))
                    .enumerate()
                {
                    let (s, b) = (scales[g].to_f32(), biases[g].to_f32());
                    for (o, &q) in out.iter_mut().zip(codes) {
                        *o = q as f32 * s + b;
                    }
                }
            }
            DType::Q4 => {
                let (scales, biases) = self.group_params(row);
                for (g, (codes, out)) in raw
                    .chunks_exact(GROUP_SIZE / 2)
                    .zip(out.chunks_exact_mut(GROUP_SIZE))
                    .enumerate()
                {
                    let (s, b) = (scales[g].to_f32(), biases[g].to_f32());
                    for (pair, &byte) in out.chunks_exact_mut(2).zip(codes) {
                        pair[0] = (byte & 0x0f) as f32 * s + b;
                        pair[1] = (byte >> 4) as f32 * s + b;
                    }
                }
            }
            DType::Q3 | DType::Q2 => {
                let bits = l.dtype.bits().expect("quantized");
                let (scales, biases) = self.group_params(row);
                for (g, (codes, out)) in raw
                    .chunks_exact(lowbit::group_bytes(bits))
                    .zip(out.chunks_exact_mut(GROUP_SIZE))
                    .enumerate()
                {
                    let (s, b) = (scales[g].to_f32(), biases[g].to_f32());
                    for (c, o) in out.iter_mut().enumerate() {
                        *o = lowbit::code_at(bits, codes, c) as f32 * s + b;
                    }
                }
            }
        }
    }
}

/// Encodes rows of f32 weights into the three sections of a stored matrix.
/// Rows can be encoded in blocks, so a matrix larger than memory streams.
pub struct RowEncoder {
    pub layout: MatrixLayout,
}

/// The encoded bytes of a block of rows, one buffer per section (only
/// `codes` for unquantized types).
#[derive(Default)]
pub struct EncodedRows {
    pub codes: Vec<u8>,
    pub scales: Vec<u8>,
    pub biases: Vec<u8>,
}

impl RowEncoder {
    pub fn new(layout: MatrixLayout) -> Self {
        RowEncoder { layout }
    }

    /// Encodes whole rows (`values.len()` a multiple of `cols`).
    pub fn encode(&self, values: &[f32]) -> EncodedRows {
        let l = &self.layout;
        let mut out = EncodedRows::default();
        match l.dtype {
            DType::F32 => out.codes = bytemuck::cast_slice(values).to_vec(),
            DType::Bf16 => {
                out.codes = values
                    .iter()
                    .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
                    .collect();
            }
            DType::Mxfp4 => {
                let mut codes = [0u8; mxfp4::BLOCK / 2];
                for block in values.chunks_exact(mxfp4::BLOCK) {
                    out.scales.push(mxfp4::encode_block(block, &mut codes));
                    out.codes.extend_from_slice(&codes);
                }
            }
            DType::Q8 | DType::Q4 | DType::Q3 | DType::Q2 => {
                let bits = l.dtype.bits().unwrap();
                let groups = values.len() / GROUP_SIZE;
                out.codes.reserve(values.len() * bits as usize / 8);
                out.scales.reserve(groups * 2);
                out.biases.reserve(groups * 2);
                let mut codes = [0u8; GROUP_SIZE];
                let mut packed = [0u8; lowbit::group_bytes(3)];
                for group in values.chunks_exact(GROUP_SIZE) {
                    let (scale, bias) = if bits < 4 {
                        lowbit::quantize_group_lowbit(group, bits, &mut codes)
                    } else {
                        quantize_group(group, bits, &mut codes)
                    };
                    out.scales.extend(scale.to_bits().to_le_bytes());
                    out.biases.extend(bias.to_bits().to_le_bytes());
                    match bits {
                        8 => out.codes.extend_from_slice(&codes),
                        4 => out
                            .codes
                            .extend(codes.chunks_exact(2).map(|p| p[0] | (p[1] << 4))),
                        _ => {
                            let packed = &mut packed[..lowbit::group_bytes(bits)];
                            lowbit::pack_group(bits, &codes, packed);
                            out.codes.extend_from_slice(packed);
                        }
                    }
                }
            }
        }
        out
    }

    /// Encodes a whole matrix into its final byte layout.
    pub fn encode_matrix(&self, values: &[f32]) -> Vec<u8> {
        self.layout.assemble(&self.encode(values))
    }
}

/// Quantizes one group (q4 and q8, as MLX does, so MLX checkpoints copy
/// bit for bit; q2 and q3 search further, [`lowbit::quantize_group_lowbit`]):
/// `scale = (max - min) / (2^bits - 1)` and
/// `bias = min`, both rounded to bf16, then codes
/// `round_half_even((w - bias) / scale)` clamped to the code range. The
/// reference script `tools/make_fixtures.py` applies the same arithmetic.
pub fn quantize_group(group: &[f32], bits: u32, codes: &mut [u8]) -> (bf16, bf16) {
    let levels = ((1u32 << bits) - 1) as f32;
    let (min, max) = group
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &w| {
            (lo.min(w), hi.max(w))
        });
    let scale = bf16::from_f32((max - min) / levels);
    let bias = bf16::from_f32(min);
    let (s, b) = (scale.to_f32(), bias.to_f32());
    for (q, &w) in codes.iter_mut().zip(group) {
        *q = if s == 0.0 {
            0
        } else {
            round_half_even((w - b) / s).clamp(0.0, levels) as u8
        };
    }
    (scale, bias)
}

/// Rounds to the nearest integer, ties to even, like `f32::round_ties_even`
/// (and torch.round) but without a libm call on baseline x86-64: adding
/// and subtracting 1.5·2²³ leaves the float rounded by the FPU's default
/// mode, exact for |x| < 2²².
fn round_half_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    if x.abs() < 4_194_304.0 {
        (x + MAGIC) - MAGIC
    } else {
        x.round_ties_even()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::util::SplitMix64(seed);
        (0..n).map(|_| rng.next_unit() - 0.5).collect()
    }

    #[test]
    fn roundtrip_error_is_bounded_by_half_a_step() {
        for dtype in [DType::Q4, DType::Q8, DType::Bf16, DType::F32] {
            let (rows, cols) = (5, 192);
            let values = pseudo_random(rows * cols, 7);
            let layout = MatrixLayout::new(dtype, rows, cols).unwrap();
            let bytes = crate::util::AlignedBuf::from_slice(
                &RowEncoder::new(layout).encode_matrix(&values),
            );
            let view = MatrixView::new(layout, &bytes);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                view.dequantize_row(r, &mut row);
                for (g, (got, want)) in row
                    .chunks(GROUP_SIZE)
                    .zip(values[r * cols..(r + 1) * cols].chunks(GROUP_SIZE))
                    .enumerate()
                {
                    let (lo, hi) = want
                        .iter()
                        .fold((f32::MAX, f32::MIN), |a, &w| (a.0.min(w), a.1.max(w)));
                    let tol = match dtype.bits() {
                        // half a step plus the bf16 rounding of scale and bias
                        Some(bits) => {
                            (hi - lo) / ((1 << bits) - 1) as f32 * 0.51
                                + hi.abs().max(lo.abs()) * 1e-2
                        }
                        None if dtype == DType::Bf16 => hi.abs().max(lo.abs()) * 4e-3,
                        None => 0.0,
                    };
                    for (a, b) in got.iter().zip(want) {
                        assert!(
                            (a - b).abs() <= tol,
                            "{dtype:?} row {r} group {g}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// q2 and q3 matrices read back as their groups' encodings: every
    /// weight is `q·scale + bias` of the code and parameters the group
    /// quantizer chose, and rows are 16 and 24 bytes a group.
    #[test]
    fn low_bit_matrices_read_back_their_encoding() {
        for (dtype, group_bytes) in [(DType::Q2, 16), (DType::Q3, 24)] {
            let bits = dtype.bits().unwrap();
            let (rows, cols) = (3, 320);
            let values = pseudo_random(rows * cols, 19);
            let layout = MatrixLayout::new(dtype, rows, cols).unwrap();
            assert_eq!(layout.row_bytes, cols / GROUP_SIZE * group_bytes);
            let bytes = crate::util::AlignedBuf::from_slice(
                &RowEncoder::new(layout).encode_matrix(&values),
            );
            let view = MatrixView::new(layout, &bytes);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                view.dequantize_row(r, &mut row);
                for (got, want) in row
                    .chunks(GROUP_SIZE)
                    .zip(values[r * cols..(r + 1) * cols].chunks(GROUP_SIZE))
                {
                    let mut codes = [0u8; GROUP_SIZE];
                    let (s, b) = lowbit::quantize_group_lowbit(want, bits, &mut codes);
                    for (&g, &q) in got.iter().zip(&codes) {
                        assert_eq!(g, q as f32 * s.to_f32() + b.to_f32(), "{dtype:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn four_bit_codes_pack_low_nibble_first() {
        let mut group = vec![0f32; GROUP_SIZE];
        group[0] = 0.0;
        group[1] = 15.0;
        group[2] = 1.0;
        let layout = MatrixLayout::new(DType::Q4, 1, GROUP_SIZE).unwrap();
        let bytes = RowEncoder::new(layout).encode_matrix(&group);
        assert_eq!(bytes[0], 0xf0);
        assert_eq!(bytes[1] & 0x0f, 1);
    }

    #[test]
    fn rounding_matches_round_ties_even() {
        for i in -4000..4000 {
            let x = i as f32 * 0.25 + 0.0001 * (i % 7) as f32;
            assert_eq!(round_half_even(x), x.round_ties_even(), "{x}");
        }
        for x in [0.5f32, 1.5, 2.5, -0.5, -1.5, 254.5, 7.4999995, 1e7, -3e9] {
            assert_eq!(round_half_even(x), x.round_ties_even(), "{x}");
        }
    }

    #[test]
    fn constant_group_has_zero_scale() {
        let group = vec![0.25f32; GROUP_SIZE];
        let mut codes = [0u8; GROUP_SIZE];
        let (s, b) = quantize_group(&group, 4, &mut codes);
        assert_eq!(s.to_f32(), 0.0);
        assert_eq!(b.to_f32(), 0.25);
        assert!(codes.iter().all(|&q| q == 0));
    }

    #[test]
    fn quantized_layout_needs_whole_groups() {
        assert!(MatrixLayout::new(DType::Q4, 3, 100).is_none());
        let l = MatrixLayout::new(DType::Q4, 3, 128).unwrap();
        assert_eq!(l.row_bytes, 64);
        assert_eq!(l.scales_offset, 192);
        assert_eq!(l.biases_offset, 256);
        assert_eq!(l.total_bytes, 320);
    }
}
