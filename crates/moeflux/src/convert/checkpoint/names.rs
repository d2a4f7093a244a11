//! MLX's tensor names and layouts mapped back to Hugging Face's.

use std::collections::BTreeMap;

use super::Stored;
use crate::convert::view::{Op, View};

/// Hugging Face names for the stored tensors: MLX's names and layouts
/// mapped back, every other tensor as it is.
pub(super) fn hf_views(stored: &BTreeMap<String, Stored>) -> BTreeMap<String, View> {
    let mut views = BTreeMap::new();
    // MLX's sanitised Qwen3-Next / Qwen3.5 checkpoints store the
    // convolution as [channels, kernel, 1] and the `1 + w` norms shifted.
    let mut mlx_layout = false;
    for (name, t) in stored {
        let hf = if let Some(rest) = name.strip_prefix("language_model.model.") {
            format!("model.language_model.{rest}")
        } else if let Some(rest) = name.strip_prefix("language_model.lm_head.") {
            format!("lm_head.{rest}")
        } else if let Some(rest) = name.strip_prefix("vision_tower.") {
            format!("model.visual.{rest}")
        } else {
            name.clone()
        };
        if hf.contains(".mlp.switch_mlp.")
            && let [experts, rows, cols] = t.shape[..]
        {
            for e in 0..experts {
                let mut v = View::of(name, vec![rows, cols]);
                v.row_offset = e * rows;
                views.insert(hf.replace(".switch_mlp.", &format!(".experts.{e}.")), v);
            }
            continue;
        }
        if hf.ends_with("conv1d.weight")
            && let [channels, kernel, 1] = t.shape[..]
            && kernel > 1
        {
            mlx_layout = true;
            views.insert(hf, View::of(name, vec![channels, 1, kernel]));
            continue;
        }
        views.insert(hf, View::of(name, t.shape.clone()));
    }
    if mlx_layout {
        const SHIFTED: [&str; 5] = [
            ".input_layernorm.weight",
            ".post_attention_layernorm.weight",
            "model.norm.weight",
            ".q_norm.weight",
            ".k_norm.weight",
        ];
        for (name, v) in views.iter_mut() {
            if v.shape.len() == 1 && SHIFTED.iter().any(|s| name.ends_with(s)) {
                v.op = Op::MinusOne;
            }
        }
    }
    views
}
