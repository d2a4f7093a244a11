//! gpt-oss (`gpt_oss`: gpt-oss-20b, gpt-oss-120b): GQA attention with q/k/v/o
//! biases, a learned sink logit per head, no q/k norm, sliding-window and
//! full layers alternating (`layer_types`); every layer MoE, the router with
//! a bias choosing by logit and weighing by the softmax of the chosen; experts
//! with biases and the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`, `up +
//! 1`), their gate and up projections fused in alternating columns.

use crate::arch::qwen3_moe::common_tensors;
use crate::arch::{Architecture, names};
use crate::config::{
    AttentionConfig, ConfigReader, ExpertActivation, FeedForwardKind, LayerKind, LayerSpec,
    ModelConfig, MoeConfig, NormStyle, RouterSpec, ScoreFunction,
};
use crate::convert::plan::{CheckpointIndex, ColumnPick, ConversionPlan, PlanBuilder, TensorRole};
use crate::error::Result;

/// transformers' default `swiglu_alpha` (the Hub configs omit it).
const DEFAULT_SWIGLU_ALPHA: f64 = 1.702;

pub(super) fn parse_config(c: &ConfigReader<'_>) -> Result<ModelConfig> {
    let hidden_size = c.usize("hidden_size")?;
    let num_heads = c.usize("num_attention_heads")?;
    let head_dim = match c.opt_usize("head_dim")? {
        Some(d) => d,
        None if num_heads > 0 => hidden_size / num_heads,
        None => 0,
    };
    let rope = c.rope(1.0)?;
    let num_layers = c.usize("num_hidden_layers")?;
    let kinds = match c.str_list("layer_types")? {
        // transformers' default: sliding first, then alternating.
        None => (0..num_layers)
            .map(|i| match i % 2 {
                0 => LayerKind::SlidingAttention,
                _ => LayerKind::FullAttention,
            })
            .collect(),
        Some(types) => {
            if types.len() != num_layers {
                return Err(c.error(format!(
                    "`layer_types` lists {} layers, num_hidden_layers is {num_layers}",
                    types.len()
                )));
            }
            types
                .iter()
                .map(|t| match *t {
                    "sliding_attention" => Ok(LayerKind::SlidingAttention),
                    "full_attention" => Ok(LayerKind::FullAttention),
                    other => Err(c.error(format!(
                        "`layer_types` entry `{other}` is not `sliding_attention` or `full_attention`"
                    ))),
                })
                .collect::<Result<Vec<_>>>()?
        }
    };
    let top_k = match c.opt_usize("num_experts_per_tok")? {
        Some(k) => k,
        None => c.usize_or("experts_per_token", 0)?,
    };
    let bias = c.bool_or("attention_bias", true)?;
    let limit = c.opt_f64("swiglu_limit")?.unwrap_or(7.0);
    let alpha = c.opt_f64("swiglu_alpha")?.unwrap_or(DEFAULT_SWIGLU_ALPHA);
    if !(limit > 0.0 && alpha.is_finite()) {
        return Err(c.error(format!(
            "swiglu_limit ({limit}) must be positive and swiglu_alpha ({alpha}) finite"
        )));
    }
    Ok(ModelConfig {
        architecture: Architecture::GptOss,
        vocab_size: c.usize("vocab_size")?,
        hidden_size,
        rms_norm_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-5) as f32,
        norm: NormStyle::Weight,
        tie_word_embeddings: c.bool_or("tie_word_embeddings", false)?,
        max_position_embeddings: c.usize_or("max_position_embeddings", 131072)?,
        attention: AttentionConfig {
            qkv_bias: bias,
            o_bias: bias,
            sinks: true,
            sliding_window: Some(c.usize_or("sliding_window", 128)?),
            ..super::grouped_query_attention(c, num_heads, head_dim, &rope)?
        },
        mla: None,
        linear_attention: None,
        moe: MoeConfig {
            num_experts: c.num_experts()?,
            expert_intermediate_size: c.usize("intermediate_size")?,
            router: RouterSpec {
                score: ScoreFunction::SoftmaxOfChosen,
                ..RouterSpec::softmax(top_k, false)
            },
            shared_expert: None,
            router_bias: true,
            expert_bias: true,
            expert_activation: ExpertActivation::ClampedSwiGlu {
                limit: limit as f32,
                alpha: alpha as f32,
            },
        },
        dense_intermediate_size: None,
        mtp: None,
        layers: kinds
            .into_iter()
            .map(|kind| LayerSpec {
                kind,
                ffn: FeedForwardKind::Moe,
            })
            .collect(),
    })
}

pub(super) fn conversion_plan(cfg: &ModelConfig, ckpt: &CheckpointIndex) -> Result<ConversionPlan> {
    let mut b = PlanBuilder::new(ckpt);
    let p = "model.";
    common_tensors(&mut b, cfg, p)?;
    let a = &cfg.attention;
    let moe = &cfg.moe;
    let (h, q_dim, kv_dim) = (
        cfg.hidden_size,
        a.num_heads * a.head_dim,
        a.num_kv_heads * a.head_dim,
    );
    let (e, inter) = (moe.num_experts, moe.expert_intermediate_size);
    for i in 0..cfg.num_layers() {
        let hf = |t: &str| format!("{p}layers.{i}.{t}");
        let canon = |t: &str| names::layer(i, t);
        let m = TensorRole::Matrix;
        for (proj, bias, rows, cols, canon_w, canon_b) in [
            (
                "q_proj",
                a.qkv_bias,
                q_dim,
                h,
                names::ATTN_Q,
                names::ATTN_Q_BIAS,
            ),
            (
                "k_proj",
                a.qkv_bias,
                kv_dim,
                h,
                names::ATTN_K,
                names::ATTN_K_BIAS,
            ),
            (
                "v_proj",
                a.qkv_bias,
                kv_dim,
                h,
                names::ATTN_V,
                names::ATTN_V_BIAS,
            ),
            (
                "o_proj",
                a.o_bias,
                h,
                q_dim,
                names::ATTN_O,
                names::ATTN_O_BIAS,
            ),
        ] {
            b.matrix(
                canon(canon_w),
                m,
                &hf(&format!("self_attn.{proj}.weight")),
                rows,
                cols,
            )?;
            if bias {
                b.vector(
                    canon(canon_b),
                    &hf(&format!("self_attn.{proj}.bias")),
                    &[rows],
                )?;
            }
        }
        b.vector(
            canon(names::ATTN_SINKS),
            &hf("self_attn.sinks"),
            &[a.num_heads],
        )?;
        b.matrix(
            canon(names::MOE_ROUTER),
            TensorRole::Router,
            &hf("mlp.router.weight"),
            e,
            h,
        )?;
        b.vector(canon(names::MOE_ROUTER_BIAS), &hf("mlp.router.bias"), &[e])?;
        let experts = hf("mlp.experts.");
        // The Hub's checkpoints store the experts in MXFP4 (dequantized as
        // read); transformers' save_pretrained writes them in bf16.
        if !ckpt.synthetic && ckpt.get(&format!("{experts}gate_up_proj_blocks")).is_some() {
            b.experts_interleaved_rows(i, &experts, e, h, inter)?;
        } else {
            b.experts_transposed_interleaved(i, &experts, e, h, inter)?;
        }
        let gate_up_bias = format!("{experts}gate_up_proj_bias");
        for (canonical, start) in [(names::EXPERTS_GATE_BIAS, 0), (names::EXPERTS_UP_BIAS, 1)] {
            b.vector_columns(
                canon(canonical),
                &gate_up_bias,
                [e, 2 * inter],
                ColumnPick { start, step: 2 },
            )?;
        }
        b.vector(
            canon(names::EXPERTS_DOWN_BIAS),
            &format!("{experts}down_proj_bias"),
            &[e, h],
        )?;
    }
    Ok(b.finish::<&str>(&[]))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use crate::backend::KvType;
    use crate::config::{ExpertActivation, LayerKind, ModelConfig, ScoreFunction};

    fn config(overrides: serde_json::Value) -> crate::error::Result<ModelConfig> {
        let mut c = json!({
            "model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
            "intermediate_size": 64, "sliding_window": 8, "swiglu_limit": 1.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}
        });
        for (k, v) in overrides.as_object().unwrap() {
            c[k] = v.clone();
        }
        ModelConfig::from_hf_json(&c, Path::new("config.json"))
    }

    #[test]
    fn layers_alternate_and_the_window_bounds_their_kv_cache() {
        let c = config(json!({})).unwrap();
        let kinds: Vec<_> = c.layers.iter().map(|l| l.kind).collect();
        use LayerKind::{FullAttention as F, SlidingAttention as S};
        assert_eq!(kinds, [S, F, S, F], "transformers' default layer_types");
        let a = &c.attention;
        assert!(a.sinks && a.qkv_bias && a.o_bias && !a.qk_norm);
        assert_eq!(c.moe.router.score, ScoreFunction::SoftmaxOfChosen);
        assert!(c.moe.router_bias && c.moe.expert_bias);
        assert_eq!(
            c.moe.expert_activation,
            ExpertActivation::ClampedSwiGlu {
                limit: 1.5,
                alpha: 1.702
            }
        );
        // Two full layers: keys and values of 2 heads of 32, f32; bf16
        // half of it; q8 a byte a value and an f32 scale per 32.
        assert_eq!(c.kv_bytes_per_position(KvType::F32), 2 * 2 * 64 * 4);
        assert_eq!(c.kv_bytes_per_position(KvType::Bf16), 2 * 2 * 64 * 2);
        assert_eq!(c.kv_bytes_per_position(KvType::Q8), 2 * 2 * (64 + 2 * 4));
        // Two sliding layers hold at most the 7 positions before a query.
        assert_eq!(c.kv_bytes_of_windows(KvType::F32), 2 * 2 * 64 * 4 * 7);
        assert_eq!(c.kv_bytes_of_windows(KvType::Bf16), 2 * 2 * 64 * 2 * 7);
        let full = config(json!({"layer_types": ["full_attention", "full_attention", "full_attention", "full_attention"]})).unwrap();
        assert_eq!(full.kv_bytes_of_windows(KvType::F32), 0);
    }

    #[test]
    fn bad_layer_types_are_named() {
        let short = config(json!({"layer_types": ["full_attention"]})).unwrap_err();
        assert!(short.to_string().contains("lists 1 layers"), "{short}");
        let odd =
            config(json!({"layer_types": ["full_attention", "chunked", "a", "b"]})).unwrap_err();
        assert!(odd.to_string().contains("`chunked`"), "{odd}");
        let limit = config(json!({"swiglu_limit": 0.0})).unwrap_err();
        assert!(limit.to_string().contains("swiglu_limit"), "{limit}");
    }
}
