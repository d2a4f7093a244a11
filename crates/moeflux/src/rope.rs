//! Rotary position embeddings' frequencies: plain RoPE and YaRN scaling,
//! computed as transformers computes them (`modeling_rope_utils.py`:
//! `_compute_default_rope_parameters`, `_compute_yarn_parameters`), so that
//! both backends rotate by the same f32 frequencies as the reference.

use serde::Serialize;

/// YaRN rope scaling (`rope_scaling` / `rope_parameters` with `rope_type:
/// "yarn"`): frequencies interpolated by `factor` below the correction
/// range, kept above it, ramped between; cos and sin scaled by
/// [`Yarn::attention_factor`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Yarn {
    /// Context extension factor (`factor`, or `max_position_embeddings /
    /// original_max_position_embeddings` where `factor` is null).
    pub factor: f64,
    /// The pretraining context (`original_max_position_embeddings`).
    pub original_max_position_embeddings: usize,
    /// Rotations bounding the correction range (defaults 32 and 1).
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// `mscale` and `mscale_all_dim` (DeepSeek-V3): with both set and
    /// nonzero, the attention factor is their ratio of `get_mscale`s.
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    /// An explicit `attention_factor`, which overrides the computed one.
    pub attention_factor: Option<f64>,
    /// Whether the correction range is rounded outwards to whole
    /// dimensions (`truncate`, default true; gpt-oss sets false).
    pub truncate: bool,
}

/// YaRN's magnitude correction, `0.1·m·ln(scale) + 1` (1 for `scale ≤ 1`).
pub fn get_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl Yarn {
    /// The factor transformers multiplies cos and sin by (its
    /// `attention_scaling`).
    pub fn attention_factor(&self) -> f64 {
        if let Some(f) = self.attention_factor {
            return f;
        }
        match (self.mscale, self.mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                get_mscale(self.factor, m) / get_mscale(self.factor, all)
            }
            _ => get_mscale(self.factor, 1.0),
        }
    }

    /// The dimension range `[low, high]` over which the frequencies ramp
    /// from extrapolated to interpolated (`find_correction_range`).
    fn correction_range(&self, dim: usize, theta: f64) -> (f64, f64) {
        let dim_f = dim as f64;
        let original = self.original_max_position_embeddings as f64;
        let correction_dim = |rotations: f64| {
            dim_f * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (
            correction_dim(self.beta_fast),
            correction_dim(self.beta_slow),
        );
        if self.truncate {
            low = low.floor();
            high = high.ceil();
        }
        (low.max(0.0), high.min(dim_f - 1.0))
    }
}

/// The inverse frequencies of a rotation of `rotary_dim` features with base
/// `theta`, one per rotated pair, in f32 in transformers' order of
/// operations.
pub fn inv_frequencies(rotary_dim: usize, theta: f64, yarn: Option<&Yarn>) -> Vec<f32> {
    // pos_freqs = base ** (arange(0, dim, 2).float() / dim), in f32.
    let pos_freqs: Vec<f32> = (0..rotary_dim / 2)
        .map(|i| (theta as f32).powf((2 * i) as f32 / rotary_dim as f32))
        .collect();
    let Some(y) = yarn else {
        return pos_freqs.iter().map(|&p| 1.0 / p).collect();
    };
    let (low, high) = y.correction_range(rotary_dim, theta);
    let high = if low == high { high + 0.001 } else { high };
    let (low32, span32) = (low as f32, (high - low) as f32);
    let factor = y.factor as f32;
    pos_freqs
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let extrapolation = 1.0 / p;
            let interpolation = 1.0 / (factor * p);
            let ramp = ((i as f32 - low32) / span32).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            interpolation * (1.0 - keep) + extrapolation * keep
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(factor: f64, original: usize) -> Yarn {
        Yarn {
            factor,
            original_max_position_embeddings: original,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: None,
            truncate: true,
        }
    }

    fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            // Within one unit in the last place: torch's vectorised pow and
            // the C library's powf may round the power's last bit apart.
            let ulps = (i64::from(g.to_bits()) - i64::from(w.to_bits())).abs();
            assert!(ulps <= 1, "{what}[{i}]: {g:e} against transformers' {w:e}");
        }
    }

    // The expected values below were printed by transformers 5.17's
    // `_compute_yarn_parameters` (torch 2.11, CPU, float32), for the
    // configurations named in each test.

    /// DeepSeek-V3's rope: qk_rope_head_dim 64, θ 10000, factor 40 over
    /// 4096 positions, mscale = mscale_all_dim = 1.
    #[test]
    fn deepseek_v3_yarn_matches_transformers() {
        let y = Yarn {
            mscale: Some(1.0),
            mscale_all_dim: Some(1.0),
            ..yarn(40.0, 4096)
        };
        assert_eq!(y.attention_factor(), 1.0);
        assert_bits(
            "deepseek_v3",
            &inv_frequencies(64, 10_000.0, Some(&y)),
            &DEEPSEEK_V3,
        );
        // Without mscale_all_dim the factor is get_mscale(40).
        assert!((yarn(40.0, 4096).attention_factor() - 1.368_887_945_411_393_6).abs() < 1e-12);
        // The softmax-scale correction DeepSeek-V3's attention applies.
        assert!((get_mscale(40.0, 1.0) - 1.368_887_945_411_393_6).abs() < 1e-12);
    }

    /// gpt-oss' rope: head_dim 64, θ 150000, factor 32 over 4096 positions,
    /// truncate false.
    #[test]
    fn gpt_oss_yarn_matches_transformers() {
        let y = Yarn {
            truncate: false,
            ..yarn(32.0, 4096)
        };
        assert!((y.attention_factor() - 1.346_573_590_279_972_7).abs() < 1e-12);
        assert_bits(
            "gpt_oss",
            &inv_frequencies(64, 150_000.0, Some(&y)),
            &GPT_OSS,
        );
    }

    /// Partial rotary (24 of 40 dims), factor 4 over 32768 positions, an
    /// explicit attention factor, and mscale without mscale_all_dim.
    #[test]
    fn partial_yarn_matches_transformers() {
        let y = Yarn {
            beta_fast: 16.0,
            beta_slow: 2.0,
            mscale: Some(0.707),
            ..yarn(4.0, 32768)
        };
        assert!((y.attention_factor() - 1.138_629_436_111_989).abs() < 1e-12);
        let explicit = Yarn {
            attention_factor: Some(0.5),
            ..y
        };
        assert_eq!(explicit.attention_factor(), 0.5);
        assert_bits(
            "partial",
            &inv_frequencies(24, 1_000_000.0, Some(&y)),
            &PARTIAL,
        );
    }

    #[test]
    fn plain_rope_is_one_over_theta_powers() {
        let f = inv_frequencies(8, 10_000.0, None);
        assert_eq!(f[0], 1.0);
        for (g, w) in f.iter().zip([1.0f32, 0.1, 0.01, 0.001]) {
            assert!((g - w).abs() <= 1e-6 * w, "{g} against {w}");
        }
    }

    const DEEPSEEK_V3: [f32; 32] = [
        1.0,
        0.7498942,
        0.56234133,
        0.4216965,
        0.31622776,
        0.23713736,
        0.17782794,
        0.13335215,
        0.1,
        0.074989416,
        0.05623413,
        0.039006926,
        0.02687936,
        0.018378144,
        0.012447956,
        0.008334509,
        0.0055000004,
        0.0035619973,
        0.0022493652,
        0.0013705135,
        0.0007905694,
        0.0004149904,
        0.00017782794,
        3.3338034e-05,
        2.5e-05,
        1.8747354e-05,
        1.40585325e-05,
        1.0542412e-05,
        7.9056945e-06,
        5.9284343e-06,
        4.4456983e-06,
        3.3338035e-06,
    ];
    const GPT_OSS: [f32; 32] = [
        1.0,
        0.6890443,
        0.47478205,
        0.32714587,
        0.225418,
        0.15532298,
        0.107024424,
        0.073744565,
        0.050813273,
        0.031705696,
        0.019335,
        0.011592049,
        0.0067949593,
        0.003860359,
        0.0020937927,
        0.0010526022,
        0.00045648392,
        0.0001293187,
        3.830881e-05,
        2.6396468e-05,
        1.8188337e-05,
        1.253257e-05,
        8.635496e-06,
        5.9502395e-06,
        4.0999785e-06,
        2.8250668e-06,
        1.9465963e-06,
        1.341291e-06,
        9.2420896e-07,
        6.368209e-07,
        4.3879785e-07,
        3.0235114e-07,
    ];
    const PARTIAL: [f32; 12] = [
        1.0,
        0.31622776,
        0.099999994,
        0.03162278,
        0.009999999,
        0.003162278,
        0.00062500004,
        7.905696e-05,
        2.4999992e-05,
        7.905694e-06,
        2.5000008e-06,
        7.9056923e-07,
    ];
}
