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
                    reference.safetensors: some tensors dequantized by
                    ml_dtypes (e4m3 -> f32 times the block's scale, in f32).
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
                    reference.safetensors: some tensors dequantized in numpy
                    (q * scale + bias in f32).
gguf/qwen3_5_moe.gguf
                    fixtures/qwen3_5_moe written by the `gguf` package the way
                    llama.cpp's convert_hf_to_gguf.py writes Qwen3.5-MoE
                    (Qwen3_5MoeTextModel: tensor names from gguf's
                    tensor_mapping, experts stacked, `1 + w` norms, A_log as
                    -exp(A_log), dt_bias as ssm_dt.bias, conv1d squeezed,
                    value heads reordered from grouped to tiled) and quantized
                    with gguf.quants: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16
                    and F32 tensors.
gguf/types.gguf     one [2, 512] tensor of every type moeflux reads (F32, F16,
                    BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K,
                    Q5_K, Q6_K) quantized by gguf.quants, and the same values
                    dequantized by gguf.quants.dequantize as `ref.<type>` F32
                    tensors.
gguf/vocab.gguf     the bundled model's tokenizer and chat template as
                    convert_hf_to_gguf.py writes them (a vocabulary-only GGUF,
                    like llama.cpp's models/ggml-vocab-*.gguf).
gguf/malformed/     damaged GGUF files (truncated, huge counts, bad types,
                    overlapping or out-of-file tensor data, misaligned offsets,
                    a bad magic or version); each must be refused with a clear
                    error.

bundled-gguf writes the bundled model (bundled/qwen35-tiny) as a BF16 GGUF
(16 MB, so not committed); `cargo test --test format_gguf -- --ignored`
converts it and checks that generation gives the bundled model's text.
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


TARGETS = {"fp8": make_fp8, "mlx": make_mlx}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", help=f"some of {', '.join(TARGETS)}, bundled-gguf")
    parser.add_argument("--out", type=Path, help="bundled-gguf: the file to write")
    args = parser.parse_args()
    what = args.what or list(TARGETS)
    for w in what:
        if w == "bundled-gguf":
            if args.out is None:
                sys.exit("bundled-gguf needs --out FILE")
            make_bundled_gguf(args.out)
        elif w in TARGETS:
            TARGETS[w]()
        else:
            sys.exit(f"unknown target {w!r}")


if __name__ == "__main__":
    main()
