//! Qwen3-MoE (`qwen3_moe`): GQA attention with per-head RMSNorm of q and k
//! and full RoPE; softmax top-k router; SwiGLU experts; optional dense MLP
//! layers (`mlp_only_layers`, `decoder_sparse_step`).

use crate::arch::{Architecture, names};
use crate::config::{
    AttentionConfig, ConfigReader, ExpertActivation, FeedForwardKind, LayerKind, LayerSpec,
    ModelConfig, MoeConfig, NormStyle, RouterSpec,
};
use crate::convert::plan::{CheckpointIndex, ConversionPlan, PlanBuilder, TensorRole};
use crate::error::Result;

pub(super) fn parse_config(c: &ConfigReader<'_>) -> Result<ModelConfig> {
    c.require_silu()?;
    c.refuse_if_true(
        "attention_bias",
        "Qwen3-MoE checkpoints have no attention biases",
    )?;
    c.refuse_if_true(
        "use_sliding_window",
        "sliding-window attention is not implemented",
    )?;
    let hidden_size = c.usize("hidden_size")?;
    let num_heads = c.usize("num_attention_heads")?;
    let head_dim = match c.opt_usize("head_dim")? {
        Some(d) => d,
        None if num_heads > 0 => hidden_size / num_heads,
        None => 0,
    };
    let rope = c.rope(1.0)?;
    let num_layers = c.usize("num_hidden_layers")?;
    let num_experts = c.num_experts()?;
    let layers = c
        .feed_forward_kinds(num_layers)?
        .into_iter()
        .map(|ffn| LayerSpec {
            kind: LayerKind::FullAttention,
            ffn,
        })
        .collect();
    Ok(ModelConfig {
        architecture: Architecture::Qwen3Moe,
        vocab_size: c.usize("vocab_size")?,
        hidden_size,
        rms_norm_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        norm: NormStyle::Weight,
        tie_word_embeddings: c.bool_or("tie_word_embeddings", false)?,
        max_position_embeddings: c.usize_or("max_position_embeddings", 32768)?,
        attention: AttentionConfig {
            qk_norm: true,
            ..super::grouped_query_attention(c, num_heads, head_dim, &rope)?
        },
        mla: None,
        linear_attention: None,
        moe: MoeConfig {
            num_experts,
            expert_intermediate_size: c.usize_or("moe_intermediate_size", 0)?,
            router: RouterSpec::softmax(
                c.usize_or("num_experts_per_tok", 0)?,
                c.bool_or("norm_topk_prob", false)?,
            ),
            shared_expert: None,
            router_bias: false,
            expert_bias: false,
            expert_activation: ExpertActivation::SwiGlu,
        },
        dense_intermediate_size: c.opt_usize("intermediate_size")?,
        layers,
        mtp: None,
    })
}

pub(super) fn conversion_plan(cfg: &ModelConfig, ckpt: &CheckpointIndex) -> Result<ConversionPlan> {
    let mut b = PlanBuilder::new(ckpt);
    let p = ckpt.text_prefix();
    common_tensors(&mut b, cfg, p)?;
    let a = &cfg.attention;
    let (h, q_dim, kv_dim) = (
        cfg.hidden_size,
        a.num_heads * a.head_dim,
        a.num_kv_heads * a.head_dim,
    );
    for (i, spec) in cfg.layers.iter().enumerate() {
        let hf = |t: &str| format!("{p}layers.{i}.{t}");
        let canon = |t: &str| names::layer(i, t);
        let m = TensorRole::Matrix;
        b.matrix(
            canon(names::ATTN_Q),
            m,
            &hf("self_attn.q_proj.weight"),
            q_dim,
            h,
        )?;
        b.matrix(
            canon(names::ATTN_K),
            m,
            &hf("self_attn.k_proj.weight"),
            kv_dim,
            h,
        )?;
        b.matrix(
            canon(names::ATTN_V),
            m,
            &hf("self_attn.v_proj.weight"),
            kv_dim,
            h,
        )?;
        b.matrix(
            canon(names::ATTN_O),
            m,
            &hf("self_attn.o_proj.weight"),
            h,
            q_dim,
        )?;
        b.vector(
            canon(names::ATTN_Q_NORM),
            &hf("self_attn.q_norm.weight"),
            &[a.head_dim],
        )?;
        b.vector(
            canon(names::ATTN_K_NORM),
            &hf("self_attn.k_norm.weight"),
            &[a.head_dim],
        )?;
        feed_forward(&mut b, cfg, &format!("{p}layers.{i}."), i, spec.ffn)?;
    }
    Ok(b.finish(&[("mtp.", "multi-token-prediction head")]))
}

/// Embeddings, final norm, lm_head and the two per-layer norms, named alike
/// in every Qwen3 family checkpoint.
pub(super) fn common_tensors(b: &mut PlanBuilder<'_>, cfg: &ModelConfig, p: &str) -> Result<()> {
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    b.matrix(
        names::EMBED.into(),
        TensorRole::Matrix,
        &format!("{p}embed_tokens.weight"),
        v,
        h,
    )?;
    b.vector(names::FINAL_NORM.into(), &format!("{p}norm.weight"), &[h])?;
    if cfg.tie_word_embeddings {
        b.skip("lm_head.weight", "tied to embed_tokens");
    } else {
        b.matrix(
            names::LM_HEAD.into(),
            TensorRole::Matrix,
            "lm_head.weight",
            v,
            h,
        )?;
    }
    for i in 0..cfg.num_layers() {
        layer_norms(b, cfg, &format!("{p}layers.{i}."), i)?;
    }
    Ok(())
}

/// The two norms of layer `i`, stored under `hf_layer` (the checkpoint's
/// prefix of the layer).
pub(super) fn layer_norms(
    b: &mut PlanBuilder<'_>,
    cfg: &ModelConfig,
    hf_layer: &str,
    i: usize,
) -> Result<()> {
    for (canon, hf) in [
        (names::INPUT_NORM, "input_layernorm.weight"),
        (
            names::POST_ATTENTION_NORM,
            "post_attention_layernorm.weight",
        ),
    ] {
        b.vector(
            names::layer(i, canon),
            &format!("{hf_layer}{hf}"),
            &[cfg.hidden_size],
        )?;
    }
    Ok(())
}

/// The dense MLP or the sparse MoE block (router, experts and, where the
/// config has one, the gated shared expert) of layer `i`, stored under
/// `hf_layer`.
pub(super) fn feed_forward(
    b: &mut PlanBuilder<'_>,
    cfg: &ModelConfig,
    hf_layer: &str,
    i: usize,
    ffn: FeedForwardKind,
) -> Result<()> {
    let h = cfg.hidden_size;
    let hf = |t: &str| format!("{hf_layer}mlp.{t}");
    let canon = |t: &str| names::layer(i, t);
    let m = TensorRole::Matrix;
    let swiglu = |b: &mut PlanBuilder<'_>, tensors: [(&str, &str); 3], inter: usize| {
        let [(cg, hg), (cu, hu), (cd, hd)] = tensors;
        b.matrix(canon(cg), m, &hf(hg), inter, h)?;
        b.matrix(canon(cu), m, &hf(hu), inter, h)?;
        b.matrix(canon(cd), m, &hf(hd), h, inter)
    };
    match ffn {
        FeedForwardKind::Dense => {
            let inter = cfg.dense_intermediate_size.unwrap_or(0);
            swiglu(
                b,
                [
                    (names::MLP_GATE, "gate_proj.weight"),
                    (names::MLP_UP, "up_proj.weight"),
                    (names::MLP_DOWN, "down_proj.weight"),
                ],
                inter,
            )
        }
        FeedForwardKind::Moe => {
            let moe = &cfg.moe;
            b.matrix(
                canon(names::MOE_ROUTER),
                TensorRole::Router,
                &hf("gate.weight"),
                moe.num_experts,
                h,
            )?;
            if let Some(shared) = moe.shared_expert {
                let inter = shared.intermediate_size;
                swiglu(
                    b,
                    [
                        (names::SHARED_GATE, "shared_expert.gate_proj.weight"),
                        (names::SHARED_UP, "shared_expert.up_proj.weight"),
                        (names::SHARED_DOWN, "shared_expert.down_proj.weight"),
                    ],
                    inter,
                )?;
                if shared.gated {
                    b.matrix(
                        canon(names::SHARED_EXPERT_GATE),
                        TensorRole::Router,
                        &hf("shared_expert_gate.weight"),
                        1,
                        h,
                    )?;
                }
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
