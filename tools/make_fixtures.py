#!/usr/bin/env python3
"""Build tiny random Qwen MoE models and record Hugging Face reference outputs.

The Rust engine's tests load these checkpoints and compare their own results
with the numbers recorded here.

Usage (needs torch, transformers, safetensors and numpy; no network):

    python tools/make_fixtures.py --out fixtures
    python tools/make_fixtures.py --out fixtures --only qwen3_moe qwen3_next

Everything is computed on the CPU in float32 with fixed seeds, so a re-run
reproduces the fixtures (bit-for-bit on the same machine; across CPUs the
float32 logits may differ in the last bits because matmul kernels accumulate
in different orders).

For each fixture NAME this writes ``<out>/NAME/``:

    hf/config.json, hf/generation_config.json, hf/model.safetensors
        The checkpoint, bf16, as ``save_pretrained`` writes it.  Note that
        transformers 5 saves in the *original* (Hub) layout by default: it
        reverts its internal fused expert tensors, so routed experts are stored
        per expert as ``...mlp.experts.{e}.{gate,up,down}_proj.weight``.
    reference.safetensors
        tokens_short [7], tokens_long [80], generate_ids [16]        (int32)
        logits_short [7, V], logits_long [80, V]                     (float32)
        logits_{short,long}_q4, logits_{short,long}_q8               (float32)
    reference.json
        Versions, model class, sequence lengths, the quantization recipe,
        logit statistics and sanity-check results (for information).

The fixtures:

    qwen3_moe              Qwen3MoeForCausalLM, tied embeddings, layer 1 dense.
    qwen3_moe_sparse_step  Qwen3MoeForCausalLM, decoder_sparse_step 2 (layers 1
                           and 3 MoE), norm_topk_prob, untied lm_head.
    qwen3_next             Qwen3NextForCausalLM (fused in_proj_qkvz/in_proj_ba),
                           3 linear-attention layers + 1 full, layer 2 dense.
    qwen3_5_moe            Qwen3_5MoeForCausalLM (text-only config, separate
                           in_proj_qkv/z/b/a), 8 layers, all MoE, mrope params.
                           Also ``hf_hub_sharded/``: the same bf16 weights in the
                           layout of Qwen's Hub checkpoints of Qwen3.5
                           (Qwen3_5MoeForConditionalGeneration names, per-expert
                           tensors, tiny ``model.visual.*`` tower, ``mtp.*``
                           extras, 3 shards + model.safetensors.index.json).

Reference recipe: the bf16 checkpoint is reloaded with ``dtype=float32``
(an exact upcast), ``attn_implementation="eager"``, ``experts_implementation=
"eager"``, and run under ``torch.no_grad()`` on the CPU.  Logits come from one
forward over the whole sequence without a cache; ``generate_ids`` are the 16
greedy tokens that ``model.generate`` produces (KV-cache / recurrent-state
decode path) after ``tokens_short``, with EOS disabled.

Quantized references (``*_q4`` / ``*_q8``) use ``quantize_dequantize`` below,
which the Rust converter reproduces bit-exactly; see its docstring.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# --- Environment, before torch/transformers are imported ---------------------
# Compute on the CPU only, even on a machine with a GPU.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# No network: never try to reach the Hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Keep transformers on its readable pure-torch reference paths.  If the
# optional fast-kernel packages happen to be installed, transformers would
# silently swap them in for the gated-delta-rule / causal-conv1d functions;
# mapping them to None in sys.modules makes their import fail, so the torch
# fallback is used.
os.environ["USE_HUB_KERNELS"] = "NO"
for _pkg in ("fla", "causal_conv1d"):
    if importlib.util.find_spec(_pkg) is not None:
        sys.modules[_pkg] = None  # type: ignore[assignment]

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
torch.set_num_threads(1)  # fixed reduction order on the CPU
torch.use_deterministic_algorithms(True)

SEQ_SHORT = 7
SEQ_LONG = 80
NEW_TOKENS = 16
GROUP_SIZE = 64
MARGIN_WARN = 1e-3  # top-1/top-2 logit margin below which we warn

# A fixture is only accepted if it is robust to the last-bit differences that a
# different (correct) float32 implementation will have.  Measured float32
# noise is ~1e-5 on the logits and router logits (up to ~1e-4 for the 8-layer
# model), so these thresholds leave a margin of 10x or more.
ROUTER_GAP_MIN = 1e-3  # k-th vs (k+1)-th router logit, for every routing decision
GEN_MARGIN_MIN = 1e-2  # top-1 vs top-2 logit at every greedy step
GEN_MIN_DISTINCT = 6  # the greedy continuation must not be one token repeated...
GEN_MAX_RUN = 4  # ...nor contain long runs of one token
MAX_ATTEMPTS = 200

HF_KEEP = {"config.json", "generation_config.json", "model.safetensors"}

# =============================================================================
# Model configurations
# =============================================================================

LIN, FULL = "linear_attention", "full_attention"


def _hybrid_sizes() -> dict:
    """Sizes shared by the qwen3_next and qwen3_5_moe fixtures."""
    return dict(
        vocab_size=300,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        # Also given inside rope_parameters (the two must agree); config.json
        # ends up with it in both places.
        partial_rotary_factor=0.25,
    )


def _qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    kw = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def qwen3_moe_config() -> Qwen3MoeConfig:
    return _qwen3_moe_config(
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        norm_topk_prob=False,
        tie_word_embeddings=True,
    )


def qwen3_moe_sparse_step_config() -> Qwen3MoeConfig:
    # A layer is MoE when (layer_idx + 1) % decoder_sparse_step == 0 and it is
    # not in mlp_only_layers: with step 2, layers 1 and 3 are MoE, 0 and 2 dense.
    return _qwen3_moe_config(
        mlp_only_layers=[],
        decoder_sparse_step=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )


def qwen3_next_config() -> Qwen3NextConfig:
    return Qwen3NextConfig(
        num_hidden_layers=4,
        layer_types=[LIN, LIN, LIN, FULL],
        intermediate_size=128,
        mlp_only_layers=[2],
        decoder_sparse_step=1,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        **_hybrid_sizes(),
    )


# Rotary dim = head_dim * partial_rotary_factor = 16, i.e. 8 frequencies.
# Qwen's real checkpoints use an mrope_section that sums to the number of
# frequencies (Qwen3.5: [11, 11, 10] for 32), so [4, 2, 2] is the faithful
# miniature.  For text-only input the three position streams are equal and the
# section split has no effect on the result (checked in check_rope()).
MROPE_SECTION = [4, 2, 2]


def qwen3_5_moe_config() -> Qwen3_5MoeTextConfig:
    # No mlp_only_layers / decoder_sparse_step / norm_topk_prob here: every
    # layer is MoE and the router always renormalises its top-k weights.
    return Qwen3_5MoeTextConfig(
        num_hidden_layers=8,
        layer_types=[LIN, LIN, LIN, FULL] * 2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": MROPE_SECTION,
            "mrope_interleaved": True,
        },
        **_hybrid_sizes(),
    )


# A deliberately tiny vision tower: only its weights are needed (as tensors the
# engine must skip), it is never run.
TINY_VISION_CONFIG = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    in_channels=3,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,  # must equal the text hidden size
    num_position_embeddings=16,  # a 4 x 4 learned grid
)

FIXTURES = {
    "qwen3_moe": dict(cls=Qwen3MoeForCausalLM, config=qwen3_moe_config, seed=1001),
    "qwen3_moe_sparse_step": dict(cls=Qwen3MoeForCausalLM, config=qwen3_moe_sparse_step_config, seed=1002),
    "qwen3_next": dict(cls=Qwen3NextForCausalLM, config=qwen3_next_config, seed=1003),
    "qwen3_5_moe": dict(cls=Qwen3_5MoeForCausalLM, config=qwen3_5_moe_config, seed=1004),
}

# =============================================================================
# Weights
# =============================================================================


@torch.no_grad()
def randomize_parameters(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a fresh random value, away from its initialisation.

    transformers initialises linears with std 0.02, norms to exactly 1 (or 0
    for the ``x * (1 + w)`` norms of Qwen3-Next / Qwen3.5), dt_bias to 1 and
    the router of Qwen3-MoE to zeros: a model that would make norm or gating
    bugs invisible and whose logits are nearly flat.  The scales below keep
    activations at unit size through the layers and give logits with a std of
    about 2 across the vocabulary.
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=gen) * (hi - lo) + lo

    hidden = model.config.hidden_size
    for name, p in model.named_parameters():  # tied weights are listed once
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            # decay per step = exp(-exp(A_log) * softplus(a + dt_bias)); a range
            # of A gives both long- and short-memory heads.
            new = uniform(p.shape, np.log(0.02), np.log(2.0))
        elif leaf == "dt_bias":
            new = uniform(p.shape, -1.0, 1.0)
        elif "conv1d" in name:  # [channels, 1, kernel]
            new = normal(p.shape, 0.5)
        elif name == "model.norm.weight" and model.config.tie_word_embeddings:
            # With tied embeddings the residual stream still holds the input
            # token's embedding e_t, and scoring with the same matrix adds
            # sum_d e_t[d]^2 w[d] to that token's logit, so greedy decoding
            # just repeats tokens.  Random signs on the final norm weights
            # cancel that bias (and exercise negative norm weights).
            assert bool((p == 1).all()), "expected a plain `w * x` final norm"
            signs = torch.randint(0, 2, p.shape, generator=gen) * 2.0 - 1.0
            new = signs * (p + normal(p.shape, 0.15))
        elif "norm" in name:
            # All other norm weights (RMSNorm, q_norm/k_norm, gated norm):
            # perturb around the init, 1 for `w * x` and 0 for `(1 + w) * x`.
            new = p + normal(p.shape, 0.15)
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            # Logits = final_norm(h) @ W^T, so std(logits) ~= sqrt(H) * std(W) = 2.
            new = normal(p.shape, 2.0 / hidden**0.5)
        elif name.endswith("mlp.gate.weight"):
            # Router: logits with std ~2 give clearly separated experts.
            new = normal(p.shape, 2.0 / hidden**0.5)
        elif p.dim() == 3 and ".experts." in name:
            # Fused experts: gate_up_proj [E, 2I, H], down_proj [E, H, I];
            # the last dim is the input dim.
            new = normal(p.shape, p.shape[-1] ** -0.5)
        elif p.dim() == 2:
            # Every other matrix is a linear [out, in]: unit-gain init.
            new = normal(p.shape, p.shape[-1] ** -0.5)
        else:
            raise ValueError(f"no randomisation rule for {name} {tuple(p.shape)}")
        assert not torch.equal(new, p), name
        p.copy_(new)


def check_all_parameters_varied(model: torch.nn.Module) -> None:
    """No parameter may be constant (which is what an untouched init looks like)."""
    for name, p in model.named_parameters():
        if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
            raise AssertionError(f"parameter {name} is constant")


def saved_tensor_shapes(path: Path) -> dict[str, list[int]]:
    with safe_open(path, "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in sorted(f.keys())}


def save_bf16_checkpoint(model: torch.nn.Module, hf_dir: Path) -> None:
    """Cast to bf16 and save_pretrained, keeping only the files we need.

    transformers 5 always writes safetensors (safe_serialization is gone) and by
    default reverts its load-time conversions, i.e. writes the Hub layout.
    """
    model.to(torch.bfloat16).save_pretrained(hf_dir)
    for f in hf_dir.iterdir():
        if f.name not in HF_KEEP:
            f.unlink() if f.is_file() else shutil.rmtree(f)
    if not (hf_dir / "model.safetensors").exists():
        raise RuntimeError(f"expected a single model.safetensors in {hf_dir}")


def load_reference_model(cls, hf_dir: Path):
    """Reload the bf16 checkpoint as a float32, eager, CPU model."""
    model = cls.from_pretrained(
        hf_dir,
        dtype=torch.float32,  # bf16 -> f32 upcast is exact
        attn_implementation="eager",
        experts_implementation="eager",  # plain per-expert loop
    )
    return model.eval()


@torch.no_grad()
def check_reload(reloaded: torch.nn.Module, bf16_model: torch.nn.Module) -> None:
    """The reloaded float32 weights must be exactly the bf16 weights we saved."""
    saved = dict(bf16_model.named_parameters())
    for name, p in reloaded.named_parameters():
        if p.dtype != torch.float32:
            raise AssertionError(f"{name} reloaded as {p.dtype}")
        if not torch.equal(p, saved[name].float()):
            raise AssertionError(f"{name} differs after the save/load round trip")


# =============================================================================
# Quantization (reproduced bit-exactly by the Rust converter)
# =============================================================================

QUANT_DESCRIPTION = (
    "Quantize-then-dequantize in float32 torch ops, group size 64 along the input (last) dim. "
    "Tensors: every 2-D parameter whose last dim is a multiple of 64 and whose name has no 'norm' "
    "(embed_tokens -- once if tied --, lm_head if untied, q/k/v/o_proj, linear_attn in_proj_* and out_proj, "
    "dense/shared-expert gate/up/down_proj, mlp.gate.weight, mlp.shared_expert_gate.weight), plus the fused "
    "experts mlp.experts.gate_up_proj [E,2I,H] and mlp.experts.down_proj [E,H,I] quantized per expert "
    "as [R,C] matrices (row-wise groups, so this equals quantizing the per-expert gate/up/down matrices "
    "separately). Everything else (norms, A_log, dt_bias, conv1d) unchanged. mlp.gate.weight and "
    "mlp.shared_expert_gate.weight always use 8 bits, the rest the requested bits. Per group of 64: "
    "wmin=min, wmax=max; scale=(wmax-wmin)/(2**bits-1) in f32; s=bf16_rne(scale), b=bf16_rne(wmin); "
    "if s==0: q=0 else q=clamp(round_half_even((w-b)/s), 0, 2**bits-1) with f32 sub and div; "
    "dequant = q*s + b in f32 (a multiply then an add, two roundings, no FMA)."
)

ALWAYS_8_BITS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def quantize_dequantize(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Affine min/max quantization of a float32 [R, C] matrix, groups of 64 along C.

    Follows the recipe literally with float32 torch ops.  Divisions are done
    tensor-by-tensor (true IEEE division, never a multiply by a reciprocal).
    """
    assert w.dtype == torch.float32 and w.dim() == 2 and w.shape[1] % GROUP_SIZE == 0
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    qmax = 2**bits - 1
    wmin = g.amin(dim=-1, keepdim=True)
    wmax = g.amax(dim=-1, keepdim=True)
    scale = (wmax - wmin) / torch.full_like(wmin, qmax)
    s = scale.to(torch.bfloat16).to(torch.float32)  # round to nearest even
    b = wmin.to(torch.bfloat16).to(torch.float32)
    q = torch.clamp(torch.round((g - b) / s), 0, qmax)  # torch.round: half to even
    q = torch.where(s == 0, torch.zeros_like(q), q)  # (the s == 0 lanes held NaN)
    deq = q * s + b
    return deq.reshape(rows, cols)


def quantized_bits(name: str, p: torch.Tensor, bits: int) -> int | None:
    """Bits to use for parameter `name`, or None if it stays unquantized."""
    if any(name.endswith(s) for s in FUSED_EXPERTS) and p.dim() == 3:
        return bits
    if p.dim() == 2 and p.shape[-1] % GROUP_SIZE == 0 and "norm" not in name:
        return 8 if any(name.endswith(s) for s in ALWAYS_8_BITS) else bits
    return None


@torch.no_grad()
def quantize_model(model: torch.nn.Module, bits: int) -> tuple[torch.nn.Module, dict[str, int]]:
    qmodel = copy.deepcopy(model)  # deepcopy keeps tied weights tied
    used = {}
    for name, p in qmodel.named_parameters():  # a tied lm_head is not listed
        nb = quantized_bits(name, p, bits)
        if nb is None:
            continue
        if p.dim() == 3:
            p.copy_(torch.stack([quantize_dequantize(p[e], nb) for e in range(p.shape[0])]))
        else:
            p.copy_(quantize_dequantize(p, nb))
        used[name] = nb
    return qmodel, used


def _bf16_rne_numpy(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return bits.view(np.float32)


def _quantize_dequantize_numpy(w: np.ndarray, bits: int) -> np.ndarray:
    """Independent IEEE float32 implementation, to cross-check the torch one."""
    g = w.reshape(w.shape[0], -1, GROUP_SIZE).astype(np.float32)
    qmax = np.float32(2**bits - 1)
    wmin = g.min(-1, keepdims=True)
    s = _bf16_rne_numpy((g.max(-1, keepdims=True) - wmin) / qmax)
    b = _bf16_rne_numpy(wmin)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.round((g - b) / s), 0, qmax)  # np.round: half to even
    q = np.where(s == 0, np.float32(0), q).astype(np.float32)
    return (q * s + b).astype(np.float32).reshape(w.shape)


def check_quantizer(model: torch.nn.Module) -> None:
    """torch and numpy implementations must agree bit-for-bit on real weights."""
    for name, p in model.named_parameters():
        for bits in (4, 8):
            nb = quantized_bits(name, p, bits)
            if nb is None:
                continue
            mats = [p[e] for e in range(p.shape[0])] if p.dim() == 3 else [p]
            for m in mats:
                m = m.detach().float()
                a = quantize_dequantize(m, nb).numpy().view(np.uint32)
                c = _quantize_dequantize_numpy(m.numpy(), nb).view(np.uint32)
                if not np.array_equal(a, c):
                    raise AssertionError(f"torch/numpy quantizers disagree on {name} ({nb} bits)")
    # Ties (half-way values) and a constant group (s == 0).
    w = torch.zeros(2, GROUP_SIZE)
    w[0] = torch.arange(GROUP_SIZE) / 2.0  # many exact .5 quotients
    w[1] = 0.375  # constant: s == 0
    for bits in (4, 8):
        a = quantize_dequantize(w, bits).numpy().view(np.uint32)
        c = _quantize_dequantize_numpy(w.numpy(), bits).view(np.uint32)
        assert np.array_equal(a, c), "quantizers disagree on tie / constant groups"


# =============================================================================
# Reference computations
# =============================================================================


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor, router_gaps: list[float] | None = None) -> torch.Tensor:
    """Logits [T, V] of one forward pass over `tokens`, without a cache.

    If `router_gaps` is given, the smallest gap between the k-th and (k+1)-th
    router logit of every MoE layer is appended to it: a tiny gap means a
    last-bit difference could flip an expert choice and change the output a lot.
    """
    handles = []
    if router_gaps is not None:
        k = model.config.num_experts_per_tok

        def hook(_module, _inputs, output):
            top = output[0].topk(k + 1, dim=-1).values  # output[0]: router logits
            router_gaps.append(float((top[:, k - 1] - top[:, k]).min()))

        handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    try:
        out = model(input_ids=tokens[None].long(), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return out.logits[0].float().contiguous()


@torch.no_grad()
def greedy_generate(model, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """16 greedy tokens through generate() (cached decode path) and their logits."""
    gen_cfg = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        num_beams=1,
        eos_token_id=None,  # never stop early
        pad_token_id=0,  # unused (batch of one, no padding); silences a warning
        repetition_penalty=1.0,
        use_cache=True,
    )
    ids = prompt[None].long()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        generation_config=gen_cfg,
        return_dict_in_generate=True,
        output_logits=True,
    )
    new = out.sequences[0, ids.shape[1] :]
    if new.numel() != NEW_TOKENS:
        raise AssertionError(f"generate() returned {new.numel()} tokens")
    return new, torch.cat(out.logits).float()


def logit_stats(logits: torch.Tensor) -> dict:
    std = logits.std(dim=-1)
    top2 = logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    return {
        "std_mean": float(std.mean()),
        "std_min": float(std.min()),
        "std_max": float(std.max()),
        "top1_top2_margin_min": float(margin.min()),
        "top1_top2_margin_argmin": int(margin.argmin()),
    }


def compare(lq: torch.Tensor, l: torch.Tensor) -> dict:
    return {
        "rel_l2": float((lq - l).norm() / l.norm()),
        "max_abs": float((lq - l).abs().max()),
        "top1_agreement": float((lq.argmax(-1) == l.argmax(-1)).float().mean()),
    }


@torch.no_grad()
def check_rope(model) -> dict:
    """Compare the model's rotary tables with plain (1-D) RoPE on the text positions."""
    cfg = model.config
    rp = cfg.rope_parameters
    head_dim = cfg.head_dim
    rot_dim = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rp["rope_theta"] ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    rotary = model.model.rotary_emb
    info = {"rotary_dim": rot_dim, "num_frequencies": rot_dim // 2}
    info["inv_freq_matches_formula"] = bool(torch.equal(rotary.inv_freq, inv_freq))
    pos = torch.arange(SEQ_LONG)
    x = torch.zeros(1, SEQ_LONG, head_dim)
    if isinstance(model, Qwen3_5MoeForCausalLM):
        # Text-only input: the T, H and W position streams are all equal.
        cos, sin = rotary(x, pos.view(1, 1, -1).expand(3, 1, -1))
    else:
        cos, sin = rotary(x, pos[None])
    freqs = pos[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    info["cos_sin_max_abs_diff_vs_plain_rope"] = float(
        max((cos[0] - emb.cos()).abs().max(), (sin[0] - emb.sin()).abs().max())
    )
    return info


# =============================================================================
# Qwen3.5 Hub-style sharded checkpoint
# =============================================================================

MTP_SHAPES = {  # a few multi-token-prediction tensors, as Qwen ships them
    "mtp.fc.weight": (64, 128),
    "mtp.pre_fc_norm_embedding.weight": (64,),
    "mtp.pre_fc_norm_hidden.weight": (64,),
    "mtp.layers.0.input_layernorm.weight": (64,),
    "mtp.layers.0.mlp.experts.0.gate_proj.weight": (64, 64),
    "mtp.norm.weight": (64,),
}

# Shard boundaries: the first tensor of shards 2 and 3.  Both fall inside the
# routed experts of one layer, and the first one even between the gate_proj
# and up_proj of one expert.
SHARD_STARTS = (
    "model.language_model.layers.2.mlp.experts.3.up_proj.weight",
    "model.language_model.layers.5.mlp.experts.6.gate_proj.weight",
)


def hub_text_tensors(text_model) -> list[tuple[str, torch.Tensor]]:
    """Text weights under Hub names, in model order, routed experts split per expert.

    Fused gate_up_proj [E, 2I, H] splits into gate_proj = rows [0, I) and
    up_proj = rows [I, 2I); down_proj [E, H, I] splits along E.
    """
    sd = {n: t.detach().to(torch.bfloat16) for n, t in text_model.state_dict().items()}
    out = []
    for name, t in sd.items():
        hub = "model.language_model." + name[len("model.") :] if name.startswith("model.") else name
        if name.endswith("mlp.experts.gate_up_proj"):
            continue  # emitted together with down_proj, expert by expert
        if name.endswith("mlp.experts.down_proj"):
            gate_up = sd[name[: -len("down_proj")] + "gate_up_proj"]
            inter = gate_up.shape[1] // 2
            base = hub[: -len("down_proj")]
            for e in range(t.shape[0]):
                out.append((f"{base}{e}.gate_proj.weight", gate_up[e, :inter].clone()))
                out.append((f"{base}{e}.up_proj.weight", gate_up[e, inter:].clone()))
                out.append((f"{base}{e}.down_proj.weight", t[e].clone()))
            continue
        out.append((hub, t.contiguous()))
    return out


@torch.no_grad()
def write_qwen3_5_hub_checkpoint(text_model, tokens: torch.Tensor, ref_logits: torch.Tensor, out_dir: Path) -> dict:
    """Write fixtures/qwen3_5_moe/hf_hub_sharded from the float32 reference model."""
    info = {}
    cfg = Qwen3_5MoeConfig(
        text_config=text_model.config.to_dict(),
        vision_config=TINY_VISION_CONFIG,
        tie_word_embeddings=False,
    )
    torch.manual_seed(2024)
    cond = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    cond.set_attn_implementation("eager")
    cond.set_experts_implementation("eager")
    # The text weights are exactly those of the CausalLM fixture.
    cond.model.language_model.load_state_dict(text_model.model.state_dict())
    cond.lm_head.weight.copy_(text_model.lm_head.weight)
    # Round the (unused) vision weights to bf16 so what is saved is what ran.
    for p in cond.model.visual.parameters():
        p.copy_(p.to(torch.bfloat16).float())

    diff = (forward_logits(cond, tokens) - ref_logits).abs().max()
    info["conditional_generation_vs_causal_lm_max_abs_diff"] = float(diff)
    if diff > 1e-5:
        raise AssertionError(f"ForConditionalGeneration logits differ from ForCausalLM by {diff}")

    # Let transformers write the checkpoint once, for its config.json and as a
    # cross-check of our hand-built tensor names.
    with tempfile.TemporaryDirectory() as tmp:
        cond.to(torch.bfloat16).save_pretrained(tmp)
        cond.float()
        config_json = (Path(tmp) / "config.json").read_text()
        tf_tensors = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(f, "pt") as sf:
                tf_tensors.update({k: sf.get_tensor(k) for k in sf.keys()})

    tensors = [(n, t.detach().to(torch.bfloat16).contiguous()) for n, t in cond.model.visual.state_dict().items()]
    tensors = [("model.visual." + n, t) for n, t in tensors]
    tensors += hub_text_tensors(text_model)
    gen = torch.Generator().manual_seed(77)
    for name, shape in MTP_SHAPES.items():
        tensors.append((name, (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16)))

    names = [n for n, _ in tensors]
    assert len(set(names)) == len(names)
    # Everything but mtp.* must match what save_pretrained wrote, bit for bit.
    ours = {n: t for n, t in tensors if not n.startswith("mtp.")}
    if set(ours) != set(tf_tensors):
        raise AssertionError(f"name mismatch vs save_pretrained: {sorted(set(ours) ^ set(tf_tensors))[:10]}")
    for n, t in ours.items():
        if not torch.equal(t, tf_tensors[n]):
            raise AssertionError(f"{n} differs from save_pretrained's tensor")
    info["matches_save_pretrained_layout"] = True

    # Split into three shards.
    cuts = [0] + [names.index(s) for s in SHARD_STARTS] + [len(tensors)]
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(config_json)
    weight_map, total = {}, 0
    for i in range(3):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        shard = dict(tensors[cuts[i] : cuts[i + 1]])
        save_file(shard, out_dir / fname, metadata={"format": "pt"})
        for n, t in shard.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    # transformers must load it back (skipping mtp.*) and give the same logits.
    for cls in (Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM):
        try:
            m = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                    experts_implementation="eager").eval()
            d = float((forward_logits(m, tokens) - ref_logits).abs().max())
            info[f"reload_as_{cls.__name__}_max_abs_diff"] = d
        except Exception as e:  # informational only
            info[f"reload_as_{cls.__name__}_error"] = f"{type(e).__name__}: {e}"
    if info.get("reload_as_Qwen3_5MoeForConditionalGeneration_max_abs_diff", 1.0) > 1e-5:
        raise AssertionError(f"the sharded checkpoint does not reload correctly: {info}")
    info["num_tensors"] = len(tensors)
    info["shard_starts"] = list(SHARD_STARTS)
    return info


# =============================================================================
# Driver
# =============================================================================


def make_fixture(name: str, spec: dict, out_root: Path) -> dict:
    cls, seed = spec["cls"], spec["seed"]
    fdir = out_root / name
    if fdir.exists():
        shutil.rmtree(fdir)
    hf_dir = fdir / "hf"
    hf_dir.mkdir(parents=True)

    # 1. Build, randomise, save as bf16.
    torch.manual_seed(seed)
    model = cls(spec["config"]()).eval()
    randomize_parameters(model, seed)
    check_all_parameters_varied(model)
    save_bf16_checkpoint(model, hf_dir)  # `model` is bf16 from here on

    # 2. Reload as float32 for the reference computation.
    ref = load_reference_model(cls, hf_dir)
    check_reload(ref, model)
    check_all_parameters_varied(ref)
    del model

    gen = torch.Generator().manual_seed(seed + 500)
    vocab = ref.config.vocab_size
    tokens_short = torch.randint(0, vocab, (SEQ_SHORT,), generator=gen, dtype=torch.int64)
    tokens_long = torch.randint(0, vocab, (SEQ_LONG,), generator=gen, dtype=torch.int64)

    logits_short = forward_logits(ref, tokens_short)
    logits_long = forward_logits(ref, tokens_long)
    # The short sequence has no structure the long one can't reproduce: a
    # prefix of the long sequence must give the same logits as a full pass.
    prefix_diff = (forward_logits(ref, tokens_long[:SEQ_SHORT]) - logits_long[:SEQ_SHORT]).abs().max()

    generate_ids, step_logits = greedy_generate(ref, tokens_short)
    # Teacher-forced full forward over prompt + generated tokens must agree
    # with the cached decode path.
    full = forward_logits(ref, torch.cat([tokens_short, generate_ids[:-1]]))[SEQ_SHORT - 1 :]
    gen_check = {
        "decode_vs_full_forward_max_abs_diff": float((step_logits - full).abs().max()),
        "decode_tokens_equal_full_forward_argmax": bool(torch.equal(full.argmax(-1), generate_ids)),
        "distinct_generated_tokens": int(generate_ids.unique().numel()),
        "prefix_consistency_max_abs_diff": float(prefix_diff),
    }

    # 3. Quantized references.
    check_quantizer(ref)
    tensors = {
        "tokens_short": tokens_short.to(torch.int32),
        "tokens_long": tokens_long.to(torch.int32),
        "generate_ids": generate_ids.to(torch.int32),
        "logits_short": logits_short,
        "logits_long": logits_long,
    }
    quant_info = {}
    for bits in (4, 8):
        qmodel, used = quantize_model(ref, bits)
        qs, ql = forward_logits(qmodel, tokens_short), forward_logits(qmodel, tokens_long)
        tensors[f"logits_short_q{bits}"] = qs
        tensors[f"logits_long_q{bits}"] = ql
        quant_info[f"q{bits}"] = {
            "short": compare(qs, logits_short),
            "long": compare(ql, logits_long),
            "num_quantized_tensors": len(used),
            "tensors_at_8_bits": sorted(n for n, b in used.items() if b == 8 and bits != 8),
        }
        del qmodel
    save_file({k: v.contiguous() for k, v in tensors.items()}, fdir / "reference.safetensors")

    # 4. Reports.
    stats = {"short": logit_stats(logits_short), "long": logit_stats(logits_long)}
    info = {
        "fixture": name,
        "model_class": cls.__name__,
        "config_class": type(ref.config).__name__,
        "model_type": ref.config.model_type,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "safetensors_version": safetensors.__version__,
        "numpy_version": np.__version__,
        "seed": seed,
        "seq_len_short": SEQ_SHORT,
        "seq_len_long": SEQ_LONG,
        "generate_new_tokens": NEW_TOKENS,
        "generate_ids": generate_ids.tolist(),
        "reference_recipe": (
            "bf16 checkpoint reloaded with dtype=float32, attn_implementation=eager, "
            "experts_implementation=eager, CPU, torch.no_grad(); logits from one forward over the "
            "whole sequence with use_cache=False; generate_ids from model.generate(tokens_short, "
            "max_new_tokens=16, do_sample=False, eos_token_id=None) (cached decode path)."
        ),
        "quantization": {"group_size": GROUP_SIZE, "description": QUANT_DESCRIPTION, **quant_info},
        "logit_stats": stats,
        "router_min_topk_prob_gap_long": router_topk_gap(ref, tokens_long),
        "generation_check": gen_check,
        "rope": check_rope(ref),
    }
    if name == "qwen3_5_moe":
        info["hf_hub_sharded"] = write_qwen3_5_hub_checkpoint(ref, tokens_short, logits_short, fdir / "hf_hub_sharded")
    (fdir / "reference.json").write_text(json.dumps(info, indent=2) + "\n")

    # Console summary.
    warn = [k for k, s in stats.items() if s["top1_top2_margin_min"] < MARGIN_WARN]
    print(f"\n== {name} ({cls.__name__})")
    for k, s in stats.items():
        print(f"   logits_{k:5s} std mean {s['std_mean']:.3f} [{s['std_min']:.3f}, {s['std_max']:.3f}]"
              f"  min top1-top2 margin {s['top1_top2_margin_min']:.4f} (pos {s['top1_top2_margin_argmin']})")
    for q in ("q4", "q8"):
        d = quant_info[q]
        print(f"   {q}: rel L2 short {d['short']['rel_l2']:.4f} long {d['long']['rel_l2']:.4f}; "
              f"top-1 agreement short {d['short']['top1_agreement']:.3f} long {d['long']['top1_agreement']:.3f}")
    print(f"   generate_ids {generate_ids.tolist()}")
    print(f"   generation check {gen_check}")
    print(f"   router min top-k gap {info['router_min_topk_prob_gap_long']:.4f}; rope {info['rope']}")
    if "hf_hub_sharded" in info:
        print(f"   hf_hub_sharded {info['hf_hub_sharded']}")
    for k in warn:
        print(f"   WARNING: logits_{k} has a top-1/top-2 margin below {MARGIN_WARN} at some position")
    if gen_check["distinct_generated_tokens"] < 3:
        print("   WARNING: the greedy continuation is (nearly) one repeated token")
    if not gen_check["decode_tokens_equal_full_forward_argmax"]:
        print("   WARNING: cached decode and full forward disagree on a greedy token")
    return info


def print_layout(out_root: Path, names: list[str]) -> None:
    print("\n== files")
    total = 0
    for f in sorted(p for n in names for p in (out_root / n).rglob("*") if p.is_file()):
        total += f.stat().st_size
        print(f"   {f.stat().st_size:>10,d}  {f.relative_to(out_root)}")
    print(f"   {total:>10,d}  total")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("fixtures"), help="output folder (default: fixtures)")
    ap.add_argument("--only", nargs="+", choices=sorted(FIXTURES), help="build only these fixtures")
    args = ap.parse_args()
    names = args.only or list(FIXTURES)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        make_fixture(name, FIXTURES[name], args.out)
    print_layout(args.out, names)


if __name__ == "__main__":
    main()
