//! Qwen3-Next (`qwen3_next`) and Qwen3.5-MoE (`qwen3_5_moe`, text model):
//! layers alternate Gated DeltaNet linear attention and gated full
//! attention per `layer_types`; norms scale by `1 + w`; every MoE block has
//! a shared expert gated by `sigmoid(shared_expert_gate(x))`.
//!
//! The two differ only in checkpoint layout: Qwen3-Next fuses the
//! linear-attention input projections (`in_proj_qkvz`, `in_proj_ba`, grouped
//! per key head), Qwen3.5 keeps them separate and stores a multimodal
//! checkpoint's text weights under `model.language_model.`. The converter
//! maps both onto one canonical layout.

use crate::arch::qwen3_moe::{common_tensors, feed_forward, layer_norms};
use crate::arch::{Architecture, names};
use crate::config::{
    AttentionConfig, ConfigReader, ExpertActivation, LayerKind, LayerSpec, LinearAttentionConfig,
    ModelConfig, MoeConfig, MtpConfig, NormStyle, RouterSpec, SharedExpert,
};
use crate::convert::plan::{CheckpointIndex, ConversionPlan, PlanBuilder, RowSource, TensorRole};
use crate::error::Result;

pub(super) fn parse_config(arch: Architecture, top: &ConfigReader<'_>) -> Result<ModelConfig> {
    // A multimodal Qwen3.5 config nests the language model under text_config.
    let nested = top.object("text_config")?;
    let c = nested.as_ref().unwrap_or(top);
    c.require_silu()?;
    c.refuse_if_true(
        "attention_bias",
        "these checkpoints have no attention biases",
    )?;
    let hidden_size = c.usize("hidden_size")?;
    let num_heads = c.usize("num_attention_heads")?;
    let head_dim = c.usize_or("head_dim", hidden_size / num_heads.max(1))?;
    // mrope_section only matters for image/video positions; for text the
    // three position streams coincide and the rotation is plain RoPE.
    let rope = c.rope(0.25)?;
    let num_layers = c.usize("num_hidden_layers")?;
    let kinds: Vec<LayerKind> = match c.str_list("layer_types")? {
        Some(types) => types
            .iter()
            .map(|t| match *t {
                "linear_attention" | "mamba" => Ok(LayerKind::LinearAttention),
                "full_attention" | "attention" => Ok(LayerKind::FullAttention),
                other => Err(c.error(format!(
                    "layer_types: unknown layer type `{other}` (expected linear_attention or full_attention)"
                ))),
            })
            .collect::<Result<_>>()?,
        None => {
            let interval = c.usize_or("full_attention_interval", 4)?.max(1);
            (0..num_layers)
                .map(|i| {
                    if (i + 1) % interval == 0 {
                        LayerKind::FullAttention
                    } else {
                        LayerKind::LinearAttention
                    }
                })
                .collect()
        }
    };
    if kinds.len() != num_layers {
        return Err(c.error(format!(
            "layer_types lists {} layers but num_hidden_layers is {num_layers}",
            kinds.len()
        )));
    }
    let num_experts = c.num_experts()?;
    let layers = kinds
        .into_iter()
        .zip(c.feed_forward_kinds(num_layers)?)
        .map(|(kind, ffn)| LayerSpec { kind, ffn })
        .collect();
    // vLLM builds the MTP layer as a full-attention layer numbered 0, so
    // its feed-forward follows layer 0's rule.
    let mtp = match c.usize_or("mtp_num_hidden_layers", 0)? {
        0 => None,
        _ => Some(MtpConfig {
            layer: LayerSpec {
                kind: LayerKind::FullAttention,
                ffn: c.feed_forward_kinds(1)?[0],
            },
            zero_first_embedding: false,
            chain_normed: true,
        }),
    };
    Ok(ModelConfig {
        architecture: arch,
        vocab_size: c.usize("vocab_size")?,
        hidden_size,
        rms_norm_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        norm: NormStyle::UnitOffset,
        tie_word_embeddings: c.bool_or("tie_word_embeddings", false)?
            || top.bool_or("tie_word_embeddings", false)?,
        max_position_embeddings: c.usize_or("max_position_embeddings", 32768)?,
        attention: AttentionConfig {
            output_gate: true,
            qk_norm: true,
            ..super::grouped_query_attention(c, num_heads, head_dim, &rope)?
        },
        mla: None,
        linear_attention: Some(LinearAttentionConfig {
            num_key_heads: c.usize("linear_num_key_heads")?,
            num_value_heads: c.usize("linear_num_value_heads")?,
            key_head_dim: c.usize("linear_key_head_dim")?,
            value_head_dim: c.usize("linear_value_head_dim")?,
            conv_kernel: c.usize_or("linear_conv_kernel_dim", 4)?,
        }),
        moe: MoeConfig {
            num_experts,
            expert_intermediate_size: c.usize_or("moe_intermediate_size", 0)?,
            // Qwen3.5's router always renormalises (its config has no key).
            router: RouterSpec::softmax(
                c.usize_or("num_experts_per_tok", 0)?,
                c.bool_or("norm_topk_prob", true)?,
            ),
            shared_expert: c.opt_usize("shared_expert_intermediate_size")?.map(
                |intermediate_size| SharedExpert {
                    intermediate_size,
                    gated: true,
                },
            ),
            router_bias: false,
            expert_bias: false,
            expert_activation: ExpertActivation::SwiGlu,
        },
        dense_intermediate_size: c.opt_usize("intermediate_size")?,
        layers,
        mtp,
    })
}

pub(super) fn conversion_plan(cfg: &ModelConfig, ckpt: &CheckpointIndex) -> Result<ConversionPlan> {
    let mut b = PlanBuilder::new(ckpt);
    let p = ckpt.text_prefix();
    common_tensors(&mut b, cfg, p)?;
    for (i, spec) in cfg.layers.iter().enumerate() {
        let hf_layer = format!("{p}layers.{i}.");
        match spec.kind {
            LayerKind::FullAttention | LayerKind::SlidingAttention => {
                gated_attention(&mut b, cfg, &hf_layer, i)?
            }
            LayerKind::LinearAttention => gated_delta_net(&mut b, cfg, p, i)?,
        }
        feed_forward(&mut b, cfg, &hf_layer, i, spec.ffn)?;
    }
    let skip_mtp = mtp_head(&mut b, cfg)?;
    Ok(b.finish(&[
        ("model.visual.", "vision tower"),
        ("visual.", "vision tower"),
        ("mtp.", skip_mtp),
    ]))
}

/// The multi-token-prediction head (`mtp.*`), when `config.json` names one
/// (`mtp_num_hidden_layers`) and the checkpoint has it: the norms of the
/// embedding and hidden state, `fc` split per input, a full-attention
/// layer with the family's MoE, and the final norm. Returns why the rest
/// of `mtp.*` is left out.
fn mtp_head(b: &mut PlanBuilder<'_>, cfg: &ModelConfig) -> Result<&'static str> {
    let (Some(mtp), Some(n)) = (&cfg.mtp, cfg.mtp_layer()) else {
        return Ok(
            "multi-token-prediction head, which config.json does not name \
                   (mtp_num_hidden_layers)",
        );
    };
    if !b.checkpoint().contains("mtp.fc.weight") {
        return Ok("incomplete multi-token-prediction head (no mtp.fc.weight)");
    }
    let h = cfg.hidden_size;
    b.vector(
        names::MTP_EMBED_NORM.into(),
        "mtp.pre_fc_norm_embedding.weight",
        &[h],
    )?;
    b.vector(
        names::MTP_HIDDEN_NORM.into(),
        "mtp.pre_fc_norm_hidden.weight",
        &[h],
    )?;
    for (canon, start) in [(names::MTP_FC_EMBED, 0), (names::MTP_FC_HIDDEN, h)] {
        b.matrix_columns(
            canon.into(),
            TensorRole::Matrix,
            "mtp.fc.weight",
            [h, 2 * h],
            start,
            h,
        )?;
    }
    b.vector(names::MTP_NORM.into(), "mtp.norm.weight", &[h])?;
    let hf_layer = "mtp.layers.0.";
    layer_norms(b, cfg, hf_layer, n)?;
    gated_attention(b, cfg, hf_layer, n)?;
    feed_forward(b, cfg, hf_layer, n, mtp.layer.ffn)?;
    Ok("multi-token-prediction layer after the first (moeflux runs one)")
}

/// Gated attention of layer `i`, stored under `hf_layer`. The
/// checkpoint's `q_proj` interleaves each head's query and output gate;
/// the canonical `q_proj` holds all queries, then all gates.
fn gated_attention(
    b: &mut PlanBuilder<'_>,
    cfg: &ModelConfig,
    hf_layer: &str,
    i: usize,
) -> Result<()> {
    let a = &cfg.attention;
    let h = cfg.hidden_size;
    let (hd, q_dim, kv_dim) = (
        a.head_dim,
        a.num_heads * a.head_dim,
        a.num_kv_heads * a.head_dim,
    );
    let hf = |t: &str| format!("{hf_layer}self_attn.{t}");
    let canon = |t: &str| names::layer(i, t);
    let q_proj = hf("q_proj.weight");
    b.expect(&q_proj, &[2 * q_dim, h])?;
    let sources = (0..2)
        .flat_map(|part| (0..a.num_heads).map(move |head| (part, head)))
        .map(|(part, head)| RowSource {
            tensor: q_proj.clone(),
            row_start: head * 2 * hd + part * hd,
            rows: hd,
        })
        .collect();
    b.assembled(canon(names::ATTN_Q), TensorRole::Matrix, h, sources);
    let m = TensorRole::Matrix;
    b.matrix(canon(names::ATTN_K), m, &hf("k_proj.weight"), kv_dim, h)?;
    b.matrix(canon(names::ATTN_V), m, &hf("v_proj.weight"), kv_dim, h)?;
    b.matrix(canon(names::ATTN_O), m, &hf("o_proj.weight"), h, q_dim)?;
    b.vector(canon(names::ATTN_Q_NORM), &hf("q_norm.weight"), &[hd])?;
    b.vector(canon(names::ATTN_K_NORM), &hf("k_norm.weight"), &[hd])
}

/// Gated DeltaNet. The canonical input projection stacks the rows of q, k,
/// v (the convolution's channels), z, b and a, whichever way the checkpoint
/// stores them.
fn gated_delta_net(b: &mut PlanBuilder<'_>, cfg: &ModelConfig, p: &str, i: usize) -> Result<()> {
    let l = cfg
        .linear_attention
        .as_ref()
        .expect("validated: linear layers have settings");
    let h = cfg.hidden_size;
    let (nk, nv, dk, dv) = (
        l.num_key_heads,
        l.num_value_heads,
        l.key_head_dim,
        l.value_head_dim,
    );
    let hf = |t: &str| format!("{p}layers.{i}.linear_attn.{t}");
    let canon = |t: &str| names::layer(i, t);
    let row = |tensor: &str, row_start, rows| RowSource {
        tensor: tensor.to_string(),
        row_start,
        rows,
    };
    let fused_qkvz = hf("in_proj_qkvz.weight");
    let sources = if b.checkpoint().contains(&fused_qkvz) {
        // Grouped per key head g: [q_g | k_g | v_g (r heads) | z_g (r heads)],
        // and [b_g (r) | a_g (r)], with r = value heads per key head.
        let r = nv / nk;
        let group = 2 * dk + 2 * r * dv;
        let fused_ba = hf("in_proj_ba.weight");
        b.expect(&fused_qkvz, &[nk * group, h])?;
        b.expect(&fused_ba, &[2 * nv, h])?;
        let part = |offset: usize, rows: usize| (0..nk).map(move |g| (g * group + offset, rows));
        part(0, dk)
            .chain(part(dk, dk))
            .chain(part(2 * dk, r * dv))
            .chain(part(2 * dk + r * dv, r * dv))
            .map(|(start, rows)| row(&fused_qkvz, start, rows))
            .chain((0..nk).map(|g| row(&fused_ba, g * 2 * r, r)))
            .chain((0..nk).map(|g| row(&fused_ba, g * 2 * r + r, r)))
            .collect()
    } else {
        let parts = [
            ("in_proj_qkv.weight", l.conv_dim()),
            ("in_proj_z.weight", l.value_dim()),
            ("in_proj_b.weight", nv),
            ("in_proj_a.weight", nv),
        ];
        let mut sources = Vec::new();
        for (name, rows) in parts {
            b.expect(&hf(name), &[rows, h])?;
            sources.push(row(&hf(name), 0, rows));
        }
        sources
    };
    b.assembled(canon(names::LINEAR_IN_PROJ), TensorRole::Matrix, h, sources);
    b.vector(
        canon(names::LINEAR_CONV),
        &hf("conv1d.weight"),
        &[l.conv_dim(), 1, l.conv_kernel],
    )?;
    b.vector(canon(names::LINEAR_A_LOG), &hf("A_log"), &[nv])?;
    b.vector(canon(names::LINEAR_DT_BIAS), &hf("dt_bias"), &[nv])?;
    b.vector(canon(names::LINEAR_NORM), &hf("norm.weight"), &[dv])?;
    b.matrix(
        canon(names::LINEAR_OUT_PROJ),
        TensorRole::Matrix,
        &hf("out_proj.weight"),
        h,
        l.value_dim(),
    )
}
