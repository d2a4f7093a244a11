//! The precision of each matrix: the one asked (one for the routed experts
//! and one for the rest, or the nearest to how the input stores it) and
//! the one stored.

use super::plan::{ConversionPlan, TensorRole};
use super::{ConvertOptions, SourceOptions, TensorSource};
use crate::quant::{DType, GROUP_SIZE};

/// The precision asked of each matrix of a plan (before
/// `storage_dtype`'s rules for routers and odd sizes).
pub(crate) struct Dtypes {
    pub(super) dense: Vec<DType>,
    pub(super) experts: Vec<[DType; 3]>,
    /// The manifest's `quantization`: the precision of most weights.
    pub(super) label: DType,
}

impl Dtypes {
    /// The routed experts at `options.experts()`, every other matrix at
    /// `options.quant`.
    pub(super) fn recipe(plan: &ConversionPlan, options: &ConvertOptions) -> Dtypes {
        let (quant, experts) = (options.quant, options.experts());
        let dense: usize = plan.dense.iter().map(|t| t.rows * t.cols).sum();
        let routed: usize = plan
            .experts
            .iter()
            .map(|l| 3 * l.num_experts * l.hidden * l.intermediate)
            .sum();
        Dtypes {
            dense: vec![quant; plan.dense.len()],
            experts: vec![[experts; 3]; plan.experts.len()],
            label: if routed > dense { experts } else { quant },
        }
    }

    pub(super) fn choose(
        plan: &ConversionPlan,
        source: &dyn TensorSource,
        options: &ConvertOptions,
        source_options: &SourceOptions,
    ) -> Dtypes {
        if !source_options.keep_nearest {
            return Dtypes::recipe(plan, options);
        }
        // Experts may go below 4 bits; an explicit expert precision wins.
        let nearest_expert = |tensor: &str| match (options.expert_quant, source.stored_bits(tensor))
        {
            (Some(d), _) => d,
            (None, Some(bits)) => nearest_dtype(bits, true),
            (None, None) => options.quant,
        };
        let mut weights: std::collections::BTreeMap<&'static str, (u64, DType)> =
            Default::default();
        let mut count = |d: DType, n: usize| {
            weights.entry(d.name()).or_insert((0, d)).0 += n as u64;
        };
        let dense: Vec<DType> = plan
            .dense
            .iter()
            .map(|t| {
                // An assembled tensor: the mean of its sources, by rows.
                let (mut bits, mut rows) = (0.0, 0);
                for s in &t.sources {
                    if let Some(b) = source.stored_bits(&s.tensor) {
                        bits += b * s.rows as f64;
                        rows += s.rows;
                    }
                }
                let d = if rows == 0 {
                    options.quant
                } else {
                    nearest_dtype(bits / rows as f64, false)
                };
                if t.role != TensorRole::Vector {
                    count(d, t.rows * t.cols);
                }
                d
            })
            .collect();
        let experts: Vec<[DType; 3]> = plan
            .experts
            .iter()
            .map(|l| {
                let ds = [&l.gate, &l.up, &l.down].map(|m| nearest_expert(&m.source(0, 1).tensor));
                for d in ds {
                    count(d, l.num_experts * l.hidden * l.intermediate);
                }
                ds
            })
            .collect();
        let label = weights
            .values()
            .max_by_key(|(n, _)| *n)
            .map_or(options.quant, |(_, d)| *d);
        Dtypes {
            dense,
            experts,
            label,
        }
    }
}

/// The moeflux matrix type closest in size to `bits` per weight (q4 is 4.5
/// bits with its scales, q8 8.5, bf16 16; for routed experts also MXFP4 at
/// 4.25, so gpt-oss's experts stay as they are, q3 at 3.5 and q2 at 2.5);
/// ties go to the larger type.
fn nearest_dtype(bits: f64, expert: bool) -> DType {
    let low: &[(DType, f64)] = if expert {
        &[(DType::Mxfp4, 4.25), (DType::Q3, 3.5), (DType::Q2, 2.5)]
    } else {
        &[]
    };
    [(DType::Bf16, 16.0), (DType::Q8, 8.5), (DType::Q4, 4.5)]
        .into_iter()
        .chain(low.iter().copied())
        .min_by(|a, b| (a.1 - bits).abs().total_cmp(&(b.1 - bits).abs()))
        .map(|(d, _)| d)
        .expect("candidates")
}

/// The stored type of a canonical tensor.
pub(super) fn storage_dtype(role: TensorRole, cols: usize, quant: DType) -> DType {
    let dtype = match role {
        TensorRole::Vector => return DType::F32,
        TensorRole::Router if quant.bits().is_some_and(|b| b < 8) => DType::Q8,
        _ => quant,
    };
    if dtype.is_quantized() && !cols.is_multiple_of(GROUP_SIZE) {
        DType::Bf16
    } else {
        dtype
    }
}
