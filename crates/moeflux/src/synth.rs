//! `moeflux synth`: model directories with the exact shapes of real models
//! and random weights, for measuring speed and streaming at full size
//! without downloading hundreds of gigabytes.
//!
//! The weights go through the converter's own write path (the same
//! quantization, layout, checksums and verification), generated on the fly
//! from a seeded hash of each tensor's name and row, so nothing is held in
//! memory and two runs produce identical files. The manifest marks the
//! model synthetic. A placeholder tokenizer names each id (`t0`, `t1`,
//! ...), so text commands and the server run on a synthetic model too.

use std::ops::Range;
use std::path::Path;

use half::bf16;

use serde_json::{Value, json};

use crate::config::{ModelConfig, NormStyle};
use crate::convert::plan::{CheckpointIndex, RowSource};
use crate::convert::{ConvertOptions, ConvertSummary, SideFiles, TensorSource, write_model};
use crate::error::{Error, Result};
use crate::quant::{DType, EncodedRows, MatrixLayout};
use crate::util::Progress;
use crate::util::SplitMix64;

/// A real model's shapes, as its Hugging Face `config.json`.
pub struct Preset {
    pub name: &'static str,
    pub description: &'static str,
    config: fn() -> Value,
}

pub const PRESETS: &[Preset] = &[
    Preset {
        name: "qwen3-30b-a3b",
        description: "Qwen3-30B-A3B: 48 layers, 128 experts top-8",
        config: || {
            json!({
                "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                "tie_word_embeddings": false, "hidden_act": "silu"
            })
        },
    },
    Preset {
        name: "qwen3-235b-a22b",
        description: "Qwen3-235B-A22B: 94 layers, 128 experts top-8",
        config: || {
            json!({
                "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096,
                "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                "tie_word_embeddings": false, "hidden_act": "silu"
            })
        },
    },
    Preset {
        name: "qwen3-next-80b-a3b",
        description: "Qwen3-Next-80B-A3B: 48 hybrid layers, 512 experts top-10 + shared",
        config: || {
            json!({
                "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
                "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                "head_dim": 256, "partial_rotary_factor": 0.25, "intermediate_size": 5120,
                "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": true,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "full_attention_interval": 4,
                "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "rope_theta": 10000000.0,
                "max_position_embeddings": 262144, "tie_word_embeddings": false,
                "hidden_act": "silu", "mtp_num_hidden_layers": 1
            })
        },
    },
    Preset {
        name: "qwen3.5-35b-a3b",
        description: "Qwen3.5-35B-A3B: 40 hybrid layers, 256 experts top-8 + shared",
        config: || qwen35(2048, 40, 16, 32, 256, 8, 512),
    },
    Preset {
        name: "qwen3.5-397b-a17b",
        description: "Qwen3.5-397B-A17B: 60 hybrid layers, 512 experts top-10 + shared",
        config: || qwen35(4096, 60, 32, 64, 512, 10, 1024),
    },
    Preset {
        name: "glm-4.5-355b",
        description: "GLM-4.5 (355B-A32B): 92 layers (3 dense), 160 experts top-8 + shared, q/k norm",
        config: || glm45(5120, 92, 12288, 1536, 160, 3, 2.5, true),
    },
    Preset {
        name: "glm-4.5-air",
        description: "GLM-4.5-Air (106B-A12B): 46 layers (1 dense), 128 experts top-8 + shared",
        config: || glm45(4096, 46, 10944, 1408, 128, 1, 1.0, false),
    },
    Preset {
        name: "deepseek-v3-671b",
        description: "DeepSeek-V3 / R1 (671B-A37B): 61 layers (3 dense), MLA, 256 experts top-8 + shared",
        config: || deepseek_v3(61, 128, 256, 8, 4, 3, 2.5, "deepseek_v3", 163840, 40.0),
    },
    Preset {
        name: "kimi-k2-1t",
        description: "Kimi K2 (1T-A32B): 61 layers (1 dense), MLA with 64 heads, 384 experts top-8 + shared",
        config: || deepseek_v3(61, 64, 384, 1, 1, 1, 2.827, "kimi_k2", 131072, 32.0),
    },
    Preset {
        name: "gpt-oss-120b",
        description: "gpt-oss-120b: 36 layers (sliding window and full alternating), 128 experts top-4",
        config: || gpt_oss(36, 128),
    },
    Preset {
        name: "gpt-oss-20b",
        description: "gpt-oss-20b: 24 layers (sliding window and full alternating), 32 experts top-4",
        config: || gpt_oss(24, 32),
    },
];

/// DeepSeek-V3's `config.json` (Kimi K2 is the same architecture): MLA with
/// a query rank of 1536, a latent of 512, heads of 128 + 64 rotary
/// features and values of 128; YaRN over 4096 positions.
#[allow(clippy::too_many_arguments)]
fn deepseek_v3(
    layers: usize,
    heads: usize,
    experts: usize,
    groups: usize,
    keep: usize,
    dense_layers: usize,
    scaling: f64,
    model_type: &str,
    context: usize,
    factor: f64,
) -> Value {
    json!({
        "model_type": model_type, "vocab_size": if model_type == "kimi_k2" { 163840 } else { 129280 },
        "hidden_size": 7168, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": heads, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": groups, "topk_group": keep,
        "first_k_dense_replace": dense_layers, "norm_topk_prob": true,
        "routed_scaling_factor": scaling, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "rms_norm_eps": 1e-6, "rope_theta": if model_type == "kimi_k2" { 50000.0 } else { 10000.0 },
        "max_position_embeddings": context,
        "rope_scaling": {"type": "yarn", "factor": factor, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "hidden_act": "silu"
    })
}

/// GLM-4.5's `config.json`: 96 query and 8 KV heads of 128 with q/k/v
/// biases and half-rotary heads; the sigmoid router with one group.
#[allow(clippy::too_many_arguments)]
fn glm45(
    hidden: usize,
    layers: usize,
    dense_inter: usize,
    expert_inter: usize,
    experts: usize,
    dense_layers: usize,
    scaling: f64,
    qk_norm: bool,
) -> Value {
    json!({
        "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": true,
        "use_qk_norm": qk_norm, "intermediate_size": dense_inter,
        "moe_intermediate_size": expert_inter, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": dense_layers, "norm_topk_prob": true,
        "routed_scaling_factor": scaling, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "max_position_embeddings": 131072, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": false, "hidden_act": "silu"
    })
}

/// openai/gpt-oss-120b's and gpt-oss-20b's `config.json`, which differ in
/// depth and expert count.
fn gpt_oss(layers: usize, experts: usize) -> Value {
    let layer_types: Vec<&str> = (0..layers)
        .map(|i| match i % 2 {
            0 => "sliding_attention",
            _ => "full_attention",
        })
        .collect();
    json!({
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "num_hidden_layers": layers, "layer_types": layer_types, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
        "num_local_experts": experts, "num_experts_per_tok": 4, "experts_per_token": 4,
        "sliding_window": 128, "attention_bias": true, "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5, "rope_theta": 150000, "initial_context_length": 4096,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": false,
                         "original_max_position_embeddings": 4096},
        "max_position_embeddings": 131072, "tie_word_embeddings": false, "hidden_act": "silu"
    })
}

fn qwen35(
    hidden: usize,
    layers: usize,
    heads: usize,
    value_heads: usize,
    experts: usize,
    top_k: usize,
    expert_inter: usize,
) -> Value {
    json!({
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 2,
        "head_dim": 256, "moe_intermediate_size": expert_inter,
        "shared_expert_intermediate_size": expert_inter, "num_experts": experts,
        "num_experts_per_tok": top_k, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": value_heads,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": false,
        "hidden_act": "silu", "mtp_num_hidden_layers": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": true}
    })
}

pub fn preset(name: &str) -> Result<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name).ok_or_else(|| {
        let names: Vec<_> = PRESETS.iter().map(|p| p.name).collect();
        Error::invalid(
            "--preset",
            format!(
                "unknown preset `{name}`; choose one of {}",
                names.join(", ")
            ),
        )
    })
}

/// The `config.json` keys that name a model's multi-token-prediction
/// layers.
const MTP_KEYS: [&str; 2] = ["mtp_num_hidden_layers", "num_nextn_predict_layers"];

/// The preset's `config.json`, keeping only the first `layers` layers when
/// given (so a large shape fits a small disk), with the model's
/// multi-token-prediction layer when `mtp` (an error for a preset whose
/// model has none).
pub fn preset_config(preset: &Preset, layers: Option<usize>, mtp: bool) -> Result<Value> {
    let mut config = (preset.config)();
    match MTP_KEYS.into_iter().find(|k| config.get(k).is_some()) {
        Some(key) => config[key] = usize::from(mtp).into(),
        None if mtp => {
            return Err(Error::invalid(
                "--mtp",
                format!(
                    "{} has no multi-token-prediction layer (the Qwen3-Next, Qwen3.5, GLM-4.5, \
                     DeepSeek-V3 and Kimi K2 presets have one)",
                    preset.name
                ),
            ));
        }
        None => {}
    }
    if let Some(n) = layers {
        let full = config["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
        if n == 0 || n > full {
            return Err(Error::invalid(
                "--layers",
                format!("must be between 1 and {full}"),
            ));
        }
        config["num_hidden_layers"] = n.into();
        if let Some(Value::Array(types)) = config.get_mut("layer_types") {
            types.truncate(n);
        }
    }
    Ok(config)
}

/// Writes a synthetic model directory for `config` (a preset's, possibly
/// cut to fewer layers).
pub fn synthesize(
    config: Value,
    output: &Path,
    options: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    let source_path = output.join("config.json");
    let cfg = ModelConfig::from_hf_json(&config, &source_path)?;
    let index = CheckpointIndex::synthetic(output);
    let plan = cfg.architecture.conversion_plan(&cfg, &index)?;
    let weights = RandomWeights {
        shapes: plan.source_shapes.clone(),
        norm: cfg.norm,
    };
    let tokenizer = placeholder_tokenizer(cfg.vocab_size);
    let side = SideFiles {
        dir: None,
        generated: &[(crate::format::TOKENIZER_FILE.to_string(), tokenizer)],
        synthetic: true,
    };
    write_model(
        &weights, plan, config, cfg, &side, output, options, progress,
    )
}

/// A word-level `tokenizer.json` over the whole vocabulary, id `i` the word
/// `t{i}`: text in and out works, and every generated token is visible
/// text, which the server's streamed chunks and their timing need.
fn placeholder_tokenizer(vocab_size: usize) -> Vec<u8> {
    let vocab: serde_json::Map<String, Value> = (0..vocab_size)
        .map(|i| (format!("t{i}"), Value::from(i)))
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": { "type": "WhitespaceSplit" },
        "post_processor": null,
        "decoder": null,
        "model": { "type": "WordLevel", "vocab": vocab, "unk_token": "t0" },
    });
    serde_json::to_vec(&tokenizer).expect("JSON values serialize")
}

/// Deterministic pseudo-random weights at scales that keep activations of
/// a deep random network finite: matrices uniform with unit-variance
/// outputs, norms near their identity, decay parameters in their usual
/// ranges.
struct RandomWeights {
    shapes: std::collections::BTreeMap<String, Vec<usize>>,
    norm: NormStyle,
}

impl RandomWeights {
    /// `(centre, half-width)` of the uniform distribution for a tensor.
    fn distribution(&self, name: &str, cols: usize) -> (f32, f32) {
        if name.ends_with("A_log") {
            (1.4, 1.3) // log of decay rates between ~1 and ~15
        } else if name.ends_with("dt_bias") {
            (0.0, 1.0)
        } else if name.contains("conv1d") {
            (0.0, 0.5)
        } else if name.ends_with("linear_attn.norm.weight") {
            (1.0, 0.1) // the gated norm scales by w
        } else if name.contains("norm") {
            match self.norm {
                NormStyle::UnitOffset => (0.0, 0.1),
                NormStyle::Weight => (1.0, 0.1),
            }
        } else {
            (0.0, matrix_half_width(name, cols))
        }
    }
}

/// Half-width of the uniform distribution of a weight matrix: unit-variance
/// outputs for unit-variance inputs, except embeddings (unit-variance
/// entries) and projections back into the residual stream (damped).
fn matrix_half_width(name: &str, cols: usize) -> f32 {
    let unit = (3.0 / cols as f32).sqrt();
    if name.contains("embed_tokens") {
        3f32.sqrt()
    } else if ["o_proj", "out_proj", "down"]
        .iter()
        .any(|p| name.contains(p))
    {
        unit / 4.0
    } else {
        unit
    }
}

impl TensorSource for RandomWeights {
    /// Random codes of uniform weights (widths from [`matrix_half_width`]),
    /// generated directly in the stored encoding so a synthetic model is
    /// written at disk speed.
    fn encoded_rows(
        &self,
        name: &str,
        layout: &MatrixLayout,
        rows: Range<usize>,
    ) -> Option<EncodedRows> {
        let n = rows.len();
        let half_width = matrix_half_width(name, layout.cols);
        let mut rng = SplitMix64(
            xxhash_rust::xxh3::xxh3_64(name.as_bytes())
                ^ (rows.start as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        let mut random_bytes = |len: usize| -> Vec<u8> {
            let mut bytes: Vec<u8> = (0..len.div_ceil(8))
                .flat_map(|_| rng.next_u64().to_le_bytes())
                .collect();
            bytes.truncate(len);
            bytes
        };
        match layout.dtype {
            // Every bit pattern is a valid code, in bit planes too.
            DType::Q4 | DType::Q8 | DType::Q3 | DType::Q2 => {
                let levels = ((1u32 << layout.dtype.bits().unwrap()) - 1) as f32;
                let groups = n * layout.groups_per_row();
                let repeat = |v: f32| bf16::from_f32(v).to_le_bytes().repeat(groups);
                Some(EncodedRows {
                    codes: random_bytes(n * layout.row_bytes),
                    scales: repeat(2.0 * half_width / levels),
                    biases: repeat(-half_width),
                })
            }
            DType::Bf16 => {
                let codes = random_bytes(n * layout.cols * 2)
                    .chunks_exact(2)
                    .flat_map(|b| {
                        let unit = u16::from_le_bytes([b[0], b[1]]) as f32 / 65535.0;
                        bf16::from_f32(half_width * (2.0 * unit - 1.0)).to_le_bytes()
                    })
                    .collect();
                Some(EncodedRows {
                    codes,
                    ..Default::default()
                })
            }
            // Random codes, each block's exponent putting ±6 near the
            // half-width.
            DType::Mxfp4 => {
                let e = (127.0 + (half_width / 6.0).log2().round()).clamp(1.0, 254.0) as u8;
                Some(EncodedRows {
                    codes: random_bytes(n * layout.row_bytes),
                    scales: vec![e; n * layout.cols / crate::quant::mxfp4::BLOCK],
                    biases: Vec::new(),
                })
            }
            DType::F32 => None,
        }
    }

    fn read_rows(&self, src: &RowSource, out: &mut Vec<f32>) -> Result<()> {
        let shape = &self.shapes[&src.tensor];
        let cols = *shape.last().unwrap_or(&1);
        let (centre, width) = self.distribution(&src.tensor, cols);
        let seed = xxhash_rust::xxh3::xxh3_64(src.tensor.as_bytes());
        for row in src.row_start..src.row_start + src.rows {
            let mut rng = SplitMix64(seed ^ (row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            out.extend((0..cols).map(|_| centre + width * (2.0 * rng.next_unit() - 1.0)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::KvType;

    /// Every preset parses, whole and cut (a cut keeps its per-layer lists
    /// as long as its layers), and plans on a synthetic index with an
    /// expert tensor set per MoE layer.
    #[test]
    fn presets_parse_whole_and_cut() {
        for p in PRESETS {
            for layers in [None, Some(3)] {
                let config = preset_config(p, layers, false).unwrap();
                let cfg = ModelConfig::from_hf_json(&config, Path::new(p.name))
                    .unwrap_or_else(|e| panic!("{}: {e}", p.name));
                if let Some(n) = layers {
                    assert_eq!(cfg.num_layers(), n, "{}", p.name);
                }
                let index = CheckpointIndex::synthetic(Path::new(p.name));
                let plan = cfg
                    .architecture
                    .conversion_plan(&cfg, &index)
                    .unwrap_or_else(|e| panic!("{}: {e}", p.name));
                assert_eq!(plan.experts.len(), cfg.moe_layers().count(), "{}", p.name);
                assert!(cfg.mtp.is_none(), "{}: no MTP layer unless asked", p.name);
            }
            // With its multi-token-prediction layer where the model has one:
            // one more layer of experts, numbered after the decoder's.
            match preset_config(p, Some(3), true) {
                Ok(config) => {
                    let cfg = ModelConfig::from_hf_json(&config, Path::new(p.name)).unwrap();
                    let plan = cfg
                        .architecture
                        .conversion_plan(&cfg, &CheckpointIndex::synthetic(Path::new(p.name)))
                        .unwrap();
                    assert_eq!(cfg.mtp_layer(), Some(3), "{}", p.name);
                    assert_eq!(
                        plan.experts.len(),
                        cfg.moe_layers().count() + 1,
                        "{}",
                        p.name
                    );
                    assert_eq!(plan.experts.last().unwrap().layer, 3, "{}", p.name);
                    assert!(
                        plan.dense
                            .iter()
                            .any(|t| t.name == crate::arch::names::MTP_FC_HIDDEN),
                        "{}",
                        p.name
                    );
                }
                Err(e) => assert!(
                    ["qwen3-30b", "qwen3-235b", "gpt-oss"]
                        .iter()
                        .any(|n| p.name.starts_with(n)),
                    "{}: {e}",
                    p.name
                ),
            }
        }
        let oss = ModelConfig::from_hf_json(
            &preset_config(preset("gpt-oss-120b").unwrap(), None, false).unwrap(),
            Path::new("gpt-oss-120b"),
        )
        .unwrap();
        assert_eq!((oss.num_layers(), oss.moe.num_experts), (36, 128));
        assert!(oss.attention.rope_yarn.is_some(), "gpt-oss uses YaRN");
    }

    /// The placeholder tokenizer loads, names every id and reads its own
    /// words back.
    #[test]
    fn placeholder_tokenizer_names_every_id() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(crate::text::TOKENIZER_FILE),
            placeholder_tokenizer(1000),
        )
        .unwrap();
        let tokenizer = crate::text::Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tokenizer.vocab_size(), 1000);
        let ids = [0, 7, 999, 42];
        let text = tokenizer.decode(&ids, false).unwrap();
        assert_eq!(text, "t0 t7 t999 t42");
        assert_eq!(tokenizer.encode(&text, false).unwrap(), ids);
    }

    /// DeepSeek-V3's and Kimi K2's KV cache keeps 512 latent and 64 rotary
    /// values a position and layer (in f32, whatever the KV type), not
    /// 2 · heads · 192; a bf16 or q8 KV type is refused for them.
    #[test]
    fn mla_presets_cache_the_latent_alone() {
        for name in ["deepseek-v3-671b", "kimi-k2-1t"] {
            let config = preset_config(preset(name).unwrap(), None, false).unwrap();
            let cfg = ModelConfig::from_hf_json(&config, Path::new(name)).unwrap();
            for kv in KvType::ALL {
                assert_eq!(cfg.kv_bytes_per_position_and_layer(kv), 576 * 4, "{name}");
                assert_eq!(cfg.kv_bytes_per_position(kv), 61 * 576 * 4, "{name}");
            }
            assert_eq!(cfg.kv_type(None, KvType::Bf16), Ok(KvType::F32), "{name}");
            let refused = cfg.kv_type(Some(KvType::Q8), KvType::F32).unwrap_err();
            assert!(refused.contains("latent cache in f32"), "{refused}");
        }
    }
}
