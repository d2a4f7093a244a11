//! FP8 safetensors checkpoints (float8_e4m3fn weights with block-wise
//! `weight_scale_inv`, as DeepSeek-V3 and Qwen3-*-FP8 ship them):
//! fixtures/formats/fp8_qwen3_moe is fixtures/qwen3_moe_sparse_step
//! re-encoded by tools/make_format_fixtures.py with ml_dtypes.

use crate::common::{Reference, fixtures_root};
use crate::format_support::*;
use moeflux::convert::Input;
use moeflux::quant::DType;

fn fp8_dir() -> std::path::PathBuf {
    formats_root().join("fp8_qwen3_moe")
}

/// The weights read from the FP8 checkpoint equal ml_dtypes' dequantization
/// (e4m3 value times the block's scale, in f32): to the bit.
#[test]
fn fp8_weights_dequantize_as_ml_dtypes_does() {
    let input = Input::open(&fp8_dir()).unwrap();
    let reference = fp8_dir().join("reference.safetensors");
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.3.mlp.experts.down_proj",
    ] {
        let (_, want) = raw_tensor(&reference, name);
        let got = input.read(name).unwrap();
        assert_ulps(name, &got, &f32s(&want), 0);
    }
}

/// The scale tensors belong to their weights: nothing is left over, and
/// the converted config has no FP8 settings.
#[test]
fn fp8_scales_are_not_unknown_tensors() {
    let converted = convert_as(&fp8_dir(), DType::Bf16, false);
    assert!(
        converted.summary.unknown.is_empty(),
        "unknown: {:?}",
        converted.summary.unknown
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(converted.dir.join("config.json")).unwrap()).unwrap();
    assert!(config.get("quantization_config").is_none());
    assert!(
        manifest(&converted.dir)
            .config
            .get("quantization_config")
            .is_none()
    );
}

/// Logits of the FP8 checkpoint (stored bf16) against the bf16 conversion
/// of the original fixture. e4m3 keeps 3 mantissa bits: each weight is
/// rounded by up to 1/16 of itself (RMS ≈ 1/16/√3 ≈ 3.6%), errors
/// independent across a product's inputs, so each projection's output
/// moves by about 3.6% of its size, and the logits by as much (measured
/// 4.3e-2 at most over 80 positions): bound 8e-2. keep-nearest stores the
/// FP8 matrices as q8, adding q8's own error (bounded by 3e-2 in the
/// transformers tests): bound 1e-1.
#[test]
fn fp8_logits_are_close_to_the_bf16_fixture() {
    let name = "qwen3_moe_sparse_step";
    let reference = Reference::load(name);
    let tokens = reference.tokens("tokens_long");
    let (_, vocab, _) = reference.logits("logits_long");
    let original = convert_as(&fixtures_root().join(name).join("hf"), DType::Bf16, false);
    let want = logits(&original.dir, &tokens);
    for (keep_nearest, quant, bound) in [(false, DType::Bf16, 8e-2), (true, DType::Q4, 1e-1)] {
        let fp8 = convert_as(&fp8_dir(), quant, keep_nearest);
        if keep_nearest {
            let m = manifest(&fp8.dir);
            assert_eq!(m.quantization, DType::Q8, "FP8 is nearest to q8");
            assert_eq!(m.tensors["layers.0.attn.q_proj"].dtype, DType::Q8);
            assert_eq!(m.tensors["embed_tokens"].dtype, DType::Bf16);
        }
        let got = logits(&fp8.dir, &tokens);
        let err = max_row_error(&got, &want, vocab);
        println!("fp8 (keep-nearest {keep_nearest}) vs bf16 fixture: max rel err {err:.4e}");
        assert!(
            err <= bound,
            "FP8 logits: relative error {err:.3e} > {bound:.0e}"
        );
    }
}
