//! How a KV cache stores keys and values ([`KvType`]) and rows of them in
//! host memory ([`KvRows`]): the one definition of each encoding, which
//! the CPU's cache holds as is, the CUDA kernels reproduce bit for bit
//! (kernels/attention.cu: `kv_round_bf16`, `kv_quantize_q8`), and saved
//! session states carry.
//!
//! A long context's decode step reads every cached key and value once per
//! layer, so their bytes bound it: bf16 halves them, q8 (8-bit codes with
//! an f32 scale per [`Q8_BLOCK`] values, 1.125 bytes a value) takes 28% of
//! f32's. Attention computes in f32 on the values the cache holds.

use std::fmt;
use std::str::FromStr;

/// Values of a head row that share one q8 scale.
pub const Q8_BLOCK: usize = 32;

/// How a KV cache stores the keys and values of full-attention layers
/// (and sliding windows). Multi-head latent attention keeps its latent
/// cache in f32 whatever the type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvType {
    /// Exact.
    F32,
    /// Rounded to bf16 (to nearest, ties to even; 8 significant bits): a
    /// relative error of at most 2⁻⁸ per value.
    Bf16,
    /// Each block of [`Q8_BLOCK`] values of a head row as int8 codes
    /// `round(x / s)` with `s = max|x| / 127` stored in f32: an error of at
    /// most `s / 2` per value.
    Q8,
}

impl KvType {
    pub const ALL: [KvType; 3] = [KvType::F32, KvType::Bf16, KvType::Q8];

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::Bf16 => "bf16",
            KvType::Q8 => "q8",
        }
    }

    /// Bytes one row of `width` values takes (a multiple of [`Q8_BLOCK`]
    /// for q8): its values and its scales.
    pub fn row_bytes(self, width: usize) -> usize {
        self.value_bytes() * width + self.scale_bytes(width)
    }

    /// Bytes of one value (a q8 code, its scale aside).
    pub fn value_bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::Bf16 => 2,
            KvType::Q8 => 1,
        }
    }

    /// Bytes of the scales of a row of `width` values (q8's; none for the
    /// other types).
    pub fn scale_bytes(self, width: usize) -> usize {
        match self {
            KvType::Q8 => 4 * (width / Q8_BLOCK),
            _ => 0,
        }
    }

    /// Why heads of `head_dim` values cannot be stored in this type, if
    /// they cannot: q8's blocks do not straddle heads.
    pub fn unsupported_head_dim(self, head_dim: usize) -> Option<String> {
        (self == KvType::Q8 && !head_dim.is_multiple_of(Q8_BLOCK)).then(|| {
            format!(
                "a q8 KV cache needs heads of a multiple of {Q8_BLOCK} values; this model's \
                 have {head_dim}: use bf16 or f32"
            )
        })
    }
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvType {
    type Err = String;

    fn from_str(text: &str) -> Result<KvType, String> {
        KvType::ALL
            .into_iter()
            .find(|t| t.name() == text)
            .ok_or_else(|| format!("`{text}` is not a KV cache type: expected f32, bf16 or q8"))
    }
}

/// `x` rounded to bf16, as its bits (to nearest, ties to even; a NaN stays
/// a NaN).
pub fn round_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// The f32 value of bf16 bits.
#[inline(always)]
pub fn bf16_value(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// One q8 block's codes and scale (see [`KvType::Q8`]): the scale is
/// `max|x| / 127` and each code `x / scale` rounded to nearest, ties to
/// even (all codes 0 when the block is all zeros).
pub fn quantize_q8(block: &[f32], codes: &mut [i8]) -> f32 {
    let max = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = max / 127.0;
    for (c, &v) in codes.iter_mut().zip(block) {
        *c = match scale > 0.0 {
            true => (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8,
            false => 0,
        };
    }
    scale
}

/// Rows of keys or values in a [`KvType`]'s encoding, row after row
/// (`[rows, width]`, width a multiple of [`Q8_BLOCK`] for q8): what a CPU
/// cache holds and what a cache's export and import carry.
#[derive(Clone, Debug, PartialEq)]
pub enum KvRows {
    F32(Vec<f32>),
    /// bf16 bits.
    Bf16(Vec<u16>),
    /// The codes, and a scale per [`Q8_BLOCK`] codes.
    Q8 {
        codes: Vec<i8>,
        scales: Vec<f32>,
    },
}

impl KvRows {
    /// No rows, of type `kv`.
    pub fn new(kv: KvType) -> KvRows {
        match kv {
            KvType::F32 => KvRows::F32(Vec::new()),
            KvType::Bf16 => KvRows::Bf16(Vec::new()),
            KvType::Q8 => KvRows::Q8 {
                codes: Vec::new(),
                scales: Vec::new(),
            },
        }
    }

    /// `values` encoded as `kv` (a whole number of q8 blocks for q8).
    pub fn encode(kv: KvType, values: &[f32]) -> KvRows {
        let mut rows = KvRows::new(kv);
        rows.push(values);
        rows
    }

    pub fn kv_type(&self) -> KvType {
        match self {
            KvRows::F32(_) => KvType::F32,
            KvRows::Bf16(_) => KvType::Bf16,
            KvRows::Q8 { .. } => KvType::Q8,
        }
    }

    /// Values held (rows × width).
    pub fn len(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::Bf16(v) => v.len(),
            KvRows::Q8 { codes, .. } => codes.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends `values`, encoded (a whole number of q8 blocks for q8).
    pub fn push(&mut self, values: &[f32]) {
        match self {
            KvRows::F32(v) => v.extend_from_slice(values),
            KvRows::Bf16(v) => v.extend(values.iter().map(|&x| round_bf16(x))),
            KvRows::Q8 { codes, scales } => {
                assert!(
                    values.len().is_multiple_of(Q8_BLOCK),
                    "q8 rows hold whole blocks of {Q8_BLOCK} values"
                );
                let start = codes.len();
                codes.resize(start + values.len(), 0);
                for (block, out) in values
                    .chunks_exact(Q8_BLOCK)
                    .zip(codes[start..].chunks_exact_mut(Q8_BLOCK))
                {
                    scales.push(quantize_q8(block, out));
                }
            }
        }
    }

    /// Keeps the first `len` values.
    pub fn truncate(&mut self, len: usize) {
        match self {
            KvRows::F32(v) => v.truncate(len),
            KvRows::Bf16(v) => v.truncate(len),
            KvRows::Q8 { codes, scales } => {
                codes.truncate(len);
                scales.truncate(len / Q8_BLOCK);
            }
        }
    }

    /// Drops the first `len` values.
    pub fn drop_front(&mut self, len: usize) {
        match self {
            KvRows::F32(v) => drop(v.drain(..len)),
            KvRows::Bf16(v) => drop(v.drain(..len)),
            KvRows::Q8 { codes, scales } => {
                codes.drain(..len);
                scales.drain(..len / Q8_BLOCK);
            }
        }
    }

    /// The values the rows hold, in f32.
    pub fn decode(&self) -> Vec<f32> {
        match self {
            KvRows::F32(v) => v.clone(),
            KvRows::Bf16(v) => v.iter().map(|&b| bf16_value(b)).collect(),
            KvRows::Q8 { codes, scales } => codes
                .chunks_exact(Q8_BLOCK)
                .zip(scales)
                .flat_map(|(block, &s)| block.iter().map(move |&c| c as f32 * s))
                .collect(),
        }
    }

    /// Appends the rows' bytes, little-endian: the values (f32 or bf16),
    /// or the q8 codes and then their scales.
    pub fn write_bytes(&self, out: &mut Vec<u8>) {
        match self {
            KvRows::F32(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            KvRows::Bf16(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            KvRows::Q8 { codes, scales } => {
                out.extend(codes.iter().map(|&c| c as u8));
                out.extend(scales.iter().flat_map(|x| x.to_le_bytes()));
            }
        }
    }

    /// `len` values of type `kv` from the front of `bytes` as
    /// [`KvRows::write_bytes`] wrote them, and the bytes after them;
    /// `None` if `bytes` is too short.
    pub fn read_bytes(kv: KvType, len: usize, bytes: &[u8]) -> Option<(KvRows, &[u8])> {
        let size = kv.row_bytes(len);
        if bytes.len() < size || (kv == KvType::Q8 && !len.is_multiple_of(Q8_BLOCK)) {
            return None;
        }
        let (head, rest) = bytes.split_at(size);
        let f32s = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let rows = match kv {
            KvType::F32 => KvRows::F32(f32s(head)),
            KvType::Bf16 => KvRows::Bf16(
                head.chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            KvType::Q8 => {
                let (codes, scales) = head.split_at(len);
                KvRows::Q8 {
                    codes: codes.iter().map(|&c| c as i8).collect(),
                    scales: f32s(scales),
                }
            }
        };
        Some((rows, rest))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::util::SplitMix64(seed);
        (0..n)
            .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 6.0)
            .collect()
    }

    /// bf16 rounding is to nearest with ties to even, as `half` rounds,
    /// and within 2⁻⁸ of the value.
    #[test]
    fn bf16_rounds_to_nearest_even() {
        for x in values(4099, 1)
            .into_iter()
            .chain([0.0, -0.0, 1.0, f32::MAX, f32::MIN_POSITIVE, 1e-40])
            .chain([f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000)])
        {
            let bits = round_bf16(x);
            assert_eq!(bits, half::bf16::from_f32(x).to_bits(), "{x}");
            let back = bf16_value(bits);
            if x.is_finite() && back.is_finite() && x.abs() >= f32::MIN_POSITIVE {
                assert!((back - x).abs() <= x.abs() / 256.0, "{x} -> {back}");
            }
        }
        assert_eq!(
            round_bf16(f32::from_bits(0x3f80_8000)),
            0x3f80,
            "tie to even"
        );
        assert_eq!(
            round_bf16(f32::from_bits(0x3f81_8000)),
            0x3f82,
            "tie to even"
        );
        assert!(bf16_value(round_bf16(f32::NAN)).is_nan());
    }

    /// Each q8 value within half a step of the original; the block's
    /// largest magnitude exact up to the scale's rounding; zero blocks
    /// stay zero.
    #[test]
    fn q8_blocks_round_within_half_a_step() {
        let x = values(5 * Q8_BLOCK, 2);
        let rows = KvRows::encode(KvType::Q8, &x);
        let KvRows::Q8 { codes, scales } = &rows else {
            unreachable!()
        };
        assert_eq!((codes.len(), scales.len()), (x.len(), 5));
        let back = rows.decode();
        for (b, block) in x.chunks(Q8_BLOCK).enumerate() {
            let max = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(scales[b], max / 127.0);
            assert!(
                codes[b * Q8_BLOCK..][..Q8_BLOCK]
                    .iter()
                    .any(|c| c.abs() == 127)
            );
            for (i, &v) in block.iter().enumerate() {
                let err = (back[b * Q8_BLOCK + i] - v).abs();
                assert!(err <= scales[b] * 0.5 * (1.0 + 1e-6), "{v}: {err}");
            }
        }
        let zeros = KvRows::encode(KvType::Q8, &[0.0; Q8_BLOCK]);
        assert_eq!(zeros.decode(), vec![0.0; Q8_BLOCK]);
    }

    /// Rows survive bytes, truncation and dropping from the front, for
    /// every type.
    #[test]
    fn rows_round_trip_through_bytes_and_edits() {
        let x = values(6 * Q8_BLOCK, 3);
        for kv in KvType::ALL {
            let rows = KvRows::encode(kv, &x);
            assert_eq!(rows.kv_type(), kv);
            let mut bytes = Vec::new();
            rows.write_bytes(&mut bytes);
            assert_eq!(bytes.len(), kv.row_bytes(x.len()));
            bytes.push(7);
            let (read, rest) = KvRows::read_bytes(kv, x.len(), &bytes).unwrap();
            assert_eq!((&read, rest), (&rows, &[7u8][..]));
            assert!(KvRows::read_bytes(kv, x.len(), &bytes[..bytes.len() - 2]).is_none());

            let whole = rows.decode();
            let mut edited = rows.clone();
            edited.truncate(4 * Q8_BLOCK);
            edited.drop_front(Q8_BLOCK);
            assert_eq!(edited.len(), 3 * Q8_BLOCK);
            assert_eq!(edited.decode(), whole[Q8_BLOCK..4 * Q8_BLOCK]);
            let mut appended = KvRows::encode(kv, &x[..2 * Q8_BLOCK]);
            appended.push(&x[2 * Q8_BLOCK..]);
            assert_eq!(
                appended, rows,
                "{kv}: appending rows encodes each row alone"
            );
        }
        assert_eq!(KvType::Q8.row_bytes(128), 128 + 16);
        assert_eq!("bf16".parse::<KvType>(), Ok(KvType::Bf16));
        assert!(
            "f16"
                .parse::<KvType>()
                .unwrap_err()
                .contains("f32, bf16 or q8")
        );
        assert!(KvType::Q8.unsupported_head_dim(80).is_some());
        assert!(KvType::Bf16.unsupported_head_dim(80).is_none());
    }
}
