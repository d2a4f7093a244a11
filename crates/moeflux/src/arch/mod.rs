//! Architectures: how each model family's `config.json` reads into a
//! [`ModelConfig`] and how its checkpoint tensors map onto moeflux's
//! canonical tensors. The forward pass itself is shared
//! ([`crate::blocks::decoder`]) and driven by the config.

mod deepseek_v3;
mod glm4_moe;
mod gpt_oss;
mod qwen3_moe;
mod qwen3_next;

use std::path::Path;

use serde_json::Value;

pub use crate::config::Architecture;
use crate::config::{AttentionConfig, ConfigReader, ModelConfig, RopeSettings};
use crate::convert::plan::{CheckpointIndex, ConversionPlan};
use crate::error::{Error, Result};

impl Architecture {
    const ALL: [(&'static str, Architecture); 8] = [
        ("qwen3_moe", Architecture::Qwen3Moe),
        ("qwen3_next", Architecture::Qwen3Next),
        ("qwen3_5_moe", Architecture::Qwen35Moe),
        ("qwen3_5_moe_text", Architecture::Qwen35Moe),
        ("glm4_moe", Architecture::Glm4Moe),
        ("deepseek_v3", Architecture::DeepseekV3),
        ("kimi_k2", Architecture::DeepseekV3),
        ("gpt_oss", Architecture::GptOss),
    ];

    pub fn from_model_type(model_type: &str) -> Option<Architecture> {
        Self::ALL
            .iter()
            .find(|(name, _)| *name == model_type)
            .map(|(_, arch)| *arch)
    }

    pub fn supported_list() -> String {
        Self::ALL
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub fn name(self) -> &'static str {
        match self {
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Qwen3Next => "qwen3_next",
            Architecture::Qwen35Moe => "qwen3_5_moe",
            Architecture::Glm4Moe => "glm4_moe",
            Architecture::DeepseekV3 => "deepseek_v3",
            Architecture::GptOss => "gpt_oss",
        }
    }

    pub(crate) fn parse_config(self, reader: &ConfigReader<'_>) -> Result<ModelConfig> {
        match self {
            Architecture::Qwen3Moe => qwen3_moe::parse_config(reader),
            Architecture::Glm4Moe => glm4_moe::parse_config(reader),
            Architecture::DeepseekV3 => deepseek_v3::parse_config(reader),
            Architecture::Qwen3Next | Architecture::Qwen35Moe => {
                qwen3_next::parse_config(self, reader)
            }
            Architecture::GptOss => gpt_oss::parse_config(reader),
        }
    }

    /// Maps a checkpoint's tensors onto the canonical tensors the engine
    /// loads, checking that every tensor the model needs is present.
    pub(crate) fn conversion_plan(
        self,
        cfg: &ModelConfig,
        checkpoint: &CheckpointIndex,
    ) -> Result<ConversionPlan> {
        match self {
            Architecture::Qwen3Moe => qwen3_moe::conversion_plan(cfg, checkpoint),
            Architecture::Glm4Moe => glm4_moe::conversion_plan(cfg, checkpoint),
            Architecture::DeepseekV3 => deepseek_v3::conversion_plan(cfg, checkpoint),
            Architecture::Qwen3Next | Architecture::Qwen35Moe => {
                qwen3_next::conversion_plan(cfg, checkpoint)
            }
            Architecture::GptOss => gpt_oss::conversion_plan(cfg, checkpoint),
        }
    }
}

/// Canonical names of the tensors in a moeflux model directory. The
/// converter writes these and the forward pass reads them; documented in
/// docs/FORMAT.md.
pub mod names {
    pub const EMBED: &str = "embed_tokens";
    pub const FINAL_NORM: &str = "norm";
    pub const LM_HEAD: &str = "lm_head";

    pub fn layer(layer: usize, tensor: &str) -> String {
        format!("layers.{layer}.{tensor}")
    }

    pub const INPUT_NORM: &str = "input_norm";
    pub const POST_ATTENTION_NORM: &str = "post_attention_norm";

    pub const ATTN_Q: &str = "attn.q_proj";
    pub const ATTN_K: &str = "attn.k_proj";
    pub const ATTN_V: &str = "attn.v_proj";
    pub const ATTN_O: &str = "attn.o_proj";
    pub const ATTN_Q_NORM: &str = "attn.q_norm";
    pub const ATTN_K_NORM: &str = "attn.k_norm";
    pub const ATTN_Q_BIAS: &str = "attn.q_bias";
    pub const ATTN_K_BIAS: &str = "attn.k_bias";
    pub const ATTN_V_BIAS: &str = "attn.v_bias";
    pub const ATTN_O_BIAS: &str = "attn.o_bias";
    /// One sink logit per query head.
    pub const ATTN_SINKS: &str = "attn.sinks";

    /// Multi-head latent attention (DeepSeek-V3): the query's low-rank
    /// projection and its norm, then its expansion (rows per head: rotary
    /// part in halves, then the rest); without a query rank, `attn.q_proj`
    /// with the same row order.
    pub const MLA_Q_A: &str = "attn.q_a_proj";
    pub const MLA_Q_A_NORM: &str = "attn.q_a_norm";
    pub const MLA_Q_B: &str = "attn.q_b_proj";
    /// Rows: the latent, then the rotary key in halves.
    pub const MLA_KV_A: &str = "attn.kv_a_proj";
    pub const MLA_KV_A_NORM: &str = "attn.kv_a_norm";
    /// Rows per head: its key's non-rotary part, then its value.
    pub const MLA_KV_B: &str = "attn.kv_b_proj";

    /// Rows q | k | v | z | b | a of the Gated DeltaNet input projection.
    pub const LINEAR_IN_PROJ: &str = "linear_attn.in_proj";
    pub const LINEAR_CONV: &str = "linear_attn.conv1d";
    pub const LINEAR_A_LOG: &str = "linear_attn.A_log";
    pub const LINEAR_DT_BIAS: &str = "linear_attn.dt_bias";
    pub const LINEAR_NORM: &str = "linear_attn.norm";
    pub const LINEAR_OUT_PROJ: &str = "linear_attn.out_proj";

    pub const MLP_GATE: &str = "mlp.gate_proj";
    pub const MLP_UP: &str = "mlp.up_proj";
    pub const MLP_DOWN: &str = "mlp.down_proj";

    pub const MOE_ROUTER: &str = "moe.router";
    /// The per-expert bias a router adds to its scores for the choice.
    pub const MOE_ROUTER_CORRECTION: &str = "moe.router_correction_bias";
    /// A bias added to the router's logits.
    pub const MOE_ROUTER_BIAS: &str = "moe.router_bias";
    /// Routed experts' biases, `[experts, width]`, kept with the dense
    /// weights (a few KiB per expert) so expert blobs stay three matrices.
    pub const EXPERTS_GATE_BIAS: &str = "moe.experts_gate_bias";
    pub const EXPERTS_UP_BIAS: &str = "moe.experts_up_bias";
    pub const EXPERTS_DOWN_BIAS: &str = "moe.experts_down_bias";
    pub const SHARED_GATE: &str = "moe.shared_expert.gate_proj";
    pub const SHARED_UP: &str = "moe.shared_expert.up_proj";
    pub const SHARED_DOWN: &str = "moe.shared_expert.down_proj";
    pub const SHARED_EXPERT_GATE: &str = "moe.shared_expert_gate";

    /// The multi-token-prediction head; its decoder layer is
    /// `layers.{num_layers}.…`. RMSNorms of the next token's embedding and
    /// of the position's hidden state.
    pub const MTP_EMBED_NORM: &str = "mtp.embed_norm";
    pub const MTP_HIDDEN_NORM: &str = "mtp.hidden_norm";
    /// The columns of the checkpoint's `fc` / `eh_proj` that multiply the
    /// normed embedding, and those that multiply the normed hidden state.
    pub const MTP_FC_EMBED: &str = "mtp.fc_embed";
    pub const MTP_FC_HIDDEN: &str = "mtp.fc_hidden";
    /// The norm before the LM head (`mtp.norm`, `shared_head.norm`).
    pub const MTP_NORM: &str = "mtp.norm";
    /// The layer's own copies of the embeddings and LM head (DeepSeek-V3's
    /// `embed_tokens` and `shared_head.head`), when the checkpoint has them.
    pub const MTP_EMBED: &str = "mtp.embed_tokens";
    pub const MTP_LM_HEAD: &str = "mtp.lm_head";
}

impl ModelConfig {
    /// Parses a Hugging Face `config.json` (already read as JSON), choosing
    /// the architecture from `model_type`.
    pub fn from_hf_json(json: &Value, source: &Path) -> Result<ModelConfig> {
        let reader = ConfigReader::new(json, source)?;
        let model_type = reader.str("model_type")?;
        let arch = Architecture::from_model_type(model_type).ok_or_else(|| {
            Error::config(
                source,
                format!(
                    "unknown model_type `{model_type}`: moeflux implements {}",
                    Architecture::supported_list()
                ),
            )
        })?;
        let cfg = arch.parse_config(&reader)?;
        cfg.validate(source)?;
        Ok(cfg)
    }
}

/// Grouped-query attention over `num_heads` query heads of `head_dim` and
/// the config's `num_key_value_heads` (as many as the queries without it),
/// rotated by `rope`: no gate, norm, biases, sinks or window, which the
/// families that have them set over this.
fn grouped_query_attention(
    c: &ConfigReader<'_>,
    num_heads: usize,
    head_dim: usize,
    rope: &RopeSettings,
) -> Result<AttentionConfig> {
    Ok(AttentionConfig {
        num_heads,
        num_kv_heads: c.usize_or("num_key_value_heads", num_heads)?,
        head_dim,
        rotary_dim: (head_dim as f64 * rope.partial) as usize,
        rope_theta: rope.theta,
        rope_yarn: rope.yarn,
        output_gate: false,
        qk_norm: false,
        qkv_bias: false,
        o_bias: false,
        sinks: false,
        sliding_window: None,
    })
}
