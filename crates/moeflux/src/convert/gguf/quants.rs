//! ggml tensor types and their reference dequantization (ggml-quants.c's
//! `dequantize_row_*`): each block decoded to f32 exactly as ggml does,
//! operation for operation.

use half::{bf16, f16};

/// The ggml types moeflux reads, with their type ids in GGUF files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

/// Weights per K-quant super-block.
const QK_K: usize = 256;

impl GgmlType {
    /// The type of GGUF type id `id`; `Err` names known types moeflux does
    /// not read.
    pub fn from_id(id: u32) -> Result<GgmlType, String> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            other => {
                let name = match other {
                    4 | 5 => "Q4_2/Q4_3 (removed from ggml)",
                    9 => "Q8_1",
                    15 => "Q8_K",
                    16..=23 | 29 => "an IQ type",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    34 => "TQ1_0",
                    35 => "TQ2_0",
                    39 => "MXFP4",
                    _ => "an unknown type",
                };
                return Err(format!(
                    "ggml type {other} ({name}) is not supported (moeflux reads F32, F16, BF16, \
                     Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K)"
                ));
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Bf16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// Weights per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            _ => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2K => 84,
            GgmlType::Q3K => 110,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }

    /// Bits per weight, scales included.
    pub fn bits_per_weight(self) -> f64 {
        (self.block_bytes() * 8) as f64 / self.block_size() as f64
    }

    /// Appends the weights of `blocks` (whole blocks of this type) to `out`.
    pub fn dequantize(self, blocks: &[u8], out: &mut Vec<f32>) {
        debug_assert_eq!(blocks.len() % self.block_bytes(), 0);
        let n = blocks.len() / self.block_bytes() * self.block_size();
        let start = out.len();
        out.resize(start + n, 0.0);
        let y = &mut out[start..];
        let bs = self.block_size();
        let pairs = blocks
            .chunks_exact(self.block_bytes())
            .zip(y.chunks_exact_mut(bs));
        match self {
            GgmlType::F32 => {
                for (b, y) in pairs {
                    y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            GgmlType::F16 => pairs.for_each(|(b, y)| y[0] = half(b, 0)),
            GgmlType::Bf16 => {
                pairs.for_each(|(b, y)| y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32())
            }
            GgmlType::Q4_0 => pairs.for_each(|(b, y)| q4_0(b, y)),
            GgmlType::Q4_1 => pairs.for_each(|(b, y)| q4_1(b, y)),
            GgmlType::Q5_0 => pairs.for_each(|(b, y)| q5_0(b, y)),
            GgmlType::Q5_1 => pairs.for_each(|(b, y)| q5_1(b, y)),
            GgmlType::Q8_0 => pairs.for_each(|(b, y)| q8_0(b, y)),
            GgmlType::Q2K => pairs.for_each(|(b, y)| q2_k(b, y)),
            GgmlType::Q3K => pairs.for_each(|(b, y)| q3_k(b, y)),
            GgmlType::Q4K => pairs.for_each(|(b, y)| q4_k(b, y)),
            GgmlType::Q5K => pairs.for_each(|(b, y)| q5_k(b, y)),
            GgmlType::Q6K => pairs.for_each(|(b, y)| q6_k(b, y)),
        }
    }
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// `ggml_half d; uint8_t qs[16]`: `(nibble - 8) * d`, low nibbles first.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        let x0 = (qs[j] & 0x0f) as i32 - 8;
        let x1 = (qs[j] >> 4) as i32 - 8;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

/// `ggml_half d, m; uint8_t qs[16]`: `nibble * d + m`.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        let x0 = (qs[j] & 0x0f) as i32;
        let x1 = (qs[j] >> 4) as i32;
        y[j] = x0 as f32 * d + m;
        y[j + 16] = x1 as f32 * d + m;
    }
}

/// `ggml_half d; uint8_t qh[4]; uint8_t qs[16]`: fifth bits in `qh`.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = ((qs[j] as u32 & 0x0f) | xh0) as i32 - 16;
        let x1 = ((qs[j] as u32 >> 4) | xh1) as i32 - 16;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

/// `ggml_half d, m; uint8_t qh[4]; uint8_t qs[16]`.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = (qs[j] as u32 & 0x0f) | xh0;
        let x1 = (qs[j] as u32 >> 4) | xh1;
        y[j] = x0 as f32 * d + m;
        y[j + 16] = x1 as f32 * d + m;
    }
}

/// `ggml_half d; int8_t qs[32]`.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for (o, &q) in y.iter_mut().zip(&b[2..34]) {
        *o = q as i8 as f32 * d;
    }
}

/// `uint8_t scales[16]; uint8_t qs[64]; ggml_half d, dmin`.
fn q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let d = half(b, 80);
    let min = half(b, 82);
    let mut q = &b[16..80];
    let mut out = 0;
    let mut is = 0;
    for _ in (0..QK_K).step_by(128) {
        let mut shift = 0;
        for _ in 0..4 {
            for half_block in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0f) as f32;
                let ml = min * (sc >> 4) as f32;
                for l in 0..16 {
                    let v = ((q[l + 16 * half_block] >> shift) & 3) as i8;
                    y[out] = dl * v as f32 - ml;
                    out += 1;
                }
            }
            shift += 2;
        }
        q = &q[32..];
    }
}

/// `uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; ggml_half d`.
fn q3_k(b: &[u8], y: &mut [f32]) {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let hm = &b[0..32];
    let mut q = &b[32..96];
    let raw = &b[96..108];
    let d_all = half(b, 108);
    let word =
        |i: usize| u32::from_le_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]]);
    let mut aux = [word(0), word(1), word(2), 0];
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4);
    aux[3] = ((aux[1] >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4);
    aux[0] = (aux[0] & KMASK2) | ((tmp & KMASK1) << 4);
    aux[1] = (aux[1] & KMASK2) | (((tmp >> 2) & KMASK1) << 4);
    let scales: Vec<i8> = aux
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .map(|x| x as i8)
        .collect();
    let mut out = 0;
    let mut is = 0;
    let mut m: u8 = 1;
    for _ in (0..QK_K).step_by(128) {
        let mut shift = 0;
        for _ in 0..4 {
            for half_block in 0..2 {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let k = l + 16 * half_block;
                    let low = ((q[k] >> shift) & 3) as i8;
                    let high = if hm[k] & m != 0 { 0 } else { 4 };
                    y[out] = dl * (low - high) as f32;
                    out += 1;
                }
            }
            shift += 2;
            m <<= 1;
        }
        q = &q[32..];
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j`.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `ggml_half d, dmin; uint8_t scales[12]; uint8_t qs[128]`.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let min = half(b, 2);
    let scales = &b[4..16];
    let mut q = &b[16..144];
    let mut out = 0;
    let mut is = 0;
    for _ in (0..QK_K).step_by(64) {
        let (sc, m) = scale_min_k4(is, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = scale_min_k4(is + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        for &v in &q[..32] {
            y[out] = d1 * (v & 0x0f) as f32 - m1;
            out += 1;
        }
        for &v in &q[..32] {
            y[out] = d2 * (v >> 4) as f32 - m2;
            out += 1;
        }
        q = &q[32..];
        is += 2;
    }
}

/// `ggml_half d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]`.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let min = half(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let mut ql = &b[48..176];
    let mut out = 0;
    let mut is = 0;
    let (mut u1, mut u2) = (1u8, 2u8);
    for _ in (0..QK_K).step_by(64) {
        let (sc, m) = scale_min_k4(is, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = scale_min_k4(is + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        for l in 0..32 {
            let high = if qh[l] & u1 != 0 { 16 } else { 0 };
            y[out] = d1 * ((ql[l] & 0x0f) + high) as f32 - m1;
            out += 1;
        }
        for l in 0..32 {
            let high = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[out] = d2 * ((ql[l] >> 4) + high) as f32 - m2;
            out += 1;
        }
        ql = &ql[32..];
        is += 2;
        u1 <<= 2;
        u2 <<= 2;
    }
}

/// `uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d`.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = half(b, 208);
    let (mut ql, mut qh, mut sc) = (&b[0..128], &b[128..192], &b[192..208]);
    for n in (0..QK_K).step_by(128) {
        let y = &mut y[n..n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            let s = |k: usize| sc[k] as i8 as f32;
            y[l] = d * s(is) * q1 as f32;
            y[l + 32] = d * s(is + 2) * q2 as f32;
            y[l + 64] = d * s(is + 4) * q3 as f32;
            y[l + 96] = d * s(is + 6) * q4 as f32;
        }
        ql = &ql[64..];
        qh = &qh[32..];
        sc = &sc[8..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_block() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2] = 4;
        b[3] = (-6i8) as u8;
        let mut out = Vec::new();
        GgmlType::Q8_0.dequantize(&b, &mut out);
        assert_eq!(out.len(), 32);
        assert_eq!((out[0], out[1], out[2]), (2.0, -3.0, 0.0));
    }

    #[test]
    fn q4_0_low_nibbles_then_high() {
        let mut b = vec![0x88u8; 18];
        b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2] = 0x9a; // low 0xa -> +2 at 0, high 0x9 -> +1 at 16
        let mut out = Vec::new();
        GgmlType::Q4_0.dequantize(&b, &mut out);
        assert_eq!((out[0], out[16], out[1]), (2.0, 1.0, 0.0));
    }

    #[test]
    fn sizes() {
        assert_eq!(GgmlType::Q4K.bits_per_weight(), 4.5);
        assert_eq!(GgmlType::Q6K.bits_per_weight(), 6.5625);
        assert!(GgmlType::from_id(39).unwrap_err().contains("MXFP4"));
    }
}
