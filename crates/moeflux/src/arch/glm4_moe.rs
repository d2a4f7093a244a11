//! GLM-4.5 / GLM-4.6 / GLM-4.5-Air (`glm4_moe`): GQA attention with q/k/v
//! biases, partial rotary (half of each head by default) and optional
//! per-head q/k RMSNorm; the first `first_k_dense_replace` layers dense,
//! the rest MoE with DeepSeek-V3's router (sigmoid scores, a correction
//! bias for the choice, group-limited top-k, renormalisation, routed
//! scaling) and ungated shared experts. Multi-token-prediction layers
//! (after the last decoder layer in the checkpoint) are skipped.

use crate::arch::{Architecture, names};
use crate::config::{
    AttentionConfig, ConfigReader, ExpertActivation, ExpertGroups, FeedForwardKind, LayerKind,
    LayerSpec, ModelConfig, MoeConfig, MtpConfig, NormStyle, RouterSpec, ScoreFunction,
    SharedExpert,
};
use crate::convert::plan::{CheckpointIndex, ConversionPlan, PlanBuilder, TensorRole};
use crate::error::Result;

pub(super) fn parse_config(c: &ConfigReader<'_>) -> Result<ModelConfig> {
    c.require_silu()?;
    let hidden_size = c.usize("hidden_size")?;
    let num_heads = c.usize("num_attention_heads")?;
    let head_dim = c.usize_or("head_dim", hidden_size / num_heads.max(1))?;
    let rope = c.rope(0.5)?;
    let num_layers = c.usize("num_hidden_layers")?;
    let moe = deepseek_moe(c)?;
    let (layers, mtp) = layers_and_mtp(c, num_layers, LayerKind::FullAttention, &moe, 1)?;
    Ok(ModelConfig {
        architecture: Architecture::Glm4Moe,
        vocab_size: c.usize("vocab_size")?,
        hidden_size,
        rms_norm_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-5) as f32,
        norm: NormStyle::Weight,
        tie_word_embeddings: c.bool_or("tie_word_embeddings", false)?,
        max_position_embeddings: c.usize_or("max_position_embeddings", 131072)?,
        attention: AttentionConfig {
            qk_norm: c.bool_or("use_qk_norm", false)?,
            qkv_bias: c.bool_or("attention_bias", false)?,
            ..super::grouped_query_attention(c, num_heads, head_dim, &rope)?
        },
        mla: None,
        linear_attention: None,
        layers,
        mtp,
        moe,
        dense_intermediate_size: c.opt_usize("intermediate_size")?,
    })
}

/// The MoE settings of the DeepSeek-V3 family's configs (`n_routed_experts`,
/// `n_shared_experts`, `n_group`, `topk_group`, `norm_topk_prob`,
/// `routed_scaling_factor`), as transformers' `DeepseekV3TopkRouter` and
/// `Glm4MoeTopkRouter` route: sigmoid scores, the correction bias for the
/// choice, group-limited top-k.
pub(super) fn deepseek_moe(c: &ConfigReader<'_>) -> Result<MoeConfig> {
    let num_experts = match c.opt_usize("n_routed_experts")? {
        Some(n) => n,
        None => c.num_experts()?,
    };
    if let Some(f) = c.get("scoring_func").and_then(serde_json::Value::as_str)
        && f != "sigmoid"
    {
        return Err(c.error(format!(
            "scoring_func `{f}` is not supported (transformers' router uses sigmoid scores)"
        )));
    }
    let expert_intermediate_size = c.usize_or("moe_intermediate_size", 0)?;
    let (count, keep) = (c.usize_or("n_group", 1)?, c.usize_or("topk_group", 1)?);
    if count == 0 || keep == 0 || keep > count || (num_experts > 0 && num_experts % count != 0) {
        return Err(c.error(format!(
            "n_group ({count}) must divide n_routed_experts ({num_experts}) and topk_group \
             ({keep}) be between 1 and n_group"
        )));
    }
    let shared = c.usize_or("n_shared_experts", 1)?;
    Ok(MoeConfig {
        num_experts,
        expert_intermediate_size,
        router: RouterSpec {
            top_k: c.usize_or("num_experts_per_tok", 0)?,
            score: ScoreFunction::Sigmoid,
            // One group keeps every expert: the same choice without the
            // grouping's work.
            groups: (count > 1 && keep < count).then_some(ExpertGroups { count, keep }),
            correction_bias: true,
            renormalize: c.bool_or("norm_topk_prob", true)?,
            scaling: c.opt_f64("routed_scaling_factor")?.unwrap_or(1.0) as f32,
        },
        shared_expert: (shared > 0).then_some(SharedExpert {
            intermediate_size: shared * expert_intermediate_size,
            gated: false,
        }),
        router_bias: false,
        expert_bias: false,
        expert_activation: ExpertActivation::SwiGlu,
    })
}

/// Layers of mixer `kind`, the first `first_k_dense_replace` (default
/// `default_dense`) with a dense MLP and the rest MoE (every
/// `moe_layer_freq`-th, as DeepSeek's configs allow; transformers' models
/// use 1); and the multi-token-prediction layer `num_nextn_predict_layers`
/// names, numbered after them and following the same rule (as vLLM builds
/// it).
pub(super) fn layers_and_mtp(
    c: &ConfigReader<'_>,
    num_layers: usize,
    kind: LayerKind,
    moe: &MoeConfig,
    default_dense: usize,
) -> Result<(Vec<LayerSpec>, Option<MtpConfig>)> {
    let first_dense = c.usize_or("first_k_dense_replace", default_dense)?;
    let freq = c.usize_or("moe_layer_freq", 1)?.max(1);
    let spec = |i: usize| LayerSpec {
        kind,
        ffn: if moe.num_experts > 0 && i >= first_dense && i.is_multiple_of(freq) {
            FeedForwardKind::Moe
        } else {
            FeedForwardKind::Dense
        },
    };
    let mtp = (c.usize_or("num_nextn_predict_layers", 0)? > 0).then(|| MtpConfig {
        layer: LayerSpec {
            kind: LayerKind::FullAttention,
            ffn: spec(num_layers).ffn,
        },
        zero_first_embedding: true,
        chain_normed: false,
    });
    Ok(((0..num_layers).map(spec).collect(), mtp))
}

pub(super) fn conversion_plan(cfg: &ModelConfig, ckpt: &CheckpointIndex) -> Result<ConversionPlan> {
    let mut b = PlanBuilder::new(ckpt);
    let p = ckpt.text_prefix();
    super::qwen3_moe::common_tensors(&mut b, cfg, p)?;
    for (i, spec) in cfg.layers.iter().enumerate() {
        attention(&mut b, cfg, p, i)?;
        deepseek_feed_forward(&mut b, cfg, p, i, spec.ffn)?;
    }
    let skips = mtp_layer(&mut b, cfg, p, attention)?;
    Ok(b.finish(&skips))
}

/// GQA attention of layer `i` with GLM-4.5's optional biases and q/k norm.
fn attention(b: &mut PlanBuilder<'_>, cfg: &ModelConfig, p: &str, i: usize) -> Result<()> {
    let a = &cfg.attention;
    let (h, q_dim, kv_dim) = (
        cfg.hidden_size,
        a.num_heads * a.head_dim,
        a.num_kv_heads * a.head_dim,
    );
    let hf = |t: &str| format!("{p}layers.{i}.self_attn.{t}");
    let canon = |t: &str| names::layer(i, t);
    let m = TensorRole::Matrix;
    for (c, t, rows) in [
        (names::ATTN_Q, "q_proj", q_dim),
        (names::ATTN_K, "k_proj", kv_dim),
        (names::ATTN_V, "v_proj", kv_dim),
    ] {
        b.matrix(canon(c), m, &hf(&format!("{t}.weight")), rows, h)?;
    }
    b.matrix(canon(names::ATTN_O), m, &hf("o_proj.weight"), h, q_dim)?;
    if a.qkv_bias {
        for (c, t, rows) in [
            (names::ATTN_Q_BIAS, "q_proj", q_dim),
            (names::ATTN_K_BIAS, "k_proj", kv_dim),
            (names::ATTN_V_BIAS, "v_proj", kv_dim),
        ] {
            b.vector(canon(c), &hf(&format!("{t}.bias")), &[rows])?;
        }
    }
    if a.qk_norm {
        b.vector(
            canon(names::ATTN_Q_NORM),
            &hf("q_norm.weight"),
            &[a.head_dim],
        )?;
        b.vector(
            canon(names::ATTN_K_NORM),
            &hf("k_norm.weight"),
            &[a.head_dim],
        )?;
    }
    Ok(())
}

/// Maps the attention of layer `i` of a DeepSeek-V3-family checkpoint.
pub(super) type AttentionPlan = fn(&mut PlanBuilder<'_>, &ModelConfig, &str, usize) -> Result<()>;

/// The multi-token-prediction layer of the DeepSeek-V3 family's
/// checkpoints, kept when `config.json` names one
/// (`num_nextn_predict_layers`) and the checkpoint has it: decoder layer
/// `num_hidden_layers` (its attention mapped by `attention`) with `enorm`,
/// `hnorm`, `eh_proj` split per input, `shared_head.norm` and, where
/// present, its own `embed_tokens` and `shared_head.head`. Returns the
/// prefixes [`PlanBuilder::finish`] skips: the layers after it, or all of
/// them when it is not kept.
pub(super) fn mtp_layer(
    b: &mut PlanBuilder<'_>,
    cfg: &ModelConfig,
    p: &str,
    attention: AttentionPlan,
) -> Result<Vec<(String, &'static str)>> {
    let n = cfg.num_layers();
    let hf = |t: &str| format!("{p}layers.{n}.{t}");
    let (Some(mtp), true) = (&cfg.mtp, b.checkpoint().contains(&hf("eh_proj.weight"))) else {
        return Ok(mtp_prefixes(b.checkpoint(), p, n)
            .into_iter()
            .map(|prefix| (prefix, MTP_NOTICE))
            .collect());
    };
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    b.vector(names::MTP_EMBED_NORM.into(), &hf("enorm.weight"), &[h])?;
    b.vector(names::MTP_HIDDEN_NORM.into(), &hf("hnorm.weight"), &[h])?;
    for (canon, start) in [(names::MTP_FC_EMBED, 0), (names::MTP_FC_HIDDEN, h)] {
        b.matrix_columns(
            canon.into(),
            TensorRole::Matrix,
            &hf("eh_proj.weight"),
            [h, 2 * h],
            start,
            h,
        )?;
    }
    b.vector(names::MTP_NORM.into(), &hf("shared_head.norm.weight"), &[h])?;
    for (canon, t) in [
        (names::MTP_EMBED, "embed_tokens.weight"),
        (names::MTP_LM_HEAD, "shared_head.head.weight"),
    ] {
        if b.checkpoint().contains(&hf(t)) {
            b.matrix(canon.into(), TensorRole::Matrix, &hf(t), v, h)?;
        }
    }
    super::qwen3_moe::layer_norms(b, cfg, &hf(""), n)?;
    attention(b, cfg, p, n)?;
    deepseek_feed_forward(b, cfg, p, n, mtp.layer.ffn)?;
    Ok(mtp_prefixes(b.checkpoint(), p, n + 1)
        .into_iter()
        .map(|prefix| (prefix, MTP_EXTRA_NOTICE))
        .collect())
}

/// Why multi-token-prediction layers are left out.
const MTP_NOTICE: &str = "multi-token-prediction layer, which config.json does not name \
                          (num_nextn_predict_layers)";
const MTP_EXTRA_NOTICE: &str = "multi-token-prediction layer after the first (moeflux runs one)";

/// Prefixes of the checkpoint's decoder layers numbered from `from` on
/// (multi-token-prediction layers, after the `num_hidden_layers` of the
/// model), and `mtp.`.
fn mtp_prefixes(ckpt: &CheckpointIndex, p: &str, from: usize) -> Vec<String> {
    let mut prefixes: Vec<String> = (from..)
        .map(|l| format!("{p}layers.{l}."))
        .take_while(|prefix| ckpt.tensors.keys().any(|k| k.starts_with(prefix)))
        .collect();
    prefixes.push("mtp.".into());
    prefixes
}

/// The dense MLP, or the MoE block of the DeepSeek-V3 family's names:
/// `mlp.gate` (router, with its `e_score_correction_bias`),
/// `mlp.shared_experts`, `mlp.experts`.
pub(super) fn deepseek_feed_forward(
    b: &mut PlanBuilder<'_>,
    cfg: &ModelConfig,
    p: &str,
    i: usize,
    ffn: FeedForwardKind,
) -> Result<()> {
    let h = cfg.hidden_size;
    let hf = |t: &str| format!("{p}layers.{i}.mlp.{t}");
    let canon = |t: &str| names::layer(i, t);
    let m = TensorRole::Matrix;
    let swiglu = |b: &mut PlanBuilder<'_>, tensors: [(&str, String); 3], inter: usize| {
        let [(cg, hg), (cu, hu), (cd, hd)] = tensors;
        b.matrix(canon(cg), m, &hf(&hg), inter, h)?;
        b.matrix(canon(cu), m, &hf(&hu), inter, h)?;
        b.matrix(canon(cd), m, &hf(&hd), h, inter)
    };
    match ffn {
        FeedForwardKind::Dense => swiglu(
            b,
            [
                (names::MLP_GATE, "gate_proj.weight".into()),
                (names::MLP_UP, "up_proj.weight".into()),
                (names::MLP_DOWN, "down_proj.weight".into()),
            ],
            cfg.dense_intermediate_size.unwrap_or(0),
        ),
        FeedForwardKind::Moe => {
            let moe = &cfg.moe;
            b.matrix(
                canon(names::MOE_ROUTER),
                TensorRole::Router,
                &hf("gate.weight"),
                moe.num_experts,
                h,
            )?;
            b.vector(
                canon(names::MOE_ROUTER_CORRECTION),
                &hf("gate.e_score_correction_bias"),
                &[moe.num_experts],
            )?;
            if let Some(shared) = moe.shared_expert {
                let t = |proj: &str| format!("shared_experts.{proj}.weight");
                swiglu(
                    b,
                    [
                        (names::SHARED_GATE, t("gate_proj")),
                        (names::SHARED_UP, t("up_proj")),
                        (names::SHARED_DOWN, t("down_proj")),
                    ],
                    shared.intermediate_size,
                )?;
            }
            b.experts(
                i,
                &hf("experts."),
                moe.num_experts,
                h,
                moe.expert_intermediate_size,
            )
        }
    }
}
