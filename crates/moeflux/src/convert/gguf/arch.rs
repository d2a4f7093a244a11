//! A GGUF of a family moeflux implements, mapped back to the Hugging Face
//! checkpoint the architecture plans read: the configuration rebuilt from
//! the `{arch}.*` metadata and the tensors present, and each Hugging Face
//! tensor a view of a GGUF tensor, undoing what llama.cpp's
//! convert_hf_to_gguf.py did to it:
//!
//! - names from gguf-py's tensor_mapping (`blk.N.attn_q.weight` is
//!   `model.layers.N.self_attn.q_proj.weight`, ...); Qwen3 Q/K weights are
//!   stored unpermuted (only llama-family models are permuted for rope);
//! - routed experts stacked as `ffn_{gate,up,down}_exps` `[E, rows, cols]`
//!   (or `ffn_gate_up_exps`), each expert a range of rows;
//! - Qwen3-Next / Qwen3.5: norms stored as `1 + w` (all but the gated
//!   `ssm_norm`), `A_log` as `ssm_a = -exp(A_log)`, `dt_bias` as
//!   `ssm_dt.bias`, the convolution squeezed to `[C, K]`; Qwen3-Next's fused
//!   `in_proj_qkvz` split into `attn_qkv` (all q, all k, all v) and
//!   `attn_gate` (z), `in_proj_ba` kept as `ssm_ba`; Qwen3.5's value heads
//!   reordered from grouped by key head to tiled (rows of `attn_qkv`'s v,
//!   `attn_gate`, `ssm_beta`, `ssm_alpha`, the convolution's v channels,
//!   `ssm_a`, `ssm_dt`, columns of `ssm_out`) when there are more value
//!   heads than key heads.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Value as Json, json};

use super::GgufStore;
use crate::convert::view::{Op, View};
use crate::error::{Error, Result};

pub(super) struct Mapped {
    pub config_json: Json,
    pub views: BTreeMap<String, View>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Family {
    Qwen3Moe,
    Qwen3Next,
    Qwen35Moe,
}

/// For heads grouped by key head (`g·r + j`, as Hugging Face stores them),
/// the index each element has in llama.cpp's tiled order (`j·nk + g`), for
/// heads of `dim` elements.
fn tiled(nk: usize, r: usize, dim: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(nk * r * dim);
    for g in 0..nk {
        for j in 0..r {
            let head = j * nk + g;
            out.extend((0..dim).map(|d| head * dim + d));
        }
    }
    out
}

struct Builder<'a> {
    store: &'a GgufStore,
    views: BTreeMap<String, View>,
}

impl Builder<'_> {
    fn has(&self, gguf: &str) -> bool {
        self.store.get(gguf).is_some()
    }

    /// ggml's dims of a tensor (fastest first).
    fn dims(&self, gguf: &str) -> Option<Vec<usize>> {
        self.store.get(gguf).map(|t| t.dims.clone())
    }

    /// A Hugging Face tensor as the whole GGUF tensor, when it exists.
    fn view(&mut self, hf: String, gguf: &str, op: Op) -> Option<&mut View> {
        let t = self.store.get(gguf)?;
        let mut v = View::of(gguf, t.hf_shape());
        v.op = op;
        self.views.insert(hf.clone(), v);
        self.views.get_mut(&hf)
    }

    fn error(&self, msg: impl Into<String>) -> Error {
        Error::bad_file(self.store.meta().path(), msg)
    }
}

pub(super) fn map(store: &GgufStore) -> Result<Mapped> {
    let meta = store.meta();
    let arch = meta
        .string("general.architecture")?
        .ok_or_else(|| {
            Error::bad_file(
                meta.path(),
                "GGUF metadata `general.architecture` is missing",
            )
        })?
        .to_string();
    let family = match arch.as_str() {
        "qwen3moe" => Family::Qwen3Moe,
        "qwen3next" => Family::Qwen3Next,
        "qwen35moe" => Family::Qwen35Moe,
        other => {
            return Err(Error::bad_file(
                meta.path(),
                format!(
                    "GGUF architecture `{other}` is not one moeflux implements \
                     (qwen3moe, qwen3next, qwen35moe)"
                ),
            ));
        }
    };
    let key = |k: &str| format!("{arch}.{k}");
    let opt =
        |k: &str| -> Result<Option<usize>> { meta.uint(&key(k)).map(|v| v.map(|v| v as usize)) };
    let req = |k: &str| -> Result<usize> {
        opt(k)?.ok_or_else(|| {
            Error::bad_file(
                meta.path(),
                format!("GGUF metadata `{}` is missing", key(k)),
            )
        })
    };
    let layers = req("block_count")?;
    let hidden = req("embedding_length")?;
    let heads = req("attention.head_count")?;
    let kv_heads = opt("attention.head_count_kv")?.unwrap_or(heads);
    let head_dim = match opt("attention.key_length")? {
        Some(d) => d,
        None => hidden / heads.max(1),
    };
    if let Some(v) = opt("attention.value_length")?
        && v != head_dim
    {
        return Err(Error::bad_file(
            meta.path(),
            format!(
                "GGUF: key length {head_dim} and value length {v} differ; moeflux needs them equal"
            ),
        ));
    }
    let eps = meta
        .float(&key("attention.layer_norm_rms_epsilon"))?
        .unwrap_or(1e-6);
    let theta = meta.float(&key("rope.freq_base"))?.unwrap_or(10000.0);
    let rope_dims = opt("rope.dimension_count")?.unwrap_or(head_dim);
    let context = opt("context_length")?.unwrap_or(32768);
    if let Some(func) = opt("expert_gating_func")?
        && func != 1
    {
        return Err(Error::bad_file(
            meta.path(),
            format!(
                "GGUF metadata `{}` is {func}: only softmax routing (1) is implemented",
                key("expert_gating_func")
            ),
        ));
    }

    let mut b = Builder {
        store,
        views: BTreeMap::new(),
    };
    let unit_offset = family != Family::Qwen3Moe;
    let norm_op = if unit_offset { Op::MinusOne } else { Op::None };

    let embed = b
        .dims("token_embd.weight")
        .ok_or_else(|| b.error("GGUF: `token_embd.weight` is missing"))?;
    let vocab = *embed.get(1).unwrap_or(&0);
    b.view(
        "model.embed_tokens.weight".into(),
        "token_embd.weight",
        Op::None,
    );
    b.view("model.norm.weight".into(), "output_norm.weight", norm_op);
    let tied = b
        .view("lm_head.weight".into(), "output.weight", Op::None)
        .is_none();

    let mut layer_types = Vec::with_capacity(layers);
    let mut dense_layers = Vec::new();
    let (mut moe_inter, mut shared_inter, mut dense_inter) = (None, None, None);
    let mut linear = None;
    for i in 0..layers {
        let blk = |t: &str| format!("blk.{i}.{t}");
        let hf = |t: &str| format!("model.layers.{i}.{t}");
        b.view(
            hf("input_layernorm.weight"),
            &blk("attn_norm.weight"),
            norm_op,
        );
        let post = if unit_offset {
            "post_attention_norm.weight"
        } else {
            "ffn_norm.weight"
        };
        b.view(hf("post_attention_layernorm.weight"), &blk(post), norm_op);

        if b.has(&blk("attn_q.weight")) {
            layer_types.push("full_attention");
            for (h, g) in [
                ("q_proj", "attn_q"),
                ("k_proj", "attn_k"),
                ("v_proj", "attn_v"),
                ("o_proj", "attn_output"),
            ] {
                b.view(
                    hf(&format!("self_attn.{h}.weight")),
                    &blk(&format!("{g}.weight")),
                    Op::None,
                );
            }
            b.view(
                hf("self_attn.q_norm.weight"),
                &blk("attn_q_norm.weight"),
                norm_op,
            );
            b.view(
                hf("self_attn.k_norm.weight"),
                &blk("attn_k_norm.weight"),
                norm_op,
            );
        } else if family != Family::Qwen3Moe && b.has(&blk("ssm_out.weight")) {
            layer_types.push("linear_attention");
            if b.has(&blk("ssm_in.weight")) && !b.has(&blk("attn_qkv.weight")) {
                return Err(b.error(format!(
                    "GGUF: layer {i} stores the fused `ssm_in` projection of early llama.cpp \
                     versions; convert the model again with a current llama.cpp"
                )));
            }
            let l = match linear {
                Some(l) => l,
                None => {
                    let l = LinearDims {
                        nk: req("ssm.group_count")?,
                        nv: req("ssm.time_step_rank")?,
                        dk: req("ssm.state_size")?,
                        dv: req("ssm.inner_size")? / req("ssm.time_step_rank")?.max(1),
                        kernel: req("ssm.conv_kernel")?,
                    };
                    if l.nk == 0 || !l.nv.is_multiple_of(l.nk) {
                        return Err(b.error(format!(
                            "GGUF: {} value heads are not a multiple of {} key heads",
                            l.nv, l.nk
                        )));
                    }
                    linear = Some(l);
                    l
                }
            };
            linear_attention(&mut b, family, i, l)?;
        } else {
            return Err(b.error(format!(
                "GGUF: layer {i} has neither attention (`{}`) nor {} tensors",
                blk("attn_q.weight"),
                if family == Family::Qwen3Moe {
                    "other mixer"
                } else {
                    "linear-attention (`ssm_out`)"
                }
            )));
        }

        if b.has(&blk("ffn_gate_inp.weight")) {
            b.view(hf("mlp.gate.weight"), &blk("ffn_gate_inp.weight"), Op::None);
            moe_inter = experts(&mut b, i)?.or(moe_inter);
            for (h, g) in [
                ("gate_proj", "ffn_gate_shexp"),
                ("up_proj", "ffn_up_shexp"),
                ("down_proj", "ffn_down_shexp"),
            ] {
                b.view(
                    hf(&format!("mlp.shared_expert.{h}.weight")),
                    &blk(&format!("{g}.weight")),
                    Op::None,
                );
            }
            if let Some(d) = b.dims(&blk("ffn_up_shexp.weight")) {
                shared_inter = d.get(1).copied();
            }
            if b.has(&blk("ffn_gate_inp_shexp.weight")) {
                // [hidden] or [1, hidden]: the Hugging Face gate is [1, hidden].
                let v = b
                    .view(
                        hf("mlp.shared_expert_gate.weight"),
                        &blk("ffn_gate_inp_shexp.weight"),
                        Op::None,
                    )
                    .expect("present");
                v.shape = vec![1, hidden];
            }
        } else if b.has(&blk("ffn_gate.weight")) {
            dense_layers.push(i);
            for (h, g) in [
                ("gate_proj", "ffn_gate"),
                ("up_proj", "ffn_up"),
                ("down_proj", "ffn_down"),
            ] {
                b.view(
                    hf(&format!("mlp.{h}.weight")),
                    &blk(&format!("{g}.weight")),
                    Op::None,
                );
            }
            dense_inter = b
                .dims(&blk("ffn_gate.weight"))
                .and_then(|d| d.get(1).copied());
        } else {
            return Err(b.error(format!(
                "GGUF: layer {i} has neither a router (`{}`) nor a dense MLP (`{}`)",
                blk("ffn_gate_inp.weight"),
                blk("ffn_gate.weight")
            )));
        }
    }

    let experts = opt("expert_count")?.unwrap_or(0);
    let mut config = json!({
        "hidden_act": "silu",
        "attention_bias": false,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "max_position_embeddings": context,
        "num_experts": experts,
        "num_experts_per_tok": opt("expert_used_count")?.unwrap_or(0),
        "moe_intermediate_size": opt("expert_feed_forward_length")?.or(moe_inter).unwrap_or(0),
        "norm_topk_prob": meta.bool(&key("expert_weights_norm"))?.unwrap_or(true),
        "tie_word_embeddings": tied,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense_layers,
    });
    let c = config.as_object_mut().expect("an object");
    if let Some(n) = opt("feed_forward_length")?.or(dense_inter) {
        c.insert("intermediate_size".into(), json!(n));
    }
    let partial = rope_dims as f64 / head_dim.max(1) as f64;
    let mut rope =
        json!({ "rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial });
    if let Some(kind) = meta.string(&key("rope.scaling.type"))?
        && kind != "none"
    {
        // Kept so that configuration parsing reads YaRN's settings and names
        // the types that are not implemented.
        let mut scaling = json!({ "rope_type": kind });
        if let Some(factor) = meta.float(&key("rope.scaling.factor"))? {
            scaling["factor"] = json!(factor);
        }
        if let Some(n) = opt("rope.scaling.original_context_length")? {
            scaling["original_max_position_embeddings"] = json!(n);
        }
        c.insert("rope_scaling".into(), scaling);
    }
    match family {
        Family::Qwen3Moe => {
            c.insert("architectures".into(), json!(["Qwen3MoeForCausalLM"]));
            c.insert("model_type".into(), json!("qwen3_moe"));
        }
        Family::Qwen3Next | Family::Qwen35Moe => {
            let l = linear.ok_or_else(|| b.error("GGUF: no linear-attention layer found"))?;
            if family == Family::Qwen3Next {
                c.insert("architectures".into(), json!(["Qwen3NextForCausalLM"]));
                c.insert("model_type".into(), json!("qwen3_next"));
            } else {
                c.insert("architectures".into(), json!(["Qwen3_5MoeForCausalLM"]));
                c.insert("model_type".into(), json!("qwen3_5_moe_text"));
                if let Some(sections) = meta.ints(&key("rope.dimension_sections"))? {
                    let s: Vec<i64> = sections.into_iter().take(3).collect();
                    rope["mrope_section"] = json!(s);
                    rope["mrope_interleaved"] = json!(true);
                }
            }
            c.insert("layer_types".into(), json!(layer_types));
            if let Some(n) = opt("full_attention_interval")? {
                c.insert("full_attention_interval".into(), json!(n));
            }
            c.insert("linear_num_key_heads".into(), json!(l.nk));
            c.insert("linear_num_value_heads".into(), json!(l.nv));
            c.insert("linear_key_head_dim".into(), json!(l.dk));
            c.insert("linear_value_head_dim".into(), json!(l.dv));
            c.insert("linear_conv_kernel_dim".into(), json!(l.kernel));
            if let Some(n) = opt("expert_shared_feed_forward_length")?.or(shared_inter) {
                c.insert("shared_expert_intermediate_size".into(), json!(n));
            }
        }
    }
    c.insert("rope_parameters".into(), rope);
    Ok(Mapped {
        config_json: config,
        views: b.views,
    })
}

#[derive(Clone, Copy, Debug)]
struct LinearDims {
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
    kernel: usize,
}

/// The routed experts of layer `i`, one view per expert and matrix; the
/// experts' intermediate size.
fn experts(b: &mut Builder<'_>, i: usize) -> Result<Option<usize>> {
    let blk = |t: &str| format!("blk.{i}.{t}");
    let per_expert = |b: &mut Builder<'_>, gguf: &str, proj: &str, offset: usize, rows: usize| {
        stacked(b, i, gguf, proj, offset, rows)
    };
    let fused = blk("ffn_gate_up_exps.weight");
    let inter = if b.has(&fused) {
        let dims = b.dims(&fused).expect("present");
        let inter = dims.get(1).copied().unwrap_or(0) / 2;
        per_expert(b, &fused, "gate_proj", 0, inter)?;
        per_expert(b, &fused, "up_proj", inter, inter)?;
        Some(inter)
    } else {
        let gate = blk("ffn_gate_exps.weight");
        let Some(dims) = b.dims(&gate) else {
            return Err(b.error(format!("GGUF: layer {i} has a router but no `{gate}`")));
        };
        let inter = dims.get(1).copied().unwrap_or(0);
        per_expert(b, &gate, "gate_proj", 0, inter)?;
        let up = blk("ffn_up_exps.weight");
        if !b.has(&up) {
            return Err(b.error(format!("GGUF: `{up}` is missing")));
        }
        per_expert(b, &up, "up_proj", 0, inter)?;
        Some(inter)
    };
    let down = blk("ffn_down_exps.weight");
    let Some(dims) = b.dims(&down) else {
        return Err(b.error(format!("GGUF: `{down}` is missing")));
    };
    let hidden = dims.get(1).copied().unwrap_or(0);
    per_expert(b, &down, "down_proj", 0, hidden)?;
    Ok(inter)
}

/// Expert `e`'s `proj` of layer `i`: rows `offset..offset + rows` of
/// expert `e`'s slice of the stacked `[E, stacked rows, cols]` tensor.
fn stacked(
    b: &mut Builder<'_>,
    i: usize,
    gguf: &str,
    proj: &str,
    offset: usize,
    rows: usize,
) -> Result<()> {
    let dims = b.dims(gguf).expect("checked present");
    let [cols, per, n] = dims[..] else {
        return Err(b.error(format!(
            "GGUF tensor `{gguf}`: {dims:?} is not [cols, rows, experts]"
        )));
    };
    for e in 0..n {
        let mut v = View::of(gguf, vec![rows, cols]);
        v.row_offset = e * per + offset;
        b.views
            .insert(format!("model.layers.{i}.mlp.experts.{e}.{proj}.weight"), v);
    }
    Ok(())
}

/// The Gated DeltaNet tensors of layer `i`.
fn linear_attention(b: &mut Builder<'_>, family: Family, i: usize, l: LinearDims) -> Result<()> {
    let blk = |t: &str| format!("blk.{i}.{t}");
    let hf = |t: &str| format!("model.layers.{i}.linear_attn.{t}");
    let r = l.nv / l.nk;
    let key_rows = 2 * l.nk * l.dk;
    // Qwen3.5 GGUFs hold the value heads tiled; Qwen3-Next's grouped.
    let reorder = family == Family::Qwen35Moe && r > 1;
    let rows_of =
        |dim: usize| -> Option<Arc<[usize]>> { reorder.then(|| tiled(l.nk, r, dim).into()) };
    let qkv_rows: Option<Arc<[usize]>> = reorder.then(|| {
        (0..key_rows)
            .chain(tiled(l.nk, r, l.dv).into_iter().map(|x| key_rows + x))
            .collect()
    });

    if let Some(v) = b.view(hf("in_proj_qkv.weight"), &blk("attn_qkv.weight"), Op::None) {
        v.rows = qkv_rows.clone();
    }
    if let Some(v) = b.view(hf("in_proj_z.weight"), &blk("attn_gate.weight"), Op::None) {
        v.rows = rows_of(l.dv);
    }
    match family {
        Family::Qwen3Next => {
            // ssm_ba: per key head g, r rows of b then r rows of a.
            let ba = blk("ssm_ba.weight");
            if let Some(dims) = b.dims(&ba) {
                let cols = dims[0];
                for (name, first) in [("in_proj_b.weight", 0), ("in_proj_a.weight", r)] {
                    let rows: Vec<usize> = (0..l.nk)
                        .flat_map(|g| (0..r).map(move |j| g * 2 * r + first + j))
                        .collect();
                    let mut v = View::of(&ba, vec![l.nv, cols]);
                    v.rows = Some(rows.into());
                    b.views.insert(hf(name), v);
                }
            }
        }
        _ => {
            for (name, gguf) in [
                ("in_proj_b.weight", "ssm_beta.weight"),
                ("in_proj_a.weight", "ssm_alpha.weight"),
            ] {
                if let Some(v) = b.view(hf(name), &blk(gguf), Op::None) {
                    v.rows = rows_of(1);
                }
            }
        }
    }
    if let Some(v) = b.view(hf("conv1d.weight"), &blk("ssm_conv1d.weight"), Op::None) {
        // Squeezed [C, K]; Hugging Face has [C, 1, K].
        if let [c, k] = v.shape[..] {
            v.shape = vec![c, 1, k];
        }
        v.rows = qkv_rows;
    }
    let cols = |dim: usize| -> Option<Arc<[usize]>> { reorder.then(|| tiled(l.nk, r, dim).into()) };
    if let Some(v) = b.view(hf("A_log"), &blk("ssm_a"), Op::LnOfNegated) {
        v.cols = cols(1);
    }
    if let Some(v) = b.view(hf("dt_bias"), &blk("ssm_dt.bias"), Op::None) {
        v.cols = cols(1);
    }
    b.view(hf("norm.weight"), &blk("ssm_norm.weight"), Op::None);
    if let Some(v) = b.view(hf("out_proj.weight"), &blk("ssm_out.weight"), Op::None) {
        v.cols = cols(l.dv);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::tiled;

    #[test]
    fn tiled_order_matches_llama_cpp() {
        // 2 key heads, 2 value heads each: grouped [G0v0, G0v1, G1v0, G1v1]
        // are stored tiled [G0v0, G1v0, G0v1, G1v1].
        assert_eq!(tiled(2, 2, 1), vec![0, 2, 1, 3]);
        assert_eq!(tiled(2, 2, 2), vec![0, 1, 4, 5, 2, 3, 6, 7]);
    }
}
