//! DeepSeek-V3 / R1 and Kimi K2 (`deepseek_v3`, `kimi_k2`): multi-head
//! latent attention (queries through a low-rank `q_a_proj` → norm →
//! `q_b_proj`, or `q_proj`; a compressed latent and one rotary key from
//! `kv_a_proj_with_mqa`, expanded per head by `kv_b_proj`), rotary
//! embedding of interleaved pairs with YaRN and its softmax-scale
//! correction; the grouped sigmoid router, shared experts and leading
//! dense layers of `glm4_moe`'s helpers. Multi-token-prediction layers are
//! skipped.
//!
//! The conversion reorders each query head to put its rotary part first
//! and both rotary parts (the query's and the key's) into halves (evens,
//! then odds): the interleaved rotation becomes the NeoX one the backends
//! implement, and q·k is unchanged.

use super::glm4_moe::{deepseek_feed_forward, deepseek_moe, layers_and_mtp, mtp_layer};
use crate::arch::{Architecture, names};
use crate::config::{AttentionConfig, ConfigReader, LayerKind, MlaConfig, ModelConfig, NormStyle};
use crate::convert::plan::{CheckpointIndex, ConversionPlan, PlanBuilder, RowSource, TensorRole};
use crate::error::Result;
use crate::rope::get_mscale;

pub(super) fn parse_config(c: &ConfigReader<'_>) -> Result<ModelConfig> {
    c.require_silu()?;
    c.refuse_if_true(
        "attention_bias",
        "DeepSeek-V3 checkpoints have no attention biases",
    )?;
    let hidden_size = c.usize("hidden_size")?;
    let num_heads = c.usize("num_attention_heads")?;
    let mla = MlaConfig {
        q_lora_rank: c.opt_usize("q_lora_rank")?,
        kv_lora_rank: c.usize("kv_lora_rank")?,
        qk_nope_head_dim: c.usize("qk_nope_head_dim")?,
        qk_rope_head_dim: c.usize("qk_rope_head_dim")?,
        v_head_dim: c.usize("v_head_dim")?,
        rope_interleave: c.bool_or("rope_interleave", true)?,
        softmax_scale: 0.0,
    };
    let rope = c.rope(1.0)?;
    if rope.partial != 1.0 {
        return Err(
            c.error("partial_rotary_factor: DeepSeek-V3 rotates all qk_rope_head_dim features")
        );
    }
    // transformers' yarn_apply_mscale: the scale grows with the context
    // extension, squared since it multiplies both q and k.
    let mscale = match rope
        .yarn
        .and_then(|y| y.mscale_all_dim.map(|m| (y.factor, m)))
    {
        Some((factor, m)) if m != 0.0 => get_mscale(factor, m),
        _ => 1.0,
    };
    let softmax_scale = ((mla.qk_head_dim() as f64).powf(-0.5) * mscale * mscale) as f32;
    let num_layers = c.usize("num_hidden_layers")?;
    let moe = deepseek_moe(c)?;
    let (layers, mtp) = layers_and_mtp(c, num_layers, LayerKind::FullAttention, &moe, 3)?;
    Ok(ModelConfig {
        architecture: Architecture::DeepseekV3,
        vocab_size: c.usize("vocab_size")?,
        hidden_size,
        rms_norm_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        norm: NormStyle::Weight,
        tie_word_embeddings: c.bool_or("tie_word_embeddings", false)?,
        max_position_embeddings: c.usize_or("max_position_embeddings", 4096)?,
        // Latent attention expands keys and values for every query head.
        attention: AttentionConfig {
            num_kv_heads: num_heads,
            rotary_dim: mla.qk_rope_head_dim,
            ..super::grouped_query_attention(c, num_heads, mla.qk_head_dim(), &rope)?
        },
        mla: Some(MlaConfig {
            softmax_scale,
            ..mla
        }),
        linear_attention: None,
        moe,
        dense_intermediate_size: c.opt_usize("intermediate_size")?,
        layers,
        mtp,
    })
}

/// Source rows of `rotary` features starting at `start` of `tensor`, in
/// the order the converted rotation reads them: interleaved pairs split
/// into evens then odds when `interleaved`.
fn rotary_rows(tensor: &str, start: usize, rotary: usize, interleaved: bool) -> Vec<RowSource> {
    let order: Vec<usize> = match interleaved {
        true => (0..rotary)
            .step_by(2)
            .chain((1..rotary).step_by(2))
            .collect(),
        false => (0..rotary).collect(),
    };
    order
        .into_iter()
        .map(|i| RowSource {
            tensor: tensor.to_string(),
            row_start: start + i,
            rows: 1,
        })
        .collect()
}

pub(super) fn conversion_plan(cfg: &ModelConfig, ckpt: &CheckpointIndex) -> Result<ConversionPlan> {
    let mut b = PlanBuilder::new(ckpt);
    let p = ckpt.text_prefix();
    super::qwen3_moe::common_tensors(&mut b, cfg, p)?;
    for (i, spec) in cfg.layers.iter().enumerate() {
        latent_attention(&mut b, cfg, p, i)?;
        deepseek_feed_forward(&mut b, cfg, p, i, spec.ffn)?;
    }
    let skips = mtp_layer(&mut b, cfg, p, latent_attention)?;
    Ok(b.finish(&skips))
}

/// Multi-head latent attention of layer `i`: queries and the rotary key
/// reordered for the NeoX rotation.
fn latent_attention(b: &mut PlanBuilder<'_>, cfg: &ModelConfig, p: &str, i: usize) -> Result<()> {
    let mla = cfg.mla.as_ref().expect("deepseek_v3 configs have MLA");
    let interleaved = mla.rope_interleave;
    let (h, heads) = (cfg.hidden_size, cfg.attention.num_heads);
    let (nope, rope, qk) = (
        mla.qk_nope_head_dim,
        mla.qk_rope_head_dim,
        mla.qk_head_dim(),
    );
    let hf = |t: &str| format!("{p}layers.{i}.self_attn.{t}");
    let canon = |t: &str| names::layer(i, t);
    let m = TensorRole::Matrix;
    // Queries, each head reordered to [rotary (halves) | the rest].
    let (q_source, q_cols, q_canon) = match mla.q_lora_rank {
        Some(r) => {
            b.matrix(canon(names::MLA_Q_A), m, &hf("q_a_proj.weight"), r, h)?;
            b.vector(
                canon(names::MLA_Q_A_NORM),
                &hf("q_a_layernorm.weight"),
                &[r],
            )?;
            (hf("q_b_proj.weight"), r, names::MLA_Q_B)
        }
        None => (hf("q_proj.weight"), h, names::ATTN_Q),
    };
    b.expect(&q_source, &[heads * qk, q_cols])?;
    let mut rows = Vec::with_capacity(heads * qk);
    for head in 0..heads {
        rows.extend(rotary_rows(&q_source, head * qk + nope, rope, interleaved));
        rows.push(RowSource {
            tensor: q_source.clone(),
            row_start: head * qk,
            rows: nope,
        });
    }
    b.assembled(canon(q_canon), m, q_cols, rows);
    // The latent, then the rotary key (halves).
    let kv_a = hf("kv_a_proj_with_mqa.weight");
    b.expect(&kv_a, &[mla.kv_lora_rank + rope, h])?;
    let mut rows = vec![RowSource {
        tensor: kv_a.clone(),
        row_start: 0,
        rows: mla.kv_lora_rank,
    }];
    rows.extend(rotary_rows(&kv_a, mla.kv_lora_rank, rope, interleaved));
    b.assembled(canon(names::MLA_KV_A), m, h, rows);
    b.vector(
        canon(names::MLA_KV_A_NORM),
        &hf("kv_a_layernorm.weight"),
        &[mla.kv_lora_rank],
    )?;
    b.matrix(
        canon(names::MLA_KV_B),
        m,
        &hf("kv_b_proj.weight"),
        heads * (nope + mla.v_head_dim),
        mla.kv_lora_rank,
    )?;
    b.matrix(
        canon(names::ATTN_O),
        m,
        &hf("o_proj.weight"),
        h,
        heads * mla.v_head_dim,
    )?;
    Ok(())
}
