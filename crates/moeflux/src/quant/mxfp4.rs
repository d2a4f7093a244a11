//! MXFP4 (OCP Microscaling, as gpt-oss stores its experts): 4-bit e2m1
//! codes, two per byte, low nibble first (q4's packing), and one e8m0
//! exponent byte per 32 codes: `w = e2m1(q) · 2^(e − 127)`, exact in f32
//! and in bf16.
//!
//! In a stored matrix the exponents take the scales section: a row's
//! `cols / 32` bytes, two per group of 64 (as many bytes as a q4 row's
//! bf16 scales); there are no biases.

/// Inputs sharing one exponent.
pub const BLOCK: usize = 32;

/// The e2m1 values by code: bit 3 the sign, then two exponent bits and one
/// mantissa bit.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `2^(e − 127)` of an e8m0 exponent byte (255, NaN in the standard,
/// reads as infinity: the product shows it).
#[inline(always)]
pub fn exponent_scale(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000), // 2^-127, below f32's normal range
        e => f32::from_bits((e as u32) << 23),
    }
}

/// A block's 16 values, `E2M1[q] · 2^(e − 127)` by code `q`.
#[inline(always)]
pub fn block_table(e: u8) -> [f32; 16] {
    let d = exponent_scale(e);
    E2M1.map(|v| v * d)
}

/// Encodes 32 values: the exponent is the smallest that keeps the block's
/// largest magnitude within e2m1's 6, and each value takes the nearest
/// code (ties to the smaller magnitude). Values that came from MXFP4 come
/// back exactly (a block whose largest code was below 4 takes a smaller
/// exponent, and its values are still on the finer grid).
pub fn encode_block(values: &[f32], codes: &mut [u8]) -> u8 {
    debug_assert!(values.len() == BLOCK && codes.len() == BLOCK / 2);
    let max = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    let e = if max > 0.0 && max.is_finite() {
        ((max / 6.0).log2().ceil() as i32).clamp(-127, 127)
    } else {
        0
    };
    let byte = (e + 127) as u8;
    let d = exponent_scale(byte);
    codes.fill(0);
    for (i, &v) in values.iter().enumerate() {
        let m = (v / d).abs();
        let nearest = (0..8)
            .min_by(|&a, &b| (E2M1[a] - m).abs().total_cmp(&(E2M1[b] - m).abs()))
            .expect("codes") as u8;
        let code = nearest | if v < 0.0 && nearest != 0 { 8 } else { 0 };
        codes[i / 2] |= code << (4 * (i % 2));
    }
    byte
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(e: u8, codes: &[u8]) -> Vec<f32> {
        let table = block_table(e);
        (0..BLOCK)
            .map(|i| table[((codes[i / 2] >> (4 * (i % 2))) & 15) as usize])
            .collect()
    }

    /// Every block of MXFP4 values, whatever its exponent and largest
    /// code, encodes back to the same values.
    #[test]
    fn mxfp4_values_reencode_exactly() {
        let mut rng = crate::util::SplitMix64(5);
        for e in [0u8, 1, 60, 127, 128, 200, 250] {
            for top in 0..8 {
                let mut codes = [0u8; BLOCK / 2];
                for byte in codes.iter_mut() {
                    let (a, b) = (rng.next_u64() % (top + 1), rng.next_u64() % (top + 1));
                    let sign = (rng.next_u64() % 2 * 8) as u8;
                    *byte = (a as u8 | sign) | ((b as u8) << 4);
                }
                let values = decode(e, &codes);
                let mut again = [0u8; BLOCK / 2];
                let e2 = encode_block(&values, &mut again);
                let back = decode(e2, &again);
                for (a, b) in back.iter().zip(&values) {
                    assert!(a == b, "exponent {e}, codes up to {top}: {a} vs {b}");
                }
            }
        }
    }

    /// Other values land within half a step of the block's grid.
    #[test]
    fn encoding_rounds_to_the_nearest_code() {
        let mut rng = crate::util::SplitMix64(9);
        let values: Vec<f32> = (0..BLOCK).map(|_| rng.next_unit() * 2.0 - 1.0).collect();
        let mut codes = [0u8; BLOCK / 2];
        let e = encode_block(&values, &mut codes);
        let d = exponent_scale(e);
        for (got, want) in decode(e, &codes).iter().zip(&values) {
            // The widest step of e2m1 is 2 (between 4 and 6).
            assert!((got - want).abs() <= d, "{got} vs {want}");
        }
        assert_eq!(exponent_scale(127), 1.0);
        assert_eq!(exponent_scale(0), 2f32.powi(-127));
    }
}
