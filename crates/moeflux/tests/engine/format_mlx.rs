//! MLX-quantized safetensors (mlx-community's affine 4- and 8-bit groups):
//! fixtures/formats/mlx_qwen3_5_moe is fixtures/qwen3_5_moe written the
//! way `mlx_lm.convert -q` writes it, mx.quantize reproduced in numpy by
//! tools/make_format_fixtures.py (MLX does not run on Linux x86).

use crate::common::{Reference, fixtures_root};
use crate::format_support::*;
use moeflux::convert::Input;
use moeflux::quant::DType;

fn mlx_dir() -> std::path::PathBuf {
    formats_root().join("mlx_qwen3_5_moe")
}

fn mlx_file() -> std::path::PathBuf {
    mlx_dir().join("model.safetensors")
}

/// The weights read from the MLX checkpoint (under their Hugging Face
/// names) equal numpy's `q * scale + bias` in f32, to the bit.
#[test]
fn mlx_weights_dequantize_as_the_numpy_reference() {
    let input = Input::open(&mlx_dir()).unwrap();
    let reference = mlx_dir().join("reference.safetensors");
    for (mlx, hf) in [
        (
            "language_model.model.layers.0.linear_attn.in_proj_qkv.weight",
            "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
        ),
        (
            "language_model.model.layers.0.mlp.gate.weight",
            "model.language_model.layers.0.mlp.gate.weight",
        ),
        (
            "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight",
            "model.language_model.layers.0.mlp.experts.0.gate_proj.weight",
        ),
        (
            "language_model.model.layers.3.self_attn.o_proj.weight",
            "model.language_model.layers.3.self_attn.o_proj.weight",
        ),
    ] {
        let (_, want) = raw_tensor(&reference, mlx);
        let got = input.read(hf).unwrap();
        // The reference holds the first two rows (of a stacked expert
        // tensor, the first two experts).
        let want = f32s(&want);
        let n = want.len().min(got.len());
        assert_ulps(hf, &got[..n], &want[..n], 0);
    }
    // The norms MLX stores as 1 + w come back as w, bit for bit.
    let original = Input::open(&fixtures_root().join("qwen3_5_moe").join("hf")).unwrap();
    for (mlx_name, hf_name) in [
        (
            "model.language_model.layers.0.input_layernorm.weight",
            "model.layers.0.input_layernorm.weight",
        ),
        (
            "model.language_model.layers.3.self_attn.q_norm.weight",
            "model.layers.3.self_attn.q_norm.weight",
        ),
        (
            "model.language_model.layers.0.linear_attn.conv1d.weight",
            "model.layers.0.linear_attn.conv1d.weight",
        ),
    ] {
        let got = input.read(mlx_name).unwrap();
        let want = original.read(hf_name).unwrap();
        // MLX rounds 1 + w to bf16: w comes back within bf16's rounding
        // of 1 + w (2^-8), exactly when w needs no more bits.
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 2f32.powi(-8), "{mlx_name}: {g} vs {w}");
        }
    }
}

/// MLX 4-bit groups of 64 become moeflux q4 without re-quantization: the
/// stored codes, scales and biases are MLX's bytes. The 8-bit router
/// becomes q8 the same way; the 8-bit groups of 32 are re-quantized, and
/// the conversion says so.
#[test]
fn mlx_4bit_groups_are_stored_byte_for_byte() {
    let converted = convert_as(&mlx_dir(), DType::Q4, false);
    let raw = |name: &str| raw_tensor(&mlx_file(), name).1;
    let layer0 = "language_model.model.layers.0";

    // Gated DeltaNet input projection: rows of in_proj_qkv, z, b, a.
    let (layout, bytes) = dense_tensor(&converted.dir, "layers.0.linear_attn.in_proj");
    assert_eq!(layout.dtype, DType::Q4);
    let (codes, scales, biases) = sections(&layout, &bytes);
    let parts = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"];
    let concat = |suffix: &str| -> Vec<u8> {
        parts
            .iter()
            .flat_map(|p| raw(&format!("{layer0}.linear_attn.{p}.{suffix}")))
            .collect()
    };
    assert!(codes == concat("weight"), "in_proj codes differ");
    assert!(scales == concat("scales"), "in_proj scales differ");
    assert!(biases == concat("biases"), "in_proj biases differ");

    // Routed expert 3's gate, from the stacked switch_mlp tensor.
    let (layout, bytes) = expert_tensor(&converted.dir, 0, 3, 0);
    assert_eq!(layout.dtype, DType::Q4);
    let (codes, scales, biases) = sections(&layout, &bytes);
    let expert = |suffix: &str| {
        let all = raw(&format!("{layer0}.mlp.switch_mlp.gate_proj.{suffix}"));
        let n = all.len() / 8;
        all[3 * n..4 * n].to_vec()
    };
    assert!(codes == expert("weight"), "expert codes differ");
    assert!(scales == expert("scales"), "expert scales differ");
    assert!(biases == expert("biases"), "expert biases differ");

    // The 8-bit router is stored q8 (routers keep at least 8 bits), copied.
    let (layout, bytes) = dense_tensor(&converted.dir, "layers.0.moe.router");
    assert_eq!(layout.dtype, DType::Q8);
    let (codes, scales, biases) = sections(&layout, &bytes);
    assert!(codes == raw(&format!("{layer0}.mlp.gate.weight")));
    assert!(scales == raw(&format!("{layer0}.mlp.gate.scales")));
    assert!(biases == raw(&format!("{layer0}.mlp.gate.biases")));

    let notes = converted.summary.notes.join("\n");
    println!("{notes}");
    assert!(
        notes.contains("MLX 4-bit groups of 64: copied into q4 bit for bit"),
        "{notes}"
    );
    assert!(
        notes.contains("MLX 8-bit groups of 64: copied into q8 bit for bit"),
        "{notes}"
    );
    assert!(
        notes.contains("1 tensor(s) in MLX 8-bit groups of 32: dequantized and re-quantized to q4"),
        "{notes}"
    );
    assert!(
        converted.summary.unknown.is_empty(),
        "{:?}",
        converted.summary.unknown
    );
}

/// keep-nearest stores MLX's 4-bit matrices as q4 and its 8-bit ones as q8.
#[test]
fn mlx_keep_nearest_follows_the_stored_bits() {
    let converted = convert_as(&mlx_dir(), DType::Bf16, true);
    let m = manifest(&converted.dir);
    assert_eq!(m.quantization, DType::Q4);
    assert_eq!(m.tensors["layers.0.linear_attn.in_proj"].dtype, DType::Q4);
    assert_eq!(m.tensors["layers.3.attn.o_proj"].dtype, DType::Q8);
    assert_eq!(m.tensors["layers.0.linear_attn.conv1d"].dtype, DType::F32);
}

/// Logits of the MLX checkpoint converted to q4 (its own codes) against the
/// bf16 conversion of the original fixture: the difference is MLX's 4-bit
/// quantization, the same order as moeflux's own q4 (the transformers
/// tests measure 1.6e-1 to 2.1e-1 for q4 against the unquantized models,
/// at a routing flip): bound 3.5e-1 (measured 2.1e-1), and the same top-1 token at 70% of
/// the positions at least (measured 82%).
#[test]
fn mlx_logits_are_close_to_the_bf16_fixture() {
    let name = "qwen3_5_moe";
    let reference = Reference::load(name);
    let tokens = reference.tokens("tokens_long");
    let (_, vocab, _) = reference.logits("logits_long");
    let original = convert_as(&fixtures_root().join(name).join("hf"), DType::Bf16, false);
    let want = logits(&original.dir, &tokens);
    let mlx = convert_as(&mlx_dir(), DType::Q4, false);
    let got = logits(&mlx.dir, &tokens);
    let err = max_row_error(&got, &want, vocab);
    let top1 = crate::common::top1_agreement(&got, &want, vocab);
    println!(
        "mlx q4 vs bf16 fixture: max rel err {err:.3e}, top-1 {:.0}%",
        top1 * 100.0
    );
    assert!(err <= 3.5e-1, "MLX logits: relative error {err:.3e}");
    assert!(top1 >= 0.7, "MLX logits: top-1 agreement {top1}");
}
