//! The engine's description of a model, one shape for every architecture.
//!
//! Each architecture module (`crate::arch`) reads a Hugging Face
//! `config.json` into a [`ModelConfig`]; the forward pass, the converter and
//! the expert store only ever look at this description.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

use crate::backend::KvType;
use crate::error::{Error, Result};
use crate::rope::Yarn;

/// A model family moeflux implements (its parsing and checkpoint mapping
/// live in [`crate::arch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Architecture {
    /// Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B.
    Qwen3Moe,
    /// Qwen3-Next-80B-A3B: Gated DeltaNet + gated attention, shared expert.
    Qwen3Next,
    /// Qwen3.5-35B-A3B, Qwen3.5-397B-A17B: Qwen3-Next's layers with separate
    /// linear-attention projections; text weights of a multimodal checkpoint.
    Qwen35Moe,
    /// GLM-4.5, GLM-4.6, GLM-4.5-Air: GQA with q/k/v biases and partial
    /// rotary, optional q/k norm; DeepSeek-V3's grouped sigmoid router,
    /// shared experts, leading dense layers.
    Glm4Moe,
    /// DeepSeek-V3, DeepSeek-R1, Kimi K2: multi-head latent attention,
    /// the grouped sigmoid router, shared experts, leading dense layers.
    DeepseekV3,
    /// gpt-oss-20b, gpt-oss-120b: sinks, sliding-window and full attention
    /// alternating, biased projections and experts, clamped SwiGLU.
    GptOss,
}

#[derive(Clone, Debug, Serialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub rms_norm_eps: f32,
    /// Whether RMSNorm scales by `w` or by `1 + w` (the Qwen3-Next family
    /// stores norm weights centred on zero).
    pub norm: NormStyle,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub attention: AttentionConfig,
    /// Multi-head latent attention (DeepSeek-V3): every attention layer is
    /// MLA, and its KV cache holds the compressed latent and rotary key.
    pub mla: Option<MlaConfig>,
    pub linear_attention: Option<LinearAttentionConfig>,
    pub moe: MoeConfig,
    /// Intermediate size of the dense SwiGLU MLP used by non-MoE layers.
    pub dense_intermediate_size: Option<usize>,
    pub layers: Vec<LayerSpec>,
    /// The multi-token-prediction layer `config.json` names; an opened
    /// model directory keeps it only where the conversion stored one
    /// ([`crate::format::ModelDir::open`]).
    pub mtp: Option<MtpConfig>,
}

/// A multi-token-prediction (MTP) layer: from a position's hidden state
/// (after the final norm) and the embedding of the token after it, one
/// decoder layer guesses the token after that; chained on its own output,
/// it drafts several tokens for speculative decoding. The math is vLLM's
/// (`qwen3_next_mtp.py`, `deepseek_mtp.py`).
#[derive(Clone, Debug, Serialize)]
pub struct MtpConfig {
    /// Its decoder layer, numbered [`ModelConfig::num_layers`] in a model
    /// directory: full attention and the family's feed-forward.
    pub layer: LayerSpec,
    /// The embedding at position 0 is zeroed (DeepSeek-V3, GLM-4.5).
    pub zero_first_embedding: bool,
    /// The next drafting step takes the layer's output after its final
    /// norm (Qwen3-Next, Qwen3.5) rather than before (DeepSeek-V3,
    /// GLM-4.5).
    pub chain_normed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum NormStyle {
    /// `x * w` (Qwen3-MoE).
    Weight,
    /// `x * (1 + w)` (Qwen3-Next, Qwen3.5).
    UnitOffset,
}

#[derive(Clone, Debug, Serialize)]
pub struct AttentionConfig {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Leading dimensions of each head that RoPE rotates (`head_dim` unless
    /// the model uses partial rotary embeddings).
    pub rotary_dim: usize,
    pub rope_theta: f64,
    /// YaRN scaling of the rotary frequencies (`rope_scaling` or
    /// `rope_parameters` of type `yarn`); `None`: plain RoPE.
    pub rope_yarn: Option<Yarn>,
    /// Gated attention: `q_proj` also yields a per-head sigmoid gate applied
    /// to the attention output.
    pub output_gate: bool,
    /// Per-head RMSNorm of queries and keys before RoPE (Qwen3; GLM-4.5's
    /// `use_qk_norm`).
    pub qk_norm: bool,
    /// Biases on the q, k and v projections (GLM-4.5's and gpt-oss'
    /// `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection.
    pub o_bias: bool,
    /// A learned logit per query head that joins each softmax's
    /// denominator without a value (gpt-oss's attention sinks).
    pub sinks: bool,
    /// Positions a query of a [`LayerKind::SlidingAttention`] layer sees,
    /// its own included.
    pub sliding_window: Option<usize>,
}

/// DeepSeek-V3's multi-head latent attention. Queries come from `q_proj`,
/// or from `q_a_proj` → RMSNorm → `q_b_proj` with a `q_lora_rank`;
/// `kv_a_proj_with_mqa` gives the latent (`kv_lora_rank`, RMSNorm'd) and
/// one rotary key shared by the heads; `kv_b_proj` expands the latent into
/// each head's non-rotary key and value, and is absorbed into the query
/// and the output instead, so only the latent and rotary key are cached.
/// `AttentionConfig::num_heads` are the heads; its `rotary_dim` is
/// `qk_rope_head_dim`.
#[derive(Clone, Debug, Serialize)]
pub struct MlaConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Whether the checkpoint rotates interleaved pairs (`rope_interleave`;
    /// the conversion reorders them into halves).
    pub rope_interleave: bool,
    /// The softmax scale: `qk_head_dim^-0.5`, times YaRN's
    /// `get_mscale(factor, mscale_all_dim)²` where the rope is scaled.
    pub softmax_scale: f32,
}

impl MlaConfig {
    /// A query head: its rotary part first (as converted), then the rest.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
    /// Values cached per position and layer: the latent and the rotary key.
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct LinearAttentionConfig {
    pub num_key_heads: usize,
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
}

impl LinearAttentionConfig {
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }
    /// Channels of the causal convolution: q, k and v side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Rows of the fused input projection: q, k, v, z, b, a.
    pub fn in_proj_rows(&self) -> usize {
        self.conv_dim() + self.value_dim() + 2 * self.num_value_heads
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub expert_intermediate_size: usize,
    /// How the router picks each token's experts and weighs them.
    pub router: RouterSpec,
    /// The always-active shared expert, if any.
    pub shared_expert: Option<SharedExpert>,
    /// A bias on the router's logits (gpt-oss).
    pub router_bias: bool,
    /// Biases on each routed expert's gate, up and down products.
    pub expert_bias: bool,
    /// What the routed experts compute between their products.
    pub expert_activation: ExpertActivation,
}

/// The activation of a routed expert between its gate/up and down
/// products.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum ExpertActivation {
    /// `silu(gate) · up`.
    SwiGlu,
    /// gpt-oss's clamped form: `g = min(gate, limit)`, `u = clamp(up,
    /// -limit, limit)`, then `g · sigmoid(alpha · g) · (u + 1)`.
    ClampedSwiGlu { limit: f32, alpha: f32 },
}

/// A MoE router, as data: scores from the router's logits, the experts a
/// token may choose among, the choice, and the weights of the chosen.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RouterSpec {
    /// Experts each token uses.
    pub top_k: usize,
    pub score: ScoreFunction,
    /// Group-limited choice (DeepSeek-V3): the experts fall into
    /// `groups.count` equal groups, and only the `groups.keep` groups with
    /// the highest sums of their two best scores are chosen from.
    pub groups: Option<ExpertGroups>,
    /// A per-expert bias (`e_score_correction_bias`) added to the scores for
    /// the choice only, not for the weights.
    pub correction_bias: bool,
    /// Divide the chosen experts' weights by their sum.
    pub renormalize: bool,
    /// Multiply the weights by this (`routed_scaling_factor`).
    pub scaling: f32,
}

impl RouterSpec {
    /// Softmax over every expert, the `top_k` most probable, optionally
    /// renormalised: the Qwen3 and Mixtral routers.
    pub fn softmax(top_k: usize, renormalize: bool) -> RouterSpec {
        RouterSpec {
            top_k,
            score: ScoreFunction::Softmax,
            groups: None,
            correction_bias: false,
            renormalize,
            scaling: 1.0,
        }
    }

    /// Whether this is [`RouterSpec::softmax`]'s router.
    pub fn is_plain_softmax(&self) -> bool {
        self.score == ScoreFunction::Softmax
            && self.groups.is_none()
            && !self.correction_bias
            && self.scaling == 1.0
    }
}

/// How router logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ScoreFunction {
    /// Softmax over all experts.
    Softmax,
    /// Each expert's sigmoid, independently.
    Sigmoid,
    /// Softmax over the chosen experts' logits only (the choice by logit).
    SoftmaxOfChosen,
}

/// Experts in equal groups for a group-limited choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ExpertGroups {
    pub count: usize,
    pub keep: usize,
}

/// An expert every token uses, beside its routed ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SharedExpert {
    pub intermediate_size: usize,
    /// Scaled by the sigmoid of a learned gate of the token (Qwen3-Next),
    /// or added as is (DeepSeek-V3).
    pub gated: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum LayerKind {
    FullAttention,
    /// Attention over the last [`AttentionConfig::sliding_window`]
    /// positions only; its KV cache keeps no more.
    SlidingAttention,
    LinearAttention,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum FeedForwardKind {
    Dense,
    Moe,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct LayerSpec {
    pub kind: LayerKind,
    pub ffn: FeedForwardKind,
}

impl ModelConfig {
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.spec(layer).ffn == FeedForwardKind::Moe
    }

    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.layers.len()).filter(|&l| self.is_moe_layer(l))
    }

    /// Layer `layer`'s spec: a decoder layer, or the multi-token-prediction
    /// layer numbered after them.
    pub fn spec(&self, layer: usize) -> &LayerSpec {
        match (self.layers.get(layer), &self.mtp) {
            (Some(spec), _) => spec,
            (None, Some(mtp)) if layer == self.layers.len() => &mtp.layer,
            _ => panic!("layer {layer} of a model of {} layers", self.layers.len()),
        }
    }

    /// The multi-token-prediction layer's number, when the model has one.
    pub fn mtp_layer(&self) -> Option<usize> {
        self.mtp.as_ref().map(|_| self.layers.len())
    }

    /// The layers whose routed experts the model directory stores: the
    /// decoder's MoE layers and a multi-token-prediction layer's.
    pub fn expert_layers(&self) -> impl Iterator<Item = usize> + '_ {
        let mtp = self.mtp_layer().filter(|&l| self.is_moe_layer(l));
        self.moe_layers().chain(mtp)
    }

    /// Every layer's spec, the multi-token-prediction layer's last.
    fn all_specs(&self) -> impl Iterator<Item = &LayerSpec> {
        self.layers
            .iter()
            .chain(self.mtp.as_ref().map(|m| &m.layer))
    }

    /// Bytes of KV cache one position of a sequence takes with keys and
    /// values stored as `kv`: every full-attention layer's (Gated DeltaNet
    /// and sliding-window layers hold a bounded state instead).
    pub fn kv_bytes_per_position(&self, kv: KvType) -> u64 {
        let attention_layers = self
            .layers
            .iter()
            .filter(|l| l.kind == LayerKind::FullAttention)
            .count() as u64;
        attention_layers * self.kv_bytes_per_position_and_layer(kv)
    }

    /// Bytes one attention layer caches per position: keys and values as
    /// `kv`, or MLA's latent and rotary key alone (always f32).
    pub fn kv_bytes_per_position_and_layer(&self, kv: KvType) -> u64 {
        match &self.mla {
            Some(m) => m.latent_width() as u64 * 4,
            None => 2 * kv.row_bytes(self.attention.num_kv_heads * self.attention.head_dim) as u64,
        }
    }

    /// Bytes of KV cache a sequence's sliding-window layers hold at most
    /// with keys and values stored as `kv`, whatever its length (the
    /// window's newest positions).
    pub fn kv_bytes_of_windows(&self, kv: KvType) -> u64 {
        let sliding = self
            .layers
            .iter()
            .filter(|l| l.kind == LayerKind::SlidingAttention)
            .count() as u64;
        let row = kv.row_bytes(self.attention.num_kv_heads * self.attention.head_dim) as u64;
        let window = self.attention.sliding_window.unwrap_or(0) as u64;
        sliding * 2 * row * window.saturating_sub(1)
    }

    /// The KV type a model of this configuration uses when `requested`
    /// names one (`None`: `default`, or f32 where `default` does not fit),
    /// or why it cannot: multi-head latent attention keeps its latent cache
    /// in f32, and q8 needs heads of whole blocks.
    pub fn kv_type(
        &self,
        requested: Option<KvType>,
        default: KvType,
    ) -> std::result::Result<KvType, String> {
        let unfit = |kv: KvType| match (&self.mla, kv) {
            (Some(_), KvType::F32) | (None, _) => kv.unsupported_head_dim(self.attention.head_dim),
            (Some(_), _) => Some(format!(
                "multi-head latent attention keeps its latent cache in f32, not {kv}: use f32"
            )),
        };
        match requested {
            Some(kv) => unfit(kv).map_or(Ok(kv), Err),
            None if unfit(default).is_none() => Ok(default),
            None => Ok(KvType::F32),
        }
    }

    /// Checks relations between fields that the forward pass relies on.
    pub(crate) fn validate(&self, source: &Path) -> Result<()> {
        let fail = |msg: String| Err(Error::config(source, msg));
        let a = &self.attention;
        if self.vocab_size == 0 || self.hidden_size == 0 || self.layers.is_empty() {
            return fail("vocab_size, hidden_size and num_hidden_layers must be positive".into());
        }
        if a.num_heads == 0 || a.num_kv_heads == 0 || !a.num_heads.is_multiple_of(a.num_kv_heads) {
            return fail(format!(
                "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
                a.num_heads, a.num_kv_heads
            ));
        }
        if a.head_dim == 0 || a.rotary_dim > a.head_dim || !a.rotary_dim.is_multiple_of(2) {
            return fail(format!(
                "rotary dimension {} must be even and at most head_dim {}",
                a.rotary_dim, a.head_dim
            ));
        }
        if self
            .layers
            .iter()
            .any(|l| l.kind == LayerKind::SlidingAttention)
            && a.sliding_window.unwrap_or(0) == 0
        {
            return fail("sliding-attention layers need a positive sliding_window".into());
        }
        if let Some(l) = &self.linear_attention {
            if l.num_key_heads == 0 || l.num_value_heads % l.num_key_heads != 0 {
                return fail(format!(
                    "linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
                    l.num_value_heads, l.num_key_heads
                ));
            }
            if l.conv_kernel < 1 {
                return fail("linear_conv_kernel_dim must be at least 1".into());
            }
        } else if self
            .layers
            .iter()
            .any(|l| l.kind == LayerKind::LinearAttention)
        {
            return fail("linear-attention layers need the linear_* settings".into());
        }
        let m = &self.moe;
        if self.all_specs().any(|l| l.ffn == FeedForwardKind::Moe)
            && (m.router.top_k == 0
                || m.router.top_k > m.num_experts
                || m.expert_intermediate_size == 0)
        {
            return fail(format!(
                "num_experts_per_tok ({}) must be between 1 and num_experts ({}), moe_intermediate_size positive",
                m.router.top_k, m.num_experts
            ));
        }
        if self.all_specs().any(|l| l.ffn == FeedForwardKind::Dense)
            && self.dense_intermediate_size.unwrap_or(0) == 0
        {
            return fail("dense MLP layers need a positive intermediate_size".into());
        }
        Ok(())
    }
}

/// Rotary settings read by [`ConfigReader::rope`].
#[derive(Clone, Copy, Debug)]
pub struct RopeSettings {
    pub theta: f64,
    /// Fraction of each head that rotates.
    pub partial: f64,
    pub yarn: Option<Yarn>,
}

/// Typed access to a JSON config, with errors that name the file and key.
pub struct ConfigReader<'a> {
    json: &'a serde_json::Map<String, Value>,
    path: PathBuf,
}

impl<'a> ConfigReader<'a> {
    pub fn new(json: &'a Value, path: &Path) -> Result<Self> {
        let json = json
            .as_object()
            .ok_or_else(|| Error::config(path, "expected a JSON object"))?;
        Ok(ConfigReader {
            json,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn error(&self, msg: impl Into<String>) -> Error {
        Error::config(&self.path, msg)
    }

    /// A nested object (e.g. `text_config`), read with the same path.
    pub fn object(&self, key: &str) -> Result<Option<ConfigReader<'a>>> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v @ Value::Object(_)) => Ok(Some(ConfigReader::new(v, &self.path)?)),
            Some(_) => Err(self.error(format!("`{key}` must be an object"))),
        }
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    pub fn str(&self, key: &str) -> Result<&'a str> {
        match self.get(key) {
            Some(Value::String(s)) => Ok(s),
            Some(_) => Err(self.error(format!("`{key}` must be a string"))),
            None => Err(self.error(format!("missing `{key}`"))),
        }
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.error(format!("missing `{key}`")))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                self.error(format!("`{key}` must be a non-negative integer, got {v}"))
            }),
        }
    }

    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.error(format!("`{key}` must be a number, got {v}"))),
        }
    }

    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.error(format!("`{key}` must be true or false, got {v}"))),
        }
    }

    pub fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().map(|n| n as usize).ok_or_else(|| {
                        self.error(format!(
                            "`{key}` must list non-negative integers, found {v}"
                        ))
                    })
                })
                .collect(),
            Some(v) => Err(self.error(format!("`{key}` must be a list, got {v}"))),
        }
    }

    pub fn str_list(&self, key: &str) -> Result<Option<Vec<&'a str>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| self.error(format!("`{key}` must list strings, found {v}")))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(self.error(format!("`{key}` must be a list, got {v}"))),
        }
    }

    /// Refuses a key whose presence with a non-default value changes the math
    /// in a way moeflux does not implement.
    pub fn refuse_if_true(&self, key: &str, why: &str) -> Result<()> {
        if self.bool_or(key, false)? {
            return Err(self.error(format!("`{key}: true` is not supported: {why}")));
        }
        Ok(())
    }

    /// Reads the RoPE settings: the legacy `rope_theta` / `rope_scaling` /
    /// `partial_rotary_factor` keys or transformers 5's `rope_parameters`.
    /// Plain RoPE and YaRN are implemented; other scaled variants are
    /// refused.
    pub fn rope(&self, default_partial: f64) -> Result<RopeSettings> {
        let params = self.object("rope_parameters")?;
        let scaling = self.object("rope_scaling")?;
        let mut yarn = None;
        // transformers 5 moves `rope_scaling` into `rope_parameters`; a
        // config may carry either.
        for (key, p) in [("rope_parameters", &params), ("rope_scaling", &scaling)] {
            let Some(p) = p else { continue };
            let kind = p
                .get("rope_type")
                .or_else(|| p.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            match kind {
                "default" => {}
                "yarn" => {
                    yarn = Some(self.yarn(key, p)?);
                    break;
                }
                _ => {
                    return Err(self.error(format!(
                        "{key} type `{kind}` is not implemented (plain RoPE and `yarn` are); \
                         remove `{key}` from config.json to run at the native context length"
                    )));
                }
            }
        }
        let theta = params
            .as_ref()
            .and_then(|p| p.opt_f64("rope_theta").transpose())
            .or_else(|| self.opt_f64("rope_theta").transpose())
            .transpose()?
            .ok_or_else(|| self.error("missing `rope_theta` (or `rope_parameters.rope_theta`)"))?;
        let partial = params
            .as_ref()
            .and_then(|p| p.opt_f64("partial_rotary_factor").transpose())
            .or_else(|| self.opt_f64("partial_rotary_factor").transpose())
            .transpose()?
            .unwrap_or(default_partial);
        let valid = theta > 0.0 && partial > 0.0 && partial <= 1.0;
        if !valid {
            return Err(self.error(format!(
                "rope_theta ({theta}) must be positive and partial_rotary_factor ({partial}) in (0, 1]"
            )));
        }
        Ok(RopeSettings {
            theta,
            partial,
            yarn,
        })
    }

    /// YaRN's settings from `p` (the `key` object), with transformers'
    /// defaults: `original_max_position_embeddings` from the top level if
    /// there, else `max_position_embeddings`; a null `factor` is their
    /// ratio; `beta_fast` 32 and `beta_slow` 1 where absent or zero;
    /// `truncate` true.
    fn yarn(&self, key: &str, p: &ConfigReader<'_>) -> Result<Yarn> {
        let original = match self.opt_usize("original_max_position_embeddings")? {
            Some(n) => n,
            None => match p.opt_usize("original_max_position_embeddings")? {
                Some(n) => n,
                None => self.usize("max_position_embeddings").map_err(|_| {
                    self.error(format!(
                        "{key} of type yarn needs `original_max_position_embeddings` \
                         (or `max_position_embeddings`)"
                    ))
                })?,
            },
        };
        let factor = match p.opt_f64("factor")? {
            Some(f) => f,
            None => {
                let max = self.usize("max_position_embeddings")?;
                max as f64 / original as f64
            }
        };
        let nonzero_or = |k: &str, default: f64| -> Result<f64> {
            Ok(p.opt_f64(k)?.filter(|&v| v != 0.0).unwrap_or(default))
        };
        let yarn = Yarn {
            factor,
            original_max_position_embeddings: original,
            beta_fast: nonzero_or("beta_fast", 32.0)?,
            beta_slow: nonzero_or("beta_slow", 1.0)?,
            mscale: p.opt_f64("mscale")?,
            mscale_all_dim: p.opt_f64("mscale_all_dim")?,
            attention_factor: p.opt_f64("attention_factor")?,
            truncate: p.bool_or("truncate", true)?,
        };
        if !(yarn.factor > 0.0 && yarn.original_max_position_embeddings > 0) {
            return Err(self.error(format!(
                "{key}: yarn's factor ({}) and original_max_position_embeddings ({}) must be positive",
                yarn.factor, yarn.original_max_position_embeddings
            )));
        }
        Ok(yarn)
    }

    /// Routed experts per MoE layer; transformers 5 writes `num_local_experts`
    /// for some families, the Hub configs `num_experts`.
    pub fn num_experts(&self) -> Result<usize> {
        Ok(match self.opt_usize("num_experts")? {
            Some(n) => n,
            None => self.usize_or("num_local_experts", 0)?,
        })
    }

    /// Each layer's feed-forward kind: MoE unless listed in
    /// `mlp_only_layers` or skipped by `decoder_sparse_step` (layer `i` is
    /// sparse when `(i + 1) % step == 0`), as transformers decides it.
    pub fn feed_forward_kinds(&self, num_layers: usize) -> Result<Vec<FeedForwardKind>> {
        let num_experts = self.num_experts()?;
        let sparse_step = self.usize_or("decoder_sparse_step", 1)?.max(1);
        let mlp_only = self.usize_list("mlp_only_layers")?;
        Ok((0..num_layers)
            .map(|i| {
                if !mlp_only.contains(&i) && num_experts > 0 && (i + 1) % sparse_step == 0 {
                    FeedForwardKind::Moe
                } else {
                    FeedForwardKind::Dense
                }
            })
            .collect())
    }

    /// Only SiLU-gated MLPs are implemented.
    pub fn require_silu(&self) -> Result<()> {
        match self.get("hidden_act").and_then(Value::as_str) {
            None | Some("silu") => Ok(()),
            Some(other) => Err(self.error(format!(
                "hidden_act `{other}` is not supported (these architectures use `silu`)"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope_of(json: Value) -> Result<RopeSettings> {
        ConfigReader::new(&json, Path::new("config.json"))?.rope(1.0)
    }

    #[test]
    fn yarn_is_read_from_rope_scaling_and_rope_parameters() {
        // DeepSeek-V3's legacy keys.
        let r = rope_of(serde_json::json!({
            "rope_theta": 10000, "max_position_embeddings": 163840,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        }))
        .unwrap();
        let y = r.yarn.unwrap();
        assert_eq!(
            (r.theta, y.factor, y.original_max_position_embeddings),
            (10000.0, 40.0, 4096)
        );
        assert_eq!(
            (y.mscale, y.mscale_all_dim, y.truncate),
            (Some(1.0), Some(1.0), true)
        );
        // transformers 5's keys (gpt-oss), defaults for the betas.
        let r = rope_of(serde_json::json!({
            "max_position_embeddings": 131072,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                "original_max_position_embeddings": 4096, "truncate": false}
        }))
        .unwrap();
        let y = r.yarn.unwrap();
        assert_eq!(
            (r.theta, y.beta_fast, y.beta_slow, y.truncate),
            (150000.0, 32.0, 1.0, false)
        );
        // A null factor is the ratio of the context lengths; the pretraining
        // context defaults to max_position_embeddings.
        let r = rope_of(serde_json::json!({
            "rope_theta": 1e6, "max_position_embeddings": 65536, "original_max_position_embeddings": 16384,
            "rope_scaling": {"rope_type": "yarn", "factor": null}
        }))
        .unwrap();
        assert_eq!(r.yarn.unwrap().factor, 4.0);
        // Plain RoPE, and a type that is not implemented.
        assert!(
            rope_of(serde_json::json!({"rope_theta": 1e6}))
                .unwrap()
                .yarn
                .is_none()
        );
        let err = rope_of(serde_json::json!({
            "rope_theta": 1e6, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}
        }))
        .unwrap_err();
        assert!(
            err.to_string().contains("rope_scaling type `llama3`"),
            "{err}"
        );
    }
}
