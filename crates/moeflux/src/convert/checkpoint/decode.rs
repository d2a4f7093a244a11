//! Reading a checkpoint's values: bf16, f16 and f32 as they are, FP8 times
//! its block scales, MLX codes times their scales plus their biases, MXFP4
//! values times their power-of-two scales; MLX rows in moeflux's own
//! encoding copied as they are.

use std::path::Path;
use std::sync::LazyLock;

use half::{bf16, f16};
use safetensors::tensor::Dtype;

use super::{Checkpoint, Encoding, Shard, Stored};
use crate::convert::view::Store;
use crate::error::{Error, Result};
use crate::quant::{DType, EncodedRows, GROUP_SIZE};

/// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
/// infinities, S.1111.111 is NaN.
pub(crate) fn e4m3_to_f32(byte: u8) -> f32 {
    static TABLE: LazyLock<[f32; 256]> = LazyLock::new(|| {
        std::array::from_fn(|b| {
            let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
            let exp = ((b >> 3) & 0xf) as i32;
            let man = (b & 7) as f32;
            if exp == 0xf && b & 7 == 7 {
                f32::NAN
            } else if exp == 0 {
                sign * man * (2f32).powi(-9)
            } else {
                sign * (1.0 + man / 8.0) * (2f32).powi(exp - 7)
            }
        })
    });
    TABLE[byte as usize]
}

/// The e2m1 values of MXFP4 (OCP Microscaling), by 4-bit code.
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Value `i` of MXFP4 `blocks` (16 bytes per group of 32, low nibble
/// first) with exponent bytes `scales` (biased by 127).
pub(crate) fn mxfp4_at(blocks: &[u8], scales: &[u8], i: usize) -> f32 {
    let byte = blocks[i / 2];
    let code = if i.is_multiple_of(2) {
        byte & 0xf
    } else {
        byte >> 4
    };
    E2M1[code as usize] * (2f32).powi(scales[i / 32] as i32 - 127)
}

fn float_at(dtype: Dtype, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        Dtype::BF16 => bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        Dtype::F16 => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        _ => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
    }
}

/// An MLX row: its codes, the dtype of its scales and biases, their bytes.
type MlxRow<'a> = (&'a [u8], Dtype, &'a [u8], &'a [u8]);

impl Checkpoint {
    /// Whether any tensor is FP8 or MLX-quantized.
    pub(crate) fn quantized(&self) -> bool {
        self.stored
            .values()
            .any(|t| !matches!(t.encoding, Encoding::Plain))
    }

    fn raw(&self, t: &Stored, name: &str) -> (&Shard, Dtype, &[u8]) {
        let shard = &self.shards[t.shard];
        let info = &shard.tensors[name];
        let bytes = &shard.map[shard.data_start + info.data_offsets.0..]
            [..info.data_offsets.1 - info.data_offsets.0];
        (shard, info.dtype, bytes)
    }

    fn stored(&self, name: &str) -> &Stored {
        &self.stored[name]
    }

    /// The codes of an MLX row, and its scales' and biases' bytes.
    fn mlx_row(&self, name: &str, row: usize) -> Option<MlxRow<'_>> {
        let t = self.stored(name);
        let Encoding::Mlx {
            scales,
            biases,
            bits,
            group,
        } = &t.encoding
        else {
            return None;
        };
        let cols = *t.shape.last()?;
        let (row_bytes, groups) = (cols * bits / 8, cols / group);
        let (_, _, codes) = self.raw(t, name);
        let (_, sd, s) = self.raw(t, scales);
        let (_, _, b) = self.raw(t, biases);
        let w = sd.bitsize() / 8;
        Some((
            &codes[row * row_bytes..][..row_bytes],
            sd,
            &s[row * groups * w..][..groups * w],
            &b[row * groups * w..][..groups * w],
        ))
    }
}

impl Store for Checkpoint {
    fn read_elements(
        &self,
        name: &str,
        start: usize,
        len: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let t = self.stored(name);
        let total: usize = t.shape.iter().product();
        let cols = *t.shape.last().unwrap_or(&1);
        let (shard, dtype, bytes) = self.raw(t, name);
        if start + len > total {
            return Err(Error::tensor(
                &shard.path,
                name,
                format!("elements {start}..{} of {total} asked", start + len),
            ));
        }
        let range = start..start + len;
        match &t.encoding {
            Encoding::Plain => match dtype {
                Dtype::BF16 | Dtype::F16 | Dtype::F32 => {
                    out.extend(range.map(|i| float_at(dtype, bytes, i)));
                }
                other => {
                    return Err(Error::tensor(
                        &shard.path,
                        name,
                        format!(
                            "dtype {other:?} is not supported (expected BF16, F16, F32, \
                             block-scaled F8_E4M3 or MLX-quantized U32)"
                        ),
                    ));
                }
            },
            Encoding::Fp8 { scale, block } => {
                let (_, sd, s) = self.raw(t, scale);
                let n = t.shape.len();
                let rows = t.shape[n - 2];
                let (brows, bcols) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
                let per_tensor = s.len() == sd.bitsize() / 8;
                out.extend(range.map(|i| {
                    let (r, c) = (i / cols, i % cols);
                    let k = if per_tensor {
                        0
                    } else {
                        let (m, r) = (r / rows, r % rows);
                        (m * brows + r / block[0]) * bcols + c / block[1]
                    };
                    e4m3_to_f32(bytes[i]) * float_at(sd, s, k)
                }));
            }
            Encoding::Mlx {
                scales,
                biases,
                bits,
                group,
            } => {
                let (_, sd, s) = self.raw(t, scales);
                let (_, _, b) = self.raw(t, biases);
                let row_bytes = cols * bits / 8;
                let groups = cols / group;
                let mask = (1u32 << bits) - 1;
                out.extend(range.map(|i| {
                    let (r, c) = (i / cols, i % cols);
                    let bit = c * bits;
                    let at = r * row_bytes + bit / 8;
                    let lo = bytes[at] as u32;
                    let hi = if bit % 8 + bits > 8 {
                        bytes[at + 1] as u32
                    } else {
                        0
                    };
                    let q = ((lo | (hi << 8)) >> (bit % 8)) & mask;
                    let g = r * groups + c / group;
                    q as f32 * float_at(sd, s, g) + float_at(sd, b, g)
                }));
            }
            Encoding::Mxfp4 { scales } => {
                let (_, _, s) = self.raw(t, scales);
                out.extend(range.map(|i| mxfp4_at(bytes, s, i)));
            }
        }
        Ok(())
    }

    fn path_of(&self, name: &str) -> &Path {
        &self.shards[self.stored(name).shard].path
    }

    fn bits_per_weight(&self, name: &str) -> Option<f64> {
        let t = self.stored.get(name)?;
        let (_, dtype, _) = self.raw(t, name);
        Some(match &t.encoding {
            Encoding::Plain => dtype.bitsize() as f64,
            Encoding::Fp8 { .. } => 8.0,
            Encoding::Mxfp4 { .. } => 4.25,
            Encoding::Mlx {
                scales,
                bits,
                group,
                ..
            } => {
                let (_, sd, _) = self.raw(t, scales);
                *bits as f64 + 2.0 * sd.bitsize() as f64 / *group as f64
            }
        })
    }

    fn stored_as(&self, name: &str, dtype: DType) -> bool {
        let t = self.stored(name);
        match &t.encoding {
            Encoding::Mlx {
                scales,
                bits,
                group,
                ..
            } => {
                let (_, sd, _) = self.raw(t, scales);
                // MLX packs 4 and 8 bits as q4 and q8 do; its 2- and
                // 3-bit codes are packed otherwise and get re-encoded.
                matches!(dtype, DType::Q4 | DType::Q8)
                    && Some(*bits as u32) == dtype.bits()
                    && *group == GROUP_SIZE
                    && matches!(sd, Dtype::BF16 | Dtype::F16)
            }
            _ => false,
        }
    }

    fn append_encoded_row(
        &self,
        name: &str,
        row: usize,
        _cols: usize,
        out: &mut EncodedRows,
    ) -> Result<bool> {
        let Some((codes, sd, s, b)) = self.mlx_row(name, row) else {
            return Ok(false);
        };
        match sd {
            Dtype::BF16 => {
                out.scales.extend_from_slice(s);
                out.biases.extend_from_slice(b);
            }
            Dtype::F16 => {
                // Exact only when every value survives the narrower
                // mantissa and the wider exponent range of bf16.
                for (src, dst) in [(s, &mut out.scales), (b, &mut out.biases)] {
                    for pair in src.chunks_exact(2) {
                        let v = f16::from_le_bytes([pair[0], pair[1]]).to_f32();
                        let w = bf16::from_f32(v);
                        if w.to_f32() != v {
                            return Ok(false);
                        }
                        dst.extend(w.to_le_bytes());
                    }
                }
            }
            _ => return Ok(false),
        }
        out.codes.extend_from_slice(codes);
        Ok(true)
    }

    fn describe(&self, name: &str) -> Option<String> {
        let t = self.stored(name);
        match &t.encoding {
            Encoding::Plain => None,
            Encoding::Fp8 { .. } => Some("FP8 (e4m3, block scales)".into()),
            Encoding::Mxfp4 { .. } => Some("MXFP4 (e2m1, a power-of-two scale per 32)".into()),
            Encoding::Mlx { bits, group, .. } => Some(format!("MLX {bits}-bit groups of {group}")),
        }
    }
}
