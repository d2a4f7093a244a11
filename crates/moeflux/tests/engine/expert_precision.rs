//! The per-role precision of `convert`: routed experts at
//! `--expert-quant`, everything else at `--quant`, routers at 8 bits or
//! more, and the options refused where the converter writes no such type.

use crate::common::{convert_fixture_with, fixtures_root};
use moeflux::convert::{ConvertOptions, convert};
use moeflux::format::{MANIFEST_FILE, Manifest};
use moeflux::quant::DType;
use moeflux::util::NoProgress;

fn manifest(dir: &std::path::Path) -> Manifest {
    Manifest::read(&dir.join(MANIFEST_FILE)).unwrap()
}

/// q2 and q3 experts beside q8 and q4: the experts take their width, the
/// attention, the shared expert and the rest the other, the router and the
/// shared-expert gate at least q8; the manifest's `quantization` names the
/// experts' width (most of the weights), and the model runs.
#[test]
fn experts_and_the_rest_take_their_own_precisions() {
    for (rest, experts) in [(DType::Q8, DType::Q2), (DType::Q4, DType::Q3)] {
        let converted = convert_fixture_with("qwen3_5_moe", rest, experts);
        let m = manifest(&converted.dir);
        let layer = m.experts[0].layer;
        for matrix in [
            &m.experts[0].blob.gate,
            &m.experts[0].blob.up,
            &m.experts[0].blob.down,
        ] {
            assert_eq!(matrix.dtype, experts);
        }
        let dense = |name: &str| m.tensors[&format!("layers.{layer}.{name}")].dtype;
        assert_eq!(dense("moe.shared_expert.down_proj"), rest);
        assert_eq!(dense("linear_attn.in_proj"), rest);
        assert_eq!(dense("moe.router"), DType::Q8);
        assert_eq!(dense("moe.shared_expert_gate"), DType::Q8);
        assert_eq!(m.quantization, experts, "the experts hold most weights");
        let model = crate::common::open(&converted.dir, moeflux::ModelOptions::default());
        let logits = model
            .session()
            .forward(&[1, 2, 3], moeflux::LogitsWanted::All)
            .unwrap();
        assert!(logits.data.iter().all(|v| v.is_finite()));
    }
}

/// Precisions the converter does not write are refused, naming the option.
#[test]
fn unwritable_precisions_are_refused() {
    let input = fixtures_root().join("qwen3_moe").join("hf");
    let tmp = tempfile::tempdir().unwrap();
    for (options, flag) in [
        (
            ConvertOptions {
                quant: DType::Q2,
                ..ConvertOptions::default()
            },
            "--quant",
        ),
        (
            ConvertOptions {
                quant: DType::Mxfp4,
                ..ConvertOptions::default()
            },
            "--quant",
        ),
        (
            ConvertOptions {
                expert_quant: Some(DType::F32),
                ..ConvertOptions::default()
            },
            "--expert-quant",
        ),
    ] {
        let output = tmp.path().join("model");
        let err = convert(&input, &output, &options, &NoProgress)
            .expect_err("refused")
            .to_string();
        assert!(err.contains(flag), "{err}");
        assert!(!output.exists());
    }
}
