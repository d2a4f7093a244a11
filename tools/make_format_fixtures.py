#!/usr/bin/env python3
"""Write the test data of moeflux's checkpoint formats (fixtures/formats/).

The Rust tests `crates/moeflux/tests/format_*.rs` convert these files and
compare the results with the numbers recorded here, computed by each
ecosystem's own tools.  Everything is derived from the transformers fixtures
under fixtures/*/hf (tools/make_fixtures.py) and the bundled model, so a
re-run reproduces every file bit for bit.

Usage (needs numpy, safetensors, ml_dtypes and gguf; no torch, no network):

    python -m venv /tmp/venv && /tmp/venv/bin/pip install numpy safetensors ml_dtypes gguf
    /tmp/venv/bin/python tools/make_format_fixtures.py            # all of fixtures/formats/
    /tmp/venv/bin/python tools/make_format_fixtures.py fp8 mlx    # some of them
    /tmp/venv/bin/python tools/make_format_fixtures.py bundled-gguf --out target/format-fixtures/qwen35-tiny.gguf

What is written (fixtures/formats/):

fp8_qwen3_moe/      FP8 safetensors as DeepSeek-V3 and Qwen3-*-FP8 ship them:
                    fixtures/qwen3_moe_sparse_step re-encoded, every projection
                    and expert matrix float8_e4m3fn (ml_dtypes) with a
                    `weight_scale_inv` per 128x128 block (amax / 448; f32, bf16
                    for the fused expert tensors), router, embeddings, lm_head
                    and norms left in bf16; config.json with
                    quantization_config {quant_method: fp8, weight_block_size}.
                    reference.safetensors: the first rows of two tensors
                    dequantized by ml_dtypes (e4m3 -> f32 times the block's
                    scale, in f32).
mlx_qwen3_5_moe/    MLX affine quantization as mlx-community ships it:
                    fixtures/qwen3_5_moe re-encoded the way `mlx_lm.convert -q`
                    does (model.sanitize: experts stacked into switch_mlp, the
                    `1 + w` norms shifted, conv1d as [C, K, 1], the
                    language_model.model. prefix; nn.quantize with 4 bits in
                    groups of 64, routers and the shared-expert gate 8 bits).
                    MLX does not run on Linux x86, so mx.quantize is
                    reproduced in numpy from mlx/ops.cpp (affine_quantize:
                    computed in the weight's dtype, bf16; scale = (max - min)
                    / (2^bits - 1) with the sign and edge chosen so zero is
                    exact; codes packed lowest bits first into uint32).  One
                    matrix (layer 3 o_proj) is stored 8 bits in groups of 32,
                    a configuration moeflux must re-quantize.
                    reference.safetensors: the first rows of four tensors
                    dequantized in numpy (q * scale + bias in f32).
gguf/qwen3_5_moe-00001-of-00002.gguf, gguf/qwen3_5_moe-00002-of-00002.gguf
                    fixtures/qwen3_5_moe written by the `gguf` package the way
                    llama.cpp's convert_hf_to_gguf.py writes Qwen3.5-MoE
                    (Qwen3_5MoeTextModel: tensor names from gguf's
                    tensor_mapping, experts stacked, `1 + w` norms, A_log as
                    -exp(A_log), dt_bias as ssm_dt.bias, conv1d squeezed,
                    value heads reordered from grouped to tiled) and quantized
                    with gguf.quants: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16
                    and F32 tensors; split in two parts (40 tensors in the
                    first), as --split-max-tensors writes them.
gguf/types.gguf     one [2, 512] tensor of every type moeflux reads (F32, F16,
                    BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 quantized by
                    gguf.quants; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, which
                    gguf.quants cannot quantize, as random codes with sane f16
                    scales), and the same values dequantized by
                    gguf.quants.dequantize as `ref.<type>` F32 tensors.
gguf/vocab.gguf     the bundled model's tokenizer and chat template as
                    convert_hf_to_gguf.py writes them (a vocabulary-only GGUF,
                    like llama.cpp's models/ggml-vocab-*.gguf); pre-tokenizer
                    `qwen2`, whose regex the bundled tokenizer uses.
gguf/malformed/     damaged GGUF files (truncated, huge counts, bad types,
                    overlapping or out-of-file tensor data, misaligned offsets,
                    a bad magic or version); each must be refused with a clear
                    error.

Not committed (too large), for the opt-in tests
(`cargo test -p moeflux --test engine format_gguf -- --ignored`):

    tools/make_format_fixtures.py bundled-gguf --out target/format-fixtures/qwen35-tiny.gguf
        the bundled model (bundled/qwen35-tiny) as a BF16 GGUF with its
        tokenizer and chat template (16 MB); generation through it must give
        the bundled model's text.
    tools/make_format_fixtures.py families-gguf --out target/format-fixtures
        the qwen3_moe, qwen3_next and qwen3_5_moe fixtures as Q8_0 GGUFs
        (qwen3moe, qwen3next, qwen35moe); logits against their bf16
        conversions.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
OUT = FIXTURES / "formats"
BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn


# --------------------------------------------------------------------------
# safetensors without torch


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy (bf16 as ml_dtypes)."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    dtypes = {"BF16": BF16, "F16": np.float16, "F32": np.float32}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        raw = data[8 + n + lo : 8 + n + hi]
        out[name] = np.frombuffer(raw, dtype=dtypes[info["dtype"]]).reshape(info["shape"]).copy()
    return out


def write_config(path: Path, config: dict) -> None:
    path.write_text(json.dumps(config, indent=2) + "\n")


# --------------------------------------------------------------------------
# FP8


FP8_BLOCK = (128, 128)
E4M3_MAX = 448.0


def fp8_quantize(w: np.ndarray, scale_dtype) -> tuple[np.ndarray, np.ndarray]:
    """Block-wise e4m3: one scale (amax / 448) per 128x128 block of the last
    two dimensions, as DeepSeek-V3's and Qwen's FP8 checkpoints have."""
    w = w.astype(np.float32)
    *lead, rows, cols = w.shape
    br, bc = FP8_BLOCK
    nr, nc = -(-rows // br), -(-cols // bc)
    scales = np.zeros((*lead, nr, nc), dtype=np.float32)
    q = np.zeros(w.shape, dtype=E4M3)
    for i in range(nr):
        for j in range(nc):
            block = w[..., i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            amax = np.abs(block).max(axis=(-1, -2))
            s = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
            s = s.astype(scale_dtype).astype(np.float32)
            scales[..., i, j] = s
            q[..., i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (
                block / s[..., None, None]
            ).astype(E4M3)
    return q, scales.astype(scale_dtype)


def fp8_dequantize(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The reference: ml_dtypes' e4m3 values times the block's scale, f32."""
    br, bc = FP8_BLOCK
    s = scales.astype(np.float32)
    s = np.repeat(np.repeat(s, br, axis=-2), bc, axis=-1)
    s = s[..., : q.shape[-2], : q.shape[-1]]
    return q.astype(np.float32) * s


FP8_REFERENCE = (
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.3.mlp.experts.down_proj",
)


def make_fp8() -> None:
    src = FIXTURES / "qwen3_moe_sparse_step" / "hf"
    out = OUT / "fp8_qwen3_moe"
    out.mkdir(parents=True, exist_ok=True)
    tensors = read_safetensors(src / "model.safetensors")
    written, reference = {}, {}
    for name, w in tensors.items():
        matrix = w.ndim >= 2 and (".self_attn." in name or ".mlp." in name)
        if not matrix or name.endswith("mlp.gate.weight"):
            written[name] = w
            continue
        fused = name.endswith("gate_up_proj") or name.endswith("experts.down_proj")
        scale_dtype = BF16 if fused else np.float32
        q, s = fp8_quantize(w, scale_dtype)
        # transformers names fused expert tensors without `.weight`; the FP8
        # scale sits beside them with `_scale_inv` appended, as for `weight`.
        written[name] = q
        written[name + "_scale_inv"] = s
        if name in FP8_REFERENCE:
            # the first two experts of a fused tensor keep the file small
            reference[name] = fp8_dequantize(q, s)[:2]
    save_file(written, str(out / "model.safetensors"))
    save_file(reference, str(out / "reference.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(FP8_BLOCK),
    }
    write_config(out / "config.json", config)
    print(f"wrote {out}")


# --------------------------------------------------------------------------
# MLX


def mx_quantize(w: np.ndarray, group_size: int, bits: int):
    """mx.quantize (affine mode) as mlx/ops.cpp's affine_quantize computes it
    on the CPU, every operation in the weight's dtype (here bf16)."""
    dt = w.dtype
    n_bins = np.array((1 << bits) - 1, dtype=dt)
    eps = np.array(1e-7, dtype=dt)
    g = w.reshape(-1, w.shape[-1] // group_size, group_size)
    w_max = g.max(axis=-1, keepdims=True)
    w_min = g.min(axis=-1, keepdims=True)
    mask = np.abs(w_min) > np.abs(w_max)
    scales = np.maximum(((w_max - w_min).astype(dt) / n_bins).astype(dt), eps)
    scales = np.where(mask, scales, -scales).astype(dt)
    edge = np.where(mask, w_min, w_max).astype(dt)
    q0 = np.round((edge / scales).astype(dt)).astype(dt)
    scales = np.where(q0 != 0, (edge / np.where(q0 != 0, q0, 1)).astype(dt), scales).astype(dt)
    biases = np.where(q0 == 0, np.zeros((), dt), edge).astype(dt)
    q = np.clip(np.round(((g - biases).astype(dt) / scales).astype(dt)), 0, (1 << bits) - 1)
    q = q.astype(np.uint32).reshape(w.shape[0:-1] + (-1,))
    per = 32 // bits
    q = q.reshape(q.shape[:-1] + (-1, per))
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    packed = np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)
    lead = w.shape[:-1]
    return (
        packed.reshape(lead + (-1,)),
        scales.reshape(lead + (-1,)),
        biases.reshape(lead + (-1,)),
    )


def mx_dequantize(packed, scales, biases, group_size: int, bits: int) -> np.ndarray:
    """The reference dequantization: q * scale + bias in f32."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    q = (packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(packed.shape[:-1] + (-1,)).astype(np.float32)
    s = np.repeat(scales.astype(np.float32), group_size, axis=-1)
    b = np.repeat(biases.astype(np.float32), group_size, axis=-1)
    return q * s + b


MLX_REFERENCE = (
    "language_model.model.layers.0.linear_attn.in_proj_qkv.weight",
    "language_model.model.layers.0.mlp.gate.weight",
    "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight",
    "language_model.model.layers.3.self_attn.o_proj.weight",
)


def make_mlx() -> None:
    src = FIXTURES / "qwen3_5_moe" / "hf"
    out = OUT / "mlx_qwen3_5_moe"
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    hf = read_safetensors(src / "model.safetensors")
    # Model.sanitize (mlx_lm/models/qwen3_5_moe.py, qwen3_5.py): prefix,
    # experts stacked, conv1d moved to [C, K, 1], `1 + w` norms shifted.
    weights = {}
    for name, w in hf.items():
        if name.startswith("model."):
            name = "language_model.model." + name[len("model.") :]
        else:
            name = "language_model." + name
        weights[name] = w
    for l in range(layers):
        prefix = f"language_model.model.layers.{l}.mlp"
        for n in ("gate_proj", "up_proj", "down_proj"):
            stack = [weights.pop(f"{prefix}.experts.{e}.{n}.weight") for e in range(experts)]
            weights[f"{prefix}.switch_mlp.{n}.weight"] = np.stack(stack)
    norms = (
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        "model.norm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    )
    for name, w in list(weights.items()):
        if "conv1d.weight" in name and w.shape[-1] != 1:
            weights[name] = np.moveaxis(w, 2, 1).copy()
        if any(name.endswith(s) for s in norms) and w.ndim == 1:
            weights[name] = (w + np.array(1.0, dtype=w.dtype)).astype(w.dtype)
    # nn.quantize with the model's quant_predicate: Linear, SwitchLinear and
    # Embedding weights whose input size divides the group; routers and the
    # shared-expert gate 8 bits.
    quantization = {"group_size": 64, "bits": 4, "mode": "affine"}
    odd = "language_model.model.layers.3.self_attn.o_proj"
    written, reference = {}, {}
    for name, w in weights.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        linear = module is not None and w.ndim >= 2 and "conv1d" not in name and "norm" not in name
        if not linear:
            written[name] = w
            continue
        bits, group = 4, 64
        if module.endswith("mlp.gate") or module.endswith("shared_expert_gate"):
            bits, group = 8, 64
        if module == odd:
            bits, group = 8, 32
        if (bits, group) != (4, 64):
            quantization[module] = {"group_size": group, "bits": bits}
        packed, scales, biases = mx_quantize(w, group, bits)
        written[name] = packed
        written[module + ".scales"] = scales
        written[module + ".biases"] = biases
        if name in MLX_REFERENCE:
            reference[name] = mx_dequantize(packed, scales, biases, group, bits)[:2]
    save_file(written, str(out / "model.safetensors"))
    save_file(reference, str(out / "reference.safetensors"))
    config["quantization"] = quantization
    config["quantization_config"] = quantization
    write_config(out / "config.json", config)
    print(f"wrote {out}")



# --------------------------------------------------------------------------
# GGUF


def gguf_tensor(writer, name: str, data: np.ndarray, qtype) -> None:
    """Adds a tensor quantized by gguf.quants (F32 kept as is)."""
    import gguf

    data = np.ascontiguousarray(data.astype(np.float32))
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def reorder_v_heads(t: np.ndarray, dim: int, nk: int, r: int, head_dim: int) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by
    key head -> tiled."""
    shape = list(t.shape)
    dim %= len(shape)
    new = shape[:dim] + [nk, r, head_dim] + shape[dim + 1 :]
    t = t.reshape(new)
    perm = list(range(len(new)))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.transpose(perm).reshape(shape)


GGUF_ARCHES = {
    "qwen3_moe": "QWEN3MOE",
    "qwen3_next": "QWEN3NEXT",
    "qwen3_5_moe": "QWEN35MOE",
    "qwen3_5_moe_text": "QWEN35MOE",
}


def gguf_arch(config: dict):
    import gguf

    return getattr(gguf.MODEL_ARCH, GGUF_ARCHES[config["model_type"]])


def gguf_tensors(hf: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """The tensors convert_hf_to_gguf.py writes for Qwen3MoeForCausalLM,
    Qwen3NextForCausalLM and Qwen3_5MoeForCausalLM, as f32 arrays in
    Hugging Face order: Qwen3_5MoeTextModel's _LinearAttentionVReorderBase,
    then Qwen3NextModel.modify_tensors (A_log, dt_bias, conv1d, `1 + w`
    norms, in_proj_qkvz split), Qwen2MoeModel's expert stacking (fused
    gate_up_proj split) and gguf-py's tensor_mapping. Dense MLP layers
    (mlp_only_layers), which these llama.cpp architectures do not list, get
    ggml's generic ffn_gate/ffn_up/ffn_down names."""
    import gguf

    arch = gguf_arch(config)
    c = config.get("text_config", config)
    layers, experts = c["num_hidden_layers"], c.get("num_experts", c.get("num_local_experts"))
    next_family = arch != gguf.MODEL_ARCH.QWEN3MOE
    if next_family:
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        r = nv // nk
    reorder = arch == gguf.MODEL_ARCH.QWEN35MOE and r > 1
    tmap = gguf.get_tensor_name_map(arch, layers)
    out = {}
    pending: dict[str, np.ndarray] = {}

    def emit(name: str, w: np.ndarray) -> None:
        mapped = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            for hf_proj, g in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                parts = name.split(".")
                if name.endswith(f".mlp.{hf_proj}.weight"):
                    mapped = f"blk.{parts[2]}.{g}.weight"
        assert mapped is not None, name
        out[mapped] = w

    for name, w in hf.items():
        name = name.replace("model.language_model.", "model.")
        w = w.astype(np.float32)
        if name.startswith(("mtp.", "model.visual.")):
            continue
        if reorder and "linear_attn." in name:
            if ".in_proj_qkv." in name:
                q, k, v = w[: nk * dk], w[nk * dk : 2 * nk * dk], w[2 * nk * dk :]
                w = np.concatenate([q, k, reorder_v_heads(v, 0, nk, r, dv)])
            elif ".in_proj_z." in name:
                w = reorder_v_heads(w, 0, nk, r, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                w = reorder_v_heads(w, 0, nk, r, 1)
            elif ".A_log" in name or ".dt_bias" in name:
                w = reorder_v_heads(w[:, None], 0, nk, r, 1)[:, 0]
            elif ".conv1d" in name:
                w = w.squeeze()
                qk = 2 * nk * dk
                w = np.concatenate([w[:qk], reorder_v_heads(w[qk:], 0, nk, r, dv)])
            elif ".out_proj." in name:
                w = reorder_v_heads(w, 1, nk, r, dv)
        if next_family:
            if name.endswith(".A_log"):
                w = -np.exp(w)
            elif name.endswith(".dt_bias"):
                name = name[: -len(".dt_bias")] + ".dt_proj.bias"
            elif "conv1d" in name:
                w = w.squeeze()
            elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                w = w + 1
            if "in_proj_qkvz.weight" in name:
                # [q, k, v, z] per key head -> all q, all k, all v | all z
                hidden = w.shape[1]
                split = [dk, dk, r * dv, r * dv]
                t = w.T.reshape(hidden, nk, sum(split))
                q, k, v, z = np.split(t, np.cumsum(split)[:-1], axis=-1)
                flat = [x.reshape(hidden, -1) for x in (q, k, v, z)]
                bid = name.split(".")[2]
                out[f"blk.{bid}.attn_qkv.weight"] = np.concatenate(flat[:3], axis=-1).T.copy()
                out[f"blk.{bid}.attn_gate.weight"] = flat[3].T.copy()
                continue
        if name.endswith("mlp.experts.gate_up_proj"):
            half = w.shape[-2] // 2
            emit(name.replace("gate_up_proj", "gate_proj.weight"), w[..., :half, :])
            emit(name.replace("gate_up_proj", "up_proj.weight"), w[..., half:, :])
            continue
        if name.endswith("mlp.experts.down_proj"):
            emit(name + ".weight", w)
            continue
        if ".mlp.experts." in name:
            pending[name] = w
            continue
        emit(name, w)
    for l in range(layers):
        for proj in ("down_proj", "gate_proj", "up_proj"):
            names = [f"model.layers.{l}.mlp.experts.{e}.{proj}.weight" for e in range(experts)]
            if names[0] in pending:
                emit(f"model.layers.{l}.mlp.experts.{proj}.weight", np.stack([pending.pop(n) for n in names]))
    assert not pending, pending.keys()
    return out


def gguf_metadata(writer, config: dict) -> None:
    """set_gguf_parameters of the three model classes (TextModel,
    Qwen2MoeModel, Qwen3NextModel, _Qwen35MRopeMixin)."""
    import gguf

    arch = gguf_arch(config)
    c = config.get("text_config", config)
    rope = c.get("rope_parameters", {})
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    if "intermediate_size" in c:
        writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    if arch == gguf.MODEL_ARCH.QWEN35MOE:
        sections = list(rope.get("mrope_section", [11, 11, 10]))
        writer.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
    writer.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta")))
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_expert_count(c.get("num_experts", c.get("num_local_experts")))
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if not c.get("norm_topk_prob", True):
        # llama.cpp's Qwen3-MoE assumes renormalised top-k weights and its
        # converter does not record the setting; written here so that a
        # fixture without renormalisation converts to the same model.
        writer.add_expert_weights_norm(False)
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        return
    writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(c["linear_key_head_dim"])
    writer.add_ssm_group_count(c["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(c["linear_num_value_heads"])
    writer.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    writer.add_full_attention_interval(c.get("full_attention_interval", 4))
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
    writer.add_rope_dimension_count(int(c["head_dim"] * partial))


def gguf_vocab(writer, tokenizer_dir: Path, n_vocab: int) -> None:
    """TextModel._set_vocab_gpt2 (get_vocab_base without transformers: the
    vocabulary and added tokens read from tokenizer.json) and
    gguf.SpecialVocab for merges, special ids and the chat template. The
    pre-tokenizer is `qwen2`: the bundled tokenizer splits with Qwen2's
    regex (convert_hf_to_gguf.py would identify it by a hash of its
    output, which only Qwen's own vocabulary matches)."""
    import gguf

    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    added = {t["id"]: t for t in tok["added_tokens"]}
    for i, t in added.items():
        vocab[t["content"]] = i
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        tokens.append(token)
        if i in added:
            looks_special = token.startswith("<|") and token.endswith("|>")
            types.append(
                gguf.TokenType.CONTROL
                if added[i]["special"] or looks_special
                else gguf.TokenType.USER_DEFINED
            )
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=n_vocab)
    special.add_to_gguf(writer)


# Per tensor type of the qwen3_5_moe fixture's GGUF: every block type whose
# 32-value blocks fit its 64-wide rows (K-quants need 256).
def fixture_qtype(name: str):
    import gguf

    T = gguf.GGMLQuantizationType
    rules = [
        ("token_embd", T.Q8_0),
        ("output.", T.Q8_0),
        ("attn_qkv", T.Q8_0),
        ("attn_gate", T.Q5_1),
        ("ssm_beta", T.F16),
        ("ssm_alpha", T.BF16),
        ("ssm_out", T.Q5_0),
        ("ffn_gate_inp.", T.F32),
        ("ffn_gate_inp_shexp", T.F16),
        ("blk.0.ffn_gate_shexp", T.BF16),
        ("blk.0.ffn_up_shexp", T.BF16),
        ("blk.0.ffn_down_shexp", T.F16),
        ("shexp", T.Q5_1),
        ("blk.0.ffn_gate_exps", T.Q4_0),
        ("blk.1.ffn_gate_exps", T.Q4_0),
        ("ffn_gate_exps", T.Q4_1),
        ("blk.0.ffn_up_exps", T.Q5_0),
        ("blk.1.ffn_up_exps", T.Q5_0),
        ("ffn_up_exps", T.Q5_1),
        ("blk.0.ffn_down_exps", T.Q8_0),
        ("blk.1.ffn_down_exps", T.Q8_0),
        ("ffn_down_exps", T.Q4_0),
        ("attn_q.", T.Q8_0),
        ("attn_k.", T.Q4_1),
        ("attn_v.", T.Q5_1),
        ("attn_output", T.Q8_0),
    ]
    for key, t in rules:
        if key in name:
            return t
    return T.F32


def write_gguf(
    src: Path, out: Path, qtype, tokenizer_dir: Path | None, split_max_tensors: int = 0
) -> None:
    """A Hugging Face checkpoint folder (one safetensors file) as GGUF."""
    import gguf

    config = json.loads((src / "config.json").read_text())
    hf = read_safetensors(src / "model.safetensors")
    writer = gguf.GGUFWriter(
        str(out),
        gguf.MODEL_ARCH_NAMES[gguf_arch(config)],
        split_max_tensors=split_max_tensors,
    )
    writer.add_name(src.parent.name if src.name == "hf" else src.name)
    gguf_metadata(writer, config)
    if tokenizer_dir is not None:
        gguf_vocab(writer, tokenizer_dir, config.get("text_config", config)["vocab_size"])
    for name, w in gguf_tensors(hf, config).items():
        # convert_hf_to_gguf.py keeps 1-D tensors, norms and the
        # convolution in F32.
        one_d = w.ndim <= 1 or name.endswith("_norm.weight") or "ssm_conv1d" in name
        gguf_tensor(writer, name, w, gguf.GGMLQuantizationType.F32 if one_d else qtype(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_gguf() -> None:
    import gguf

    out = OUT / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("qwen3_5_moe*.gguf"):
        old.unlink()
    # Split in two parts, as gguf-split and convert_hf_to_gguf.py
    # --split-max-tensors write them.
    write_gguf(FIXTURES / "qwen3_5_moe" / "hf", out / "qwen3_5_moe.gguf", fixture_qtype, None, 40)
    print(f"wrote {out}/qwen3_5_moe-0000[12]-of-00002.gguf")

    # Every type: gguf.quants quantizes the 32-block types; it has no
    # K-quant quantizer, so K-quant blocks are random bytes with sane f16
    # scales (any bytes are valid K-quant codes). The references are
    # gguf.quants.dequantize's output.
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(19)
    values = rng.standard_normal((2, 512)).astype(np.float32)
    scale_at = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
    writer = gguf.GGUFWriter(str(out / "types.gguf"), "qwen3moe")
    for t in [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]:
        if t in scale_at:
            size = gguf.GGML_QUANT_SIZES[t][1]
            blocks = rng.integers(0, 256, (2, 2, size), dtype=np.uint8)
            for at in scale_at[t]:
                scale = rng.uniform(0.001, 0.05, (2, 2)).astype(np.float16)
                blocks[:, :, at : at + 2] = scale.view(np.uint8).reshape(2, 2, 2)
            q = blocks.reshape(2, 2 * size)
        elif t == T.F32:
            q = values
        else:
            q = gguf.quants.quantize(values, t)
        if t == T.F32:
            writer.add_tensor(f"t.{t.name}", q)
        else:
            writer.add_tensor(f"t.{t.name}", q, raw_dtype=t)
        ref = values if t == T.F32 else gguf.quants.dequantize(q, t)
        writer.add_tensor(f"ref.{t.name}", np.ascontiguousarray(ref.astype(np.float32)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {out / 'types.gguf'}")

    # The bundled model's tokenizer, vocabulary only.
    bundled = REPO / "bundled" / "qwen35-tiny"
    bconfig = json.loads((bundled / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out / "vocab.gguf"), "qwen35moe")
    gguf_vocab(writer, bundled, bconfig["vocab_size"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    print(f"wrote {out / 'vocab.gguf'}")

    make_malformed(out / "malformed")


# --------------------------------------------------------------------------
# Malformed GGUF files, written byte by byte


def gguf_str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def gguf_kv_u32(key: bytes, v: int) -> bytes:
    return gguf_str(key) + struct.pack("<II", 4, v)


def gguf_file(kvs=(), tensors=(), data=b"", version=3, tensor_count=None, kv_count=None, magic=b"GGUF") -> bytes:
    """A GGUF file from parts; `tensors` are (name, dims, type, offset)."""
    head = magic + struct.pack("<I", version)
    head += struct.pack("<Q", len(tensors) if tensor_count is None else tensor_count)
    head += struct.pack("<Q", len(kvs) if kv_count is None else kv_count)
    body = b"".join(kvs)
    for name, dims, t, offset in tensors:
        body += gguf_str(name) + struct.pack("<I", len(dims))
        body += b"".join(struct.pack("<Q", d) for d in dims)
        body += struct.pack("<IQ", t, offset)
    out = head + body
    out += b"\0" * ((-len(out)) % 32)
    return out + data


def make_malformed(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.gguf"):
        old.unlink()
    arch = gguf_str(b"general.architecture") + struct.pack("<I", 8) + gguf_str(b"qwen3moe")
    one = [(b"a", [32], 0, 0)]  # 32 f32 values at offset 0
    data = b"\0" * 128
    valid = gguf_file([arch], one, data)
    cases = {
        # the file's structure
        "bad_magic": gguf_file([arch], one, data, magic=b"GGUX"),
        "bad_version": gguf_file([arch], one, data, version=7),
        "truncated_header": valid[:10],
        "truncated_metadata": valid[:40],
        "truncated_tensor_info": gguf_file([arch], one, data)[: 24 + len(arch) + 10],
        "truncated_data": gguf_file([arch], [(b"a", [64], 0, 0)], b"\0" * 100),
        # counts and lengths no file could hold
        "huge_tensor_count": gguf_file([arch], one, data, tensor_count=1 << 62),
        "huge_kv_count": gguf_file([arch], one, data, kv_count=(1 << 64) - 1),
        "huge_key_length": gguf_file([struct.pack("<Q", 1 << 61) + b"x"], one, data),
        "huge_string_length": gguf_file(
            [gguf_str(b"general.name") + struct.pack("<IQ", 8, 1 << 60)], one, data
        ),
        "huge_array_count": gguf_file(
            [gguf_str(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1 << 58)], one, data
        ),
        "huge_dimensions": gguf_file([arch], [(b"a", [1 << 32, 1 << 32, 1 << 32], 0, 0)], data),
        # bad types
        "bad_value_type": gguf_file([gguf_str(b"x") + struct.pack("<II", 99, 0)], one, data),
        "bad_array_type": gguf_file([gguf_str(b"x") + struct.pack("<IIQ", 9, 77, 1)], one, data),
        "nested_array": gguf_file([gguf_str(b"x") + struct.pack("<IIQ", 9, 9, 1)], one, data),
        "bad_bool": gguf_file([gguf_str(b"x") + struct.pack("<IB", 7, 2)], one, data),
        "bad_ggml_type": gguf_file([arch], [(b"a", [32], 99, 0)], data),
        "unsupported_ggml_type": gguf_file([arch], [(b"a", [32], 39, 0)], data),
        "non_utf8_key": gguf_file([gguf_str(b"\xff\xfe") + struct.pack("<II", 4, 1)], one, data),
        # tensor layout
        "overlapping_tensors": gguf_file([arch], [(b"a", [32], 0, 0), (b"b", [32], 0, 64)], data),
        "overlapping_offsets": gguf_file([arch], [(b"a", [32], 0, 0), (b"b", [32], 0, 0)], data),
        "offset_past_end": gguf_file([arch], [(b"a", [32], 0, 1 << 40)], data),
        "misaligned_offset": gguf_file([arch], [(b"a", [8], 0, 4)], data),
        "too_many_dims": gguf_file([arch], [(b"a", [1, 1, 1, 1, 32], 0, 0)], data),
        "zero_dims": gguf_file([arch], [(b"a", [], 0, 0)], data),
        "zero_size": gguf_file([arch], [(b"a", [0], 0, 0)], data),
        "partial_block": gguf_file([arch], [(b"a", [33], 8, 0)], data),
        "duplicate_tensor": gguf_file([arch], [(b"a", [8], 0, 0), (b"a", [8], 0, 32)], data),
        "duplicate_key": gguf_file([arch, arch], one, data),
        "bad_alignment": gguf_file([arch, gguf_kv_u32(b"general.alignment", 3)], one, data),
    }
    for name, content in cases.items():
        (out / f"{name}.gguf").write_bytes(content)
    print(f"wrote {len(cases)} files in {out}")


def make_bundled_gguf(path: Path) -> None:
    """The bundled model as a BF16 GGUF, with its tokenizer."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    bundled = REPO / "bundled" / "qwen35-tiny"
    write_gguf(bundled, path, lambda name: gguf.GGMLQuantizationType.BF16, bundled)
    print(f"wrote {path}")


def make_families_gguf(out: Path) -> None:
    """The fixtures as Q8_0 GGUFs (not committed)."""
    import gguf

    out.mkdir(parents=True, exist_ok=True)
    for name in ("qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        src = FIXTURES / name / "hf"
        # convert_hf_to_gguf.py keeps routers (ffn_gate_inp) in F32.
        T = gguf.GGMLQuantizationType
        write_gguf(src, out / f"{name}.gguf", lambda n: T.F32 if "ffn_gate_inp." in n else T.Q8_0, None)
        print(f"wrote {out / name}.gguf")


TARGETS = {"fp8": make_fp8, "mlx": make_mlx, "gguf": make_gguf}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "what", nargs="*", help=f"some of {', '.join(TARGETS)}, bundled-gguf, families-gguf"
    )
    parser.add_argument(
        "--out", type=Path, help="bundled-gguf: the file to write; families-gguf: the folder"
    )
    args = parser.parse_args()
    what = args.what or list(TARGETS)
    for w in what:
        if w == "bundled-gguf":
            if args.out is None:
                sys.exit("bundled-gguf needs --out FILE")
            make_bundled_gguf(args.out)
        elif w == "families-gguf":
            if args.out is None:
                sys.exit("families-gguf needs --out DIR")
            make_families_gguf(args.out)
        elif w in TARGETS:
            TARGETS[w]()
        else:
            sys.exit(f"unknown target {w!r}")


if __name__ == "__main__":
    main()
