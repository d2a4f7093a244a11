use half::f16;
use safetensors::tensor::Dtype;

use super::decode::e4m3_to_f32;
use super::*;
use crate::convert::view::Store;
use crate::quant::{DType, EncodedRows};

#[test]
fn e4m3_values() {
    assert_eq!(e4m3_to_f32(0x00), 0.0);
    assert_eq!(e4m3_to_f32(0x38), 1.0);
    assert_eq!(e4m3_to_f32(0xb8), -1.0);
    assert_eq!(e4m3_to_f32(0x7e), 448.0);
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
    assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
}

/// An MLX 4-bit matrix whose scales are f16: copied when they are
/// exact in bf16, re-quantized otherwise.
#[test]
fn mlx_f16_scales_are_copied_only_when_exact() {
    use safetensors::tensor::TensorView;
    let dir = tempfile::tempdir().unwrap();
    for (scale, exact) in [(0.5f32, true), (1.0 + 2f32.powi(-10), false)] {
        let codes = vec![0x21u8; 2 * 32];
        let scales = f16::from_f32(scale).to_le_bytes().repeat(2);
        let biases = f16::from_f32(-1.0).to_le_bytes().repeat(2);
        let tensors = [
            (
                "m.weight",
                TensorView::new(Dtype::U32, vec![2, 8], &codes).unwrap(),
            ),
            (
                "m.scales",
                TensorView::new(Dtype::F16, vec![2, 1], &scales).unwrap(),
            ),
            (
                "m.biases",
                TensorView::new(Dtype::F16, vec![2, 1], &biases).unwrap(),
            ),
        ];
        let bytes = safetensors::serialize(tensors, None).unwrap();
        std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
        let config = serde_json::json!({"quantization": {"bits": 4, "group_size": 64}});
        let (source, index) = open(dir.path(), &config).unwrap();
        assert_eq!(index.tensors["m.weight"].shape, vec![2, 64]);
        let ckpt = &source.store;
        assert!(ckpt.stored_as("m.weight", DType::Q4));
        let mut enc = EncodedRows::default();
        assert_eq!(
            ckpt.append_encoded_row("m.weight", 1, 64, &mut enc)
                .unwrap(),
            exact
        );
        let mut values = Vec::new();
        ckpt.read_elements("m.weight", 64, 3, &mut values).unwrap();
        let s = f16::from_f32(scale).to_f32();
        assert_eq!(values, vec![s - 1.0, 2.0 * s - 1.0, s - 1.0]);
    }
}

#[test]
fn shared_views_keep_rows_apart() {
    let mut stored = BTreeMap::new();
    stored.insert(
        "model.layers.0.mlp.switch_mlp.up_proj.weight".to_string(),
        Stored {
            shard: 0,
            shape: vec![3, 4, 64],
            encoding: Encoding::Plain,
        },
    );
    let views = hf_views(&stored);
    let v = &views["model.layers.0.mlp.experts.2.up_proj.weight"];
    assert_eq!((v.shape.clone(), v.row_offset), (vec![4, 64], 8));
    assert_eq!(views.len(), 3);
}
