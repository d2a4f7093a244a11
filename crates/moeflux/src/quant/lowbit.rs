//! The 2- and 3-bit codes of q2 and q3, and the quantizer that picks
//! their groups' scale and bias.
//!
//! A q2 group of 64 codes is 16 bytes in bit planes: byte `j` holds the
//! codes of columns `j`, `j + 16`, `j + 32` and `j + 48` in its bits 0–1,
//! 2–3, 4–5 and 6–7. Shifting the 16 bytes right by `2s` and masking gives
//! columns `16s .. 16s + 16` in order, so vector kernels unpack 16 (or 32,
//! 64) consecutive columns with a shift and a mask and take their inputs
//! as they are. A q3 group is the same 16 bytes for each code's low two
//! bits, then 8 bytes (a little-endian u64) whose bit `c` is bit 2 of
//! column `c`'s code: 24 bytes, and the bits of 16 consecutive columns
//! are one 16-bit mask.
//!
//! With 4 or 8 levels, min/max ranges waste much of the grid on the
//! group's few extremes; [`quantize_group_lowbit`] searches ranges and
//! refits scale and bias by least squares, keeping whichever rounds to the
//! smallest squared error (min/max among the candidates, so never worse).

use half::bf16;

use super::{GROUP_SIZE, quantize_group, round_half_even};

/// Bytes of one group's codes at `bits` (2 or 3).
pub const fn group_bytes(bits: u32) -> usize {
    GROUP_SIZE * bits as usize / 8
}

/// Bytes of one group's low two-bit planes (q2 and q3 alike).
pub const PLANE_BYTES: usize = GROUP_SIZE / 4;

/// Packs 64 codes (each below `2^bits`) into `out` (`group_bytes(bits)`).
pub fn pack_group(bits: u32, codes: &[u8], out: &mut [u8]) {
    debug_assert!(codes.len() == GROUP_SIZE && out.len() == group_bytes(bits));
    for (j, byte) in out[..PLANE_BYTES].iter_mut().enumerate() {
        *byte = (0..4).fold(0, |b, s| b | ((codes[j + 16 * s] & 3) << (2 * s)));
    }
    if bits == 3 {
        let high = codes
            .iter()
            .enumerate()
            .fold(0u64, |h, (c, &q)| h | (((q >> 2) & 1) as u64) << c);
        out[PLANE_BYTES..].copy_from_slice(&high.to_le_bytes());
    }
}

/// The code of column `c` (0..64) of a packed group.
#[inline(always)]
pub fn code_at(bits: u32, group: &[u8], c: usize) -> u8 {
    let low = (group[c % 16] >> (2 * (c / 16))) & 3;
    if bits == 3 {
        low | (((group[PLANE_BYTES + c / 8] >> (c % 8)) & 1) << 2)
    } else {
        low
    }
}

/// The high bits of a q3 group (bit `c`: column `c`'s bit 2).
#[inline(always)]
pub fn high_bits(group: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&group[PLANE_BYTES..PLANE_BYTES + 8]);
    u64::from_le_bytes(b)
}

/// Squared error of `group` encoded with `scale` and `bias` (bf16), its
/// codes rounded to nearest and clamped; fills `codes`.
fn encode_with(group: &[f32], levels: f32, scale: bf16, bias: bf16, codes: &mut [u8]) -> f32 {
    let (s, b) = (scale.to_f32(), bias.to_f32());
    let mut error = 0f32;
    for (q, &w) in codes.iter_mut().zip(group) {
        let code = if s == 0.0 {
            0.0
        } else {
            round_half_even((w - b) / s).clamp(0.0, levels)
        };
        *q = code as u8;
        let d = code * s + b - w;
        error += d * d;
    }
    error
}

/// Candidate ranges tried per group: the min/max range shrunk by steps of
/// this fraction of it, at either end or both.
const SHRINK_STEPS: usize = 8;
const SHRINK: f32 = 0.04;

/// Quantizes one group of 64 weights to `bits` (2 or 3) bits, returning
/// the scale and bias (bf16) and filling `codes` (unpacked, one a byte).
/// Candidates: [`quantize_group`]'s min/max encoding, and for ranges
/// shrunk at either end, the encoding of the range and the least-squares
/// refit of scale and bias to its codes; the one with the least squared
/// error (after bf16 rounding and re-rounding of the codes) wins.
pub fn quantize_group_lowbit(group: &[f32], bits: u32, codes: &mut [u8]) -> (bf16, bf16) {
    let levels = ((1u32 << bits) - 1) as f32;
    let mut best = quantize_group(group, bits, codes);
    let mut trial = [0u8; GROUP_SIZE];
    let mut best_error = encode_with(group, levels, best.0, best.1, &mut trial);
    let (min, max) = group
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &w| {
            (lo.min(w), hi.max(w))
        });
    let range = max - min;
    if range <= 0.0 || !range.is_finite() {
        return best;
    }
    let mut consider = |scale: bf16, bias: bf16, trial: &mut [u8; GROUP_SIZE]| {
        let error = encode_with(group, levels, scale, bias, trial);
        if error < best_error {
            best_error = error;
            best = (scale, bias);
            codes.copy_from_slice(trial);
        }
    };
    for lo_step in 0..=SHRINK_STEPS {
        for hi_step in 0..=SHRINK_STEPS {
            if lo_step + hi_step == 0 {
                continue;
            }
            let lo = min + range * SHRINK * lo_step as f32;
            let hi = max - range * SHRINK * hi_step as f32;
            if hi <= lo {
                continue;
            }
            let (scale, bias) = (bf16::from_f32((hi - lo) / levels), bf16::from_f32(lo));
            if scale.to_f32() <= 0.0 {
                continue;
            }
            // Leaves the range's codes in `trial` for the refit below.
            consider(scale, bias, &mut trial);
            // Least squares of w ≈ s·q + b over those codes.
            let (n, mut sq, mut sqq, mut sw, mut sqw) = (GROUP_SIZE as f32, 0f32, 0f32, 0f32, 0f32);
            for (&q, &w) in trial.iter().zip(group) {
                let q = q as f32;
                sq += q;
                sqq += q * q;
                sw += w;
                sqw += q * w;
            }
            let det = n * sqq - sq * sq;
            if det > 0.0 {
                let s = (n * sqw - sq * sw) / det;
                let b = (sw - s * sq) / n;
                if !(s >= 0.0 && s.is_finite() && b.is_finite()) {
                    continue;
                }
                consider(bf16::from_f32(s), bf16::from_f32(b), &mut trial);
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaussian_group(rng: &mut crate::util::SplitMix64) -> Vec<f32> {
        // Sums of uniforms: bell-shaped, with tails, as trained weights are.
        (0..GROUP_SIZE)
            .map(|_| (0..4).map(|_| rng.next_unit() - 0.5).sum::<f32>() * 0.02)
            .collect()
    }

    fn squared_error(group: &[f32], codes: &[u8], (s, b): (bf16, bf16)) -> f64 {
        group
            .iter()
            .zip(codes)
            .map(|(&w, &q)| ((q as f32 * s.to_f32() + b.to_f32() - w) as f64).powi(2))
            .sum()
    }

    /// Every code survives packing, at every column, for both widths.
    #[test]
    fn packed_codes_read_back() {
        let mut rng = crate::util::SplitMix64(3);
        for bits in [2, 3] {
            for _ in 0..50 {
                let codes: Vec<u8> = (0..GROUP_SIZE)
                    .map(|_| (rng.next_u64() % (1 << bits)) as u8)
                    .collect();
                let mut packed = vec![0u8; group_bytes(bits)];
                pack_group(bits, &codes, &mut packed);
                for (c, &q) in codes.iter().enumerate() {
                    assert_eq!(code_at(bits, &packed, c), q, "{bits} bits, column {c}");
                }
            }
        }
    }

    /// The planes as docs/FORMAT.md draws them: column 17's code in bits
    /// 2–3 of byte 1, column 63's high bit in bit 7 of the last byte.
    #[test]
    fn plane_layout_is_as_documented() {
        let mut codes = [0u8; GROUP_SIZE];
        codes[17] = 3;
        codes[63] = 4;
        let mut packed = [0u8; 24];
        pack_group(3, &codes, &mut packed);
        assert_eq!(packed[1], 0b1100);
        assert_eq!(packed[23], 0x80);
        assert_eq!(packed.iter().filter(|&&b| b != 0).count(), 2);
    }

    /// Never worse than min/max on any group, and clearly better on
    /// bell-shaped groups: over 2000 groups the squared error is at most
    /// 0.75 (2 bits) and 0.85 (3 bits) of min/max's.
    #[test]
    fn searched_ranges_beat_min_max() {
        let mut rng = crate::util::SplitMix64(11);
        for (bits, ratio) in [(2, 0.75), (3, 0.85)] {
            let (mut searched, mut plain) = (0f64, 0f64);
            for _ in 0..2000 {
                let group = gaussian_group(&mut rng);
                let (mut a, mut b) = ([0u8; GROUP_SIZE], [0u8; GROUP_SIZE]);
                let p = quantize_group(&group, bits, &mut a);
                let s = quantize_group_lowbit(&group, bits, &mut b);
                let (ep, es) = (squared_error(&group, &a, p), squared_error(&group, &b, s));
                assert!(es <= ep * (1.0 + 1e-6), "{bits} bits: {es} > {ep}");
                assert!(b.iter().all(|&q| q < 1 << bits));
                searched += es;
                plain += ep;
            }
            println!(
                "{bits} bits: squared error {:.3} of min/max's",
                searched / plain
            );
            assert!(
                searched <= ratio * plain,
                "{bits} bits: {searched} vs {plain}"
            );
        }
    }

    #[test]
    fn constant_and_infinite_groups_fall_back_to_min_max() {
        let mut codes = [9u8; GROUP_SIZE];
        let (s, b) = quantize_group_lowbit(&[0.5; GROUP_SIZE], 2, &mut codes);
        assert_eq!((s.to_f32(), b.to_f32()), (0.0, 0.5));
        assert!(codes.iter().all(|&q| q == 0));
        let mut infinite = [0f32; GROUP_SIZE];
        infinite[5] = f32::INFINITY;
        let (s, _) = quantize_group_lowbit(&infinite, 3, &mut codes);
        assert!(!s.to_f32().is_finite(), "an infinite weight stays visible");
    }
}
