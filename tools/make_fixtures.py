#!/usr/bin/env python3
"""Build tiny random Qwen MoE models and record Hugging Face reference outputs.

The Rust engine's tests load these checkpoints and compare their own results
with the numbers recorded here.

Usage (needs torch, transformers 5, safetensors and numpy; no network, no GPU):

    python tools/make_fixtures.py --out fixtures
    python tools/make_fixtures.py --out fixtures --only qwen3_moe qwen3_next

Everything is computed on the CPU in float32 from fixed seeds: a re-run on the
same machine reproduces every file bit for bit.  (On another CPU the float32
logits may differ in the last bits, since matmul kernels sum in other orders.)

Fixtures, one folder each under --out:

    qwen3_moe              Qwen3MoeForCausalLM, 4 layers, tied embeddings,
                           layer 1 dense (mlp_only_layers=[1]).
    qwen3_moe_sparse_step  Qwen3MoeForCausalLM, decoder_sparse_step=2 (layers 1
                           and 3 MoE, 0 and 2 dense), norm_topk_prob, untied.
                           Checkpoint with FUSED experts.
    qwen3_next             Qwen3NextForCausalLM: 3 linear-attention layers (fused
                           in_proj_qkvz / in_proj_ba) + 1 full-attention layer,
                           shared experts, layer 2 dense.  Checkpoint with
                           FUSED experts.
    qwen3_5_moe            Qwen3_5MoeForCausalLM (text config; separate
                           in_proj_qkv / z / b / a), 4 layers (3 linear + 1
                           full attention), all MoE, mrope.
    gpt_oss                GptOssForCausalLM: 4 layers, sliding-window (8
                           positions, shorter than tokens_long) and full
                           attention alternating, YaRN as gpt-oss has it
                           (original context 64), sinks, q/k/v/o biases,
                           router bias, biased experts with the clamped
                           SwiGLU (limit 1.5, so the clamps act), experts as
                           transformers stores them (gate_up_proj [E, H, 2I],
                           gate and up in alternating columns; down_proj
                           [E, I, H]).
    glm4_moe               Glm4MoeForCausalLM: q/k/v biases, half-rotary heads,
                           no q/k norm, grouped sigmoid router with the
                           correction bias (4 groups keep 2, renormalised,
                           scaling 2.5), a shared expert, layer 0 dense.
    glm4_moe_qk_norm       Glm4MoeForCausalLM with q/k norm, 2 groups keep 1,
                           raw weights, scaling 1.8, layers 0-1 dense, a
                           300-token long sequence.  FUSED experts.
    deepseek_v3            DeepseekV3ForCausalLM: multi-head latent attention
                           (q rank 64, latent 64, interleaved rotary pairs),
                           YaRN (factor 4 over 32 positions, mscale 1,
                           mscale_all_dim 0.707), glm4_moe's router, a
                           shared expert, layer 0 dense.
    deepseek_v3_no_q_lora  DeepseekV3ForCausalLM with one q_proj, plain RoPE,
                           2 groups keep 1, raw weights, layers 0-1 dense.
                           FUSED experts.

Each folder holds:

    hf/config.json, hf/generation_config.json, hf/model.safetensors
        The bf16 checkpoint as save_pretrained writes it.  transformers keeps
        routed experts fused in memory (mlp.experts.gate_up_proj [E, 2I, H],
        rows [0, I) gate and [I, 2I) up; mlp.experts.down_proj [E, H, I]).
        By default save_pretrained converts them back to the original Hub
        layout, one mlp.experts.{e}.{gate,up,down}_proj.weight per expert: so
        are qwen3_moe and qwen3_5_moe saved.  qwen3_moe_sparse_step and
        qwen3_next are saved with save_original_format=False and hold the
        fused tensors as they are in memory (a layout transformers 5 writes
        and loads, so an engine must read both).  reference.json records
        which layout each checkpoint has ("checkpoint_layout").
        Note: transformers writes the expert count of qwen3_moe as
        "num_local_experts" (Qwen3MoeConfig maps num_experts to it), while
        Qwen's Hub configs and the qwen3_next / qwen3_5_moe configs use
        "num_experts".
    reference.safetensors
        tokens_short [7], tokens_long [80], generate_ids [16]          int32
        logits_short [7, V], logits_long [80, V]                       float32
        logits_short_q4, logits_long_q4, logits_short_q8, logits_long_q8
    reference.json
        Versions, classes, seeds, the checkpoint layout, the quantization
        recipe and the bits used per tensor, logit statistics, q4/q8 errors vs
        float32, branch sizes, per-layer sensitivities, and self-checks.

qwen3_5_moe and deepseek_v3 then get a multi-token-prediction head and its
references (tools/make_mtp_fixtures.py: mtp.safetensors, the head's tensors in
hf/model.safetensors, the layer named in hf/config.json).

qwen3_5_moe also gets hf_hub_sharded/: the same bf16 weights laid out like
Qwen's Hub checkpoints of Qwen3.5, i.e. Qwen3_5MoeForConditionalGeneration
names (model.language_model.*, top-level lm_head.weight), routed experts stored
per expert, plus tensors an engine must skip (a tiny real model.visual.* tower
and a few mtp.* tensors), in 3 shards with model.safetensors.index.json and
the ConditionalGeneration config.json.

How the references are made:

  * Weights: the model is built from a seed and every parameter is redrawn
    away from its initialisation (see randomize_parameters; linear-attention
    keys partly follow their queries, see correlate_linear_attention_qk),
    then the output projection of every residual branch is rescaled so that
    the branch adds a moderate update to the residual stream (see
    calibrate_branches), and the model is cast to bf16 and saved.
  * Conditioning: like a trained model, and unlike a naive random one, the
    network must not amplify weight perturbations: the engine's tests compare
    its q8 logits with the UNQUANTIZED reference.  Each fixture must keep the
    q8 logits within Q8_MAX_REL_L2 of float32 at every position.
  * Every layer matters: zeroing any mixer or feed-forward output, the shared
    expert, or opening the attention output gate must move the logits by a
    clear amount (check_sensitivities), so that an engine bug in any one
    layer makes the tests fail.
  * Reference model: the bf16 checkpoint reloaded with dtype=float32 (an
    exact upcast), attn_implementation="eager", experts_implementation="eager",
    on the CPU under torch.no_grad().
  * logits_*: one forward over the whole sequence, no cache.
  * generate_ids: model.generate(tokens_short, max_new_tokens=16, greedy, EOS
    disabled), i.e. the KV-cache / recurrent-state decode path.
  * *_q4 / *_q8: the same forwards after quantize_model(), whose
    quantize_dequantize() the Rust converter reproduces bit-exactly.
  * Robustness: random models are sometimes decided by a hair (two experts
    with almost equal router logits, two tokens with almost equal logits).
    Seeds are tried in a fixed order and the first one is kept whose every
    routing decision (float32, q4 and q8 runs, each on its own) and every
    greedy step clears a margin, whose q8 run routes every token like the
    float32 run and stays within Q8_MAX_REL_L2, and whose continuation is not
    repetitive (see build_candidate).
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
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
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

# A random model is only accepted as a fixture if it is robust to the last-bit
# differences that another correct float32 implementation will have.  The
# float32 noise measured here (decode vs full forward, float32 vs float64) is
# ~3e-6 on logits and ~2e-6 on router logits, so these thresholds leave a
# margin of >300x.
ROUTER_GAP_MIN = 1e-3  # k-th vs (k+1)-th router logit, for every routing decision
GEN_MARGIN_MIN = 1e-2  # top-1 vs top-2 logit at every greedy step
GEN_MIN_DISTINCT = 6  # the greedy continuation must not be one token repeated...
GEN_MAX_RUN = 4  # ...nor contain long runs of one token
MAX_ATTEMPTS = 1000

# Conditioning.  Every residual branch (mixer, feed-forward) is scaled so that
# the RMS of its output is BRANCH_RMS_RATIO times the RMS of the residual
# stream entering it: a moderate update, as in trained models.  (With
# unit-gain output projections each block overwrites the stream, and the
# network amplified 8-bit weight noise 10-80x.)  0.15 still lets every branch
# move the logits by ~8-15% (see check_sensitivities); 0.2 gave ~15% larger
# q8 errors.
BRANCH_RMS_RATIO = 0.15
CALIB_LEN = 64  # tokens of the (separate) random sequence used to calibrate
# The q8 run must stay this close to float32 at every position (relative L2 of
# the logit vector), well inside the engine tests' tolerance of 3e-2.  It must
# also pick the same experts as float32 everywhere: the 8-bit router moves
# router logits by ~1%, enough to flip a close call now and then, and one
# flipped expert moves that position's logits by 5-20%.  Seeds where that
# happens are skipped, like seeds with too small a router gap.
Q8_MAX_REL_L2 = 1.2e-2

# Sensitivity: mean over all positions of both sequences of the relative L2
# change of the logits when one part is knocked out (see check_sensitivities).
SENS_BRANCH_MIN = 2e-2  # zeroing a mixer / feed-forward / shared-expert output
SENS_GATE_MIN = 1e-2  # replacing sigmoid(gate) of the attention output gate by 1
GATE_OPEN = 100.0  # a gate logit with sigmoid(GATE_OPEN) == 1.0 exactly in float32

SIZE_BUDGET = 7_000_000  # bytes, for all of fixtures/

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
        num_hidden_layers=4,
        layer_types=[LIN, LIN, LIN, FULL],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": MROPE_SECTION,
            "mrope_interleaved": True,
        },
        **_hybrid_sizes(),
    )


def _glm4_moe_config(**overrides) -> Glm4MoeConfig:
    # 8 experts in 4 groups of 2, the tokens choosing among the experts of
    # their 2 best groups (topk_group < n_group), renormalised and scaled by
    # 2.5; one shared expert; layer 0 dense (first_k_dense_replace=1);
    # q/k/v biases and half-rotary heads as in GLM-4.5.
    kw = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        attention_bias=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
        num_mtp_layers=0,
    )
    kw.update(overrides)
    return Glm4MoeConfig(**kw)


def glm4_moe_config() -> Glm4MoeConfig:
    # GLM-4.5-Air's attention: no q/k norm.
    return _glm4_moe_config(use_qk_norm=False)


def glm4_moe_qk_norm_config() -> Glm4MoeConfig:
    # GLM-4.5's attention: per-head q/k RMSNorm after the biases; the router
    # keeps its raw top-k weights (norm_topk_prob off), one group of two;
    # layers 0 and 1 dense.
    return _glm4_moe_config(use_qk_norm=True, norm_topk_prob=False, n_group=2, topk_group=1,
                            routed_scaling_factor=1.8, first_k_dense_replace=2)


def _deepseek_v3_config(**overrides) -> DeepseekV3Config:
    # Multi-head latent attention at sizes whose matrices quantize in groups
    # of 64: 4 heads of 16 + 16 query/key features and 16 value features, a
    # latent of 64; interleaved rotary pairs (rope_interleave, the default);
    # the router of glm4_moe's fixture (4 groups keep 2, renormalised,
    # scaling 2.5), one shared expert, layer 0 dense.
    kw = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        num_mtp_layers=0,
        # DeepseekV3Config's defaults name tokens 0 and 1: generate() would stop at 1.
        bos_token_id=None,
        eos_token_id=None,
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def deepseek_v3_config() -> DeepseekV3Config:
    # YaRN over a pretraining context of 32 (factor 4): the 80-token sequence
    # runs past it; mscale_all_dim != mscale makes both the cos/sin factor
    # and the softmax-scale correction differ from 1.
    return _deepseek_v3_config(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 0.707},
    )


def deepseek_v3_no_q_lora_config() -> DeepseekV3Config:
    # Queries from one q_proj (q_lora_rank null, as DeepSeek-V2-Lite), plain
    # RoPE; 2 groups keep 1, raw top-k weights scaled by 1.5, layers 0-1 dense.
    return _deepseek_v3_config(
        q_lora_rank=None, n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.5,
        first_k_dense_replace=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
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

def gpt_oss_config() -> GptOssConfig:
    return GptOssConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,
        sliding_window=GPT_OSS_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        # A limit the gate and up values reach, so the clamps are exercised.
        swiglu_limit=1.5,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_parameters=GPT_OSS_ROPE,
    )


# Shorter than tokens_long, so the window drops positions in both prefill
# and decode.
GPT_OSS_WINDOW = 8
# gpt-oss's YaRN (factor 32, beta 32/1, truncate off, theta 150000), with
# the original context cut to 64 so the test sequences run past it.
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}

FIXTURES = {
    # seed: the first seed tried (see make_fixture); later tries add 1.
    # fused_experts: save with save_original_format=False (fused expert tensors).
    "qwen3_moe": dict(cls=Qwen3MoeForCausalLM, config=qwen3_moe_config, seed=1000, fused_experts=False),
    "qwen3_moe_sparse_step": dict(
        cls=Qwen3MoeForCausalLM, config=qwen3_moe_sparse_step_config, seed=2000, fused_experts=True
    ),
    "qwen3_next": dict(cls=Qwen3NextForCausalLM, config=qwen3_next_config, seed=3000, fused_experts=True),
    "qwen3_5_moe": dict(cls=Qwen3_5MoeForCausalLM, config=qwen3_5_moe_config, seed=4000, fused_experts=False),
    # seq_long: the long sequence's length (SEQ_LONG unless given).
    "glm4_moe": dict(cls=Glm4MoeForCausalLM, config=glm4_moe_config, seed=5000, fused_experts=False),
    "deepseek_v3": dict(cls=DeepseekV3ForCausalLM, config=deepseek_v3_config, seed=7000, fused_experts=False),
    "deepseek_v3_no_q_lora": dict(
        cls=DeepseekV3ForCausalLM, config=deepseek_v3_no_q_lora_config, seed=8006, fused_experts=True
    ),
    "glm4_moe_qk_norm": dict(
        cls=Glm4MoeForCausalLM, config=glm4_moe_qk_norm_config, seed=6000, fused_experts=True, seq_long=300
    ),
    # gpt-oss's experts are always fused (and stored input-major).
    "gpt_oss": dict(cls=GptOssForCausalLM, config=gpt_oss_config, seed=5000, fused_experts=True),
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
    bugs invisible and whose logits are nearly flat.  The scales below give
    unit-size activations inside each block, logits with a std of about 2
    across the vocabulary and router logits with a std of about 2.  The output
    projection of each residual branch gets a unit-gain value here and is
    rescaled afterwards by calibrate_branches.

    Matrices (everything that gets quantized) are drawn from a zero-mean
    uniform distribution, like PyTorch's default nn.Linear init, rather than
    a normal one.  For a given RMS, uniform values have the smallest range,
    and the min/max affine quantizer's step is range / (2**bits - 1): 8-bit
    groups of 64 then lose ~0.38% of the weight instead of ~0.54%.  The q8
    logit error is mostly the sum of such per-matrix errors (embedding and
    lm_head alone gave ~0.75% with normal weights, everything ~1.0%, ~0.7%
    with uniform ones), so this is what keeps the q8 run within
    Q8_MAX_REL_L2 of float32 with some room.
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=gen) * (hi - lo) + lo

    def matrix(shape, std):
        # Zero-mean uniform with standard deviation `std`.
        return uniform(shape, -(3**0.5) * std, 3**0.5 * std)

    hidden = model.config.hidden_size
    for name, p in model.named_parameters():  # tied weights are listed once
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            # decay per step = exp(-exp(A_log) * softplus(a + dt_bias)); a range
            # of A gives both long- and short-memory heads.
            new = uniform(p.shape, np.log(0.02), np.log(2.0))
        elif leaf == "dt_bias":
            # a (from in_proj_ba / in_proj_a) has std ~1, so softplus(a + dt_bias)
            # spans ~0.05-3 and, with A in [0.02, 2], the per-step decay
            # exp(-A * softplus(a + dt_bias)) spans ~0.999 down to ~0.002.
            new = uniform(p.shape, -1.0, 1.0)
        elif "conv1d" in name:  # [channels, 1, kernel]
            # Kernel of 4 taps, std 0.5: the conv keeps its input's size.
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
            new = matrix(p.shape, 2.0 / hidden**0.5)
        elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
            # Router: logits with std ~2 give clearly separated experts.
            new = matrix(p.shape, ROUTER_STD.get(model.config.model_type, 2.0) / hidden**0.5)
        elif name.endswith("self_attn.sinks"):
            # gpt-oss's sink logits, on the scale of the attention logits.
            new = normal(p.shape, 1.0)
        elif model.config.model_type == "gpt_oss" and name.endswith(("bias", "_bias")):
            # gpt-oss's projection, router and expert biases.
            new = normal(p.shape, 0.3)
        elif p.dim() == 3 and model.config.model_type == "gpt_oss" and name.endswith(FUSED_EXPERTS):
            # gpt-oss's experts are input-major: [E, H, 2I] and [E, I, H].
            new = matrix(p.shape, p.shape[-2] ** -0.5)
        elif p.dim() == 3 and ".experts." in name:
            # Fused experts: gate_up_proj [E, 2I, H], down_proj [E, H, I];
            # the last dim is the input dim.
            new = matrix(p.shape, p.shape[-1] ** -0.5)
        elif p.dim() == 2:
            # Every other matrix is a linear [out, in]: unit-gain init.
            new = matrix(p.shape, p.shape[-1] ** -0.5)
        elif p.dim() == 1 and name.endswith("_proj.bias"):
            # Attention biases (GLM-4.5): a visible offset on unit-size
            # projections.
            new = normal(p.shape, 0.5)
        else:
            raise ValueError(f"no randomisation rule for {name} {tuple(p.shape)}")
        assert not torch.equal(new, p), name
        p.copy_(new)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            # The router's correction of its choice (DeepSeek-V3, GLM-4.5):
            # sigmoid scores lie in (0, 1), so +-0.15 changes choices without
            # deciding them alone.
            buf.copy_(uniform(buf.shape, -CORRECTION_BIAS, CORRECTION_BIAS))
    correlate_linear_attention_qk(model)


ROUTER_STD = {}
CORRECTION_BIAS = 0.15

# How strongly each linear-attention head's keys follow its queries.
LINEAR_QK_RHO = 0.8


@torch.no_grad()
def correlate_linear_attention_qk(model: torch.nn.Module) -> None:
    """Make the keys of every linear-attention head partly copies of its queries.

    At a sequence's first position the gated delta rule's state holds one
    key, so a head's output is beta * (q . k) * v, and the gated RMSNorm that
    follows keeps only its direction, sign(q . k) * v.  With independent
    random q and k, q . k is often close to 0 and the head's output flips with
    any small perturbation: in a random model this made the q8 error reach
    2-3% at some positions, a discontinuity trained models do not show (and
    one a float32 reference cannot pin down either).  Mixing
    k = rho * q + sqrt(1 - rho^2) * k, for both the input-projection rows and
    the conv1d taps, keeps q . k of a position with itself clearly positive,
    while keys stay distinct from queries.  Both uniform parts have the same
    std, so the mix keeps it.
    """
    a, b = LINEAR_QK_RHO, (1 - LINEAR_QK_RHO**2) ** 0.5
    for layer in model.model.layers:
        lin = getattr(layer, "linear_attn", None)
        if lin is None:
            continue
        kd, hk, nk = lin.key_dim, lin.head_k_dim, lin.num_k_heads
        if hasattr(lin, "in_proj_qkv"):  # Qwen3.5: rows [q (all heads), k, v]
            w = lin.in_proj_qkv.weight
            q_rows = list(range(0, kd))
            k_rows = list(range(kd, 2 * kd))
        else:  # Qwen3-Next in_proj_qkvz: per key head [q, k, v..., z...]
            w = lin.in_proj_qkvz.weight
            per_head = w.shape[0] // nk
            q_rows = [h * per_head + i for h in range(nk) for i in range(hk)]
            k_rows = [h * per_head + hk + i for h in range(nk) for i in range(hk)]
        w[k_rows] = a * w[q_rows] + b * w[k_rows]
        conv = lin.conv1d.weight  # [channels, 1, kernel], channels [q, k, v] in both models
        conv[kd : 2 * kd] = a * conv[:kd] + b * conv[kd : 2 * kd]


def residual_branches(model: torch.nn.Module) -> list[dict]:
    """The two residual branches of every decoder layer, in order.

    Each entry: layer index, part ("mixer" or "ffn"), kind (full_attention /
    linear_attention / moe / dense), the branch module (its output is what is
    added to the residual stream), the norm in front of it (its input is the
    residual stream entering the branch), and the output-projection
    parameters whose scale sets the size of the branch output.
    """
    out = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer, "self_attn"):
            attn = layer.self_attn
            params = [attn.o_proj.weight] + ([attn.o_proj.bias] if attn.o_proj.bias is not None else [])
            out.append(dict(layer=i, part="mixer", kind=FULL, module=attn, norm=layer.input_layernorm,
                            out_params=params))
        else:
            lin = layer.linear_attn
            out.append(dict(layer=i, part="mixer", kind=LIN, module=lin, norm=layer.input_layernorm,
                            out_params=[lin.out_proj.weight]))
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            # Routed and shared experts are scaled together, keeping their ratio.
            params = [mlp.experts.down_proj]
            if hasattr(mlp.experts, "down_proj_bias"):
                params.append(mlp.experts.down_proj_bias)
            if hasattr(mlp, "shared_expert"):
                params.append(mlp.shared_expert.down_proj.weight)
            if hasattr(mlp, "shared_experts"):  # DeepSeek-V3, GLM-4.5
                params.append(mlp.shared_experts.down_proj.weight)
            out.append(dict(layer=i, part="ffn", kind="moe", module=mlp, norm=layer.post_attention_layernorm,
                            out_params=params))
        else:
            out.append(dict(layer=i, part="ffn", kind="dense", module=mlp, norm=layer.post_attention_layernorm,
                            out_params=[mlp.down_proj.weight]))
    return out


def _first(output):
    """The tensor a module adds to the residual stream (attention returns a tuple)."""
    return output[0] if isinstance(output, tuple) else output


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


@torch.no_grad()
def branch_rms_ratios(model, tokens: torch.Tensor, branches: list[dict] | None = None) -> list[float]:
    """RMS(branch output) / RMS(residual stream entering the branch), per branch.

    RMS over all positions and channels of one forward over `tokens`.
    """
    branches = branches if branches is not None else residual_branches(model)
    res, out, handles = {}, {}, []
    for j, b in enumerate(branches):
        handles.append(b["norm"].register_forward_pre_hook(lambda _m, args, j=j: res.__setitem__(j, _rms(args[0]))))
        handles.append(b["module"].register_forward_hook(lambda _m, _a, o, j=j: out.__setitem__(j, _rms(_first(o)))))
    try:
        model(input_ids=tokens[None].long(), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [out[j] / res[j] for j in range(len(branches))]


@torch.no_grad()
def calibrate_branches(model, tokens: torch.Tensor) -> None:
    """Rescale each branch's output projection to a BRANCH_RMS_RATIO update.

    A random network with unit-gain output projections is badly conditioned:
    every block overwrites the residual stream, so small weight errors are
    amplified layer after layer (8-bit quantization moved the logits by 5-40%).
    In trained models each block adds a moderate update to the stream.  The
    branches are calibrated in forward order, each on a forward pass that
    already sees the final scales of all earlier branches (a later branch
    does not change what an earlier one sees).  Deterministic: float32 CPU
    forwards on a fixed token sequence.
    """
    branches = residual_branches(model)
    for j, b in enumerate(branches):
        ratio = branch_rms_ratios(model, tokens, branches)[j]
        for p in b["out_params"]:
            p.mul_(BRANCH_RMS_RATIO / ratio)


def check_all_parameters_varied(model: torch.nn.Module) -> None:
    """No parameter may be constant (which is what an untouched init looks like)."""
    for name, p in model.named_parameters():
        if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
            raise AssertionError(f"parameter {name} is constant")


def save_bf16_checkpoint(model: torch.nn.Module, hf_dir: Path, fused_experts: bool) -> None:
    """Cast to bf16 and save_pretrained, keeping only the files we need.

    transformers 5 always writes safetensors (safe_serialization is gone).  By
    default it reverts its load-time conversions, i.e. writes the Hub layout
    (routed experts one by one); save_original_format=False writes the
    in-memory names and shapes instead (fused expert tensors).
    """
    model.to(torch.bfloat16).save_pretrained(hf_dir, save_original_format=not fused_experts)
    for f in hf_dir.iterdir():
        if f.name not in HF_KEEP:
            f.unlink() if f.is_file() else shutil.rmtree(f)
    if not (hf_dir / "model.safetensors").exists():
        raise RuntimeError(f"expected a single model.safetensors in {hf_dir}")


def checkpoint_layout(hf_dir: Path, config, fused_experts: bool) -> dict:
    """Check and describe how the routed experts are stored in model.safetensors."""
    with safe_open(hf_dir / "model.safetensors", "pt") as sf:
        shapes = {k: list(sf.get_slice(k).get_shape()) for k in sf.keys()}
    if config.model_type == "gpt_oss":
        return gpt_oss_layout(shapes, config)
    fused = sorted(k for k in shapes if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")))
    per_expert = sorted(k for k in shapes if ".mlp.experts." in k and k not in fused)
    e = getattr(config, "num_experts", None) or config.num_local_experts
    h, i = config.hidden_size, config.moe_intermediate_size
    if fused_experts:
        if per_expert or not fused:
            raise AssertionError(f"{hf_dir}: expected only fused experts, got {per_expert[:3]}")
        for k in fused:
            want = [e, 2 * i, h] if k.endswith("gate_up_proj") else [e, h, i]
            if shapes[k] != want:
                raise AssertionError(f"{k}: shape {shapes[k]}, expected {want}")
    elif fused or not per_expert:
        raise AssertionError(f"{hf_dir}: expected only per-expert tensors, got {fused[:3]}")
    # Qwen3MoeConfig maps num_experts to num_local_experts and writes that key.
    config_json = json.loads((hf_dir / "config.json").read_text())
    (num_experts_key,) = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config_json]
    assert config_json[num_experts_key] == e
    info = {
        "experts": "fused" if fused_experts else "per_expert",
        "saved_with": f"save_pretrained(save_original_format={not fused_experts})",
        "expert_tensors": (
            "model.layers.{L}.mlp.experts.gate_up_proj [E, 2I, H] (rows [0, I) gate, [I, 2I) up) and "
            "model.layers.{L}.mlp.experts.down_proj [E, H, I]"
            if fused_experts
            else "model.layers.{L}.mlp.experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H], "
            ".down_proj.weight [H, I]"
        ),
        "example_expert_tensors": {k: shapes[k] for k in (fused or per_expert)[:3]},
        # The key config.json uses for the number of routed experts.
        "config_num_experts_key": num_experts_key,
    }
    # Other fused projections that transformers never splits (qwen3_next).
    other = sorted(k for k in shapes if "in_proj_qkvz" in k or "in_proj_ba" in k)
    if other:
        info["linear_attn_fused_projections"] = {k: shapes[k] for k in other[:2]}
    return info


def gpt_oss_layout(shapes: dict, config) -> dict:
    """gpt-oss's fused, input-major experts with their biases."""
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    want = {"gate_up_proj": [e, h, 2 * i], "gate_up_proj_bias": [e, 2 * i], "down_proj": [e, i, h],
            "down_proj_bias": [e, h]}
    for layer in range(config.num_hidden_layers):
        for t, shape in want.items():
            k = f"model.layers.{layer}.mlp.experts.{t}"
            if shapes.get(k) != shape:
                raise AssertionError(f"{k}: shape {shapes.get(k)}, expected {shape}")
    return {
        "experts": "fused",
        "saved_with": "save_pretrained()",
        "expert_tensors": "model.layers.{L}.mlp.experts.gate_up_proj [E, H, 2I] (input-major; column 2j is "
        "gate row j, column 2j+1 up row j), gate_up_proj_bias [E, 2I] (same interleaving), down_proj [E, I, H] "
        "(input-major), down_proj_bias [E, H]",
        "example_expert_tensors": {k: v for k, v in shapes.items() if "layers.0.mlp.experts." in k},
        "config_num_experts_key": "num_local_experts",
    }


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

ALWAYS_8_BITS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight", "mlp.router.weight")
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
    if p.dim() == 2 and p.shape[-1] % GROUP_SIZE == 0 and "norm" not in name and not name.endswith("bias"):
        return 8 if any(name.endswith(s) for s in ALWAYS_8_BITS) else bits
    return None


@torch.no_grad()
def quantize_model(model: torch.nn.Module, bits: int) -> tuple[torch.nn.Module, dict[str, int]]:
    qmodel = copy.deepcopy(model)  # deepcopy keeps tied weights tied
    if qmodel.config.tie_word_embeddings:
        assert qmodel.lm_head.weight is qmodel.model.embed_tokens.weight
    used = {}
    for name, p in qmodel.named_parameters():  # a tied lm_head is not listed
        nb = quantized_bits(name, p, bits)
        if nb is None:
            continue
        if p.dim() == 3 and qmodel.config.model_type == "gpt_oss":
            # gpt-oss stores its fused experts input-major ([E, in, out]):
            # quantized as their transposes, the [out, in] matrices the
            # converter writes.
            p.copy_(torch.stack([quantize_dequantize(p[e].T.contiguous(), nb).T for e in range(p.shape[0])]))
        elif p.dim() == 3:
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
    # Exact ties and a constant group.  A row with min 0 and max 2**bits - 1
    # has s == 1 exactly, so w = k + 0.5 sits half-way and must round to even.
    for bits in (4, 8):
        qmax = 2**bits - 1
        tie = torch.arange(GROUP_SIZE, dtype=torch.float32) % qmax + 0.5
        tie[0], tie[1] = 0.0, float(qmax)
        w = torch.stack([tie, torch.full((GROUP_SIZE,), 0.375)])  # row 1: s == 0
        a = quantize_dequantize(w, bits)
        c = _quantize_dequantize_numpy(w.numpy(), bits)
        assert np.array_equal(a.numpy().view(np.uint32), c.view(np.uint32)), "quantizers disagree on ties"
        expected = torch.round(tie)  # half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, ...
        assert torch.equal(a[0], expected) and bool((a[1] == 0.375).all()), "tie / constant group"


# =============================================================================
# Reference computations
# =============================================================================


class RouterLog:
    """What the routers of one forward pass decided.

    gaps: per MoE layer, the smallest gap between the k-th and (k+1)-th router
    logit over all tokens (a tiny gap means a last-bit difference could flip
    an expert choice and change the output a lot).  choices: per MoE layer,
    the sorted top-k expert indices [T, k].
    """

    def __init__(self):
        self.gaps: list[float] = []
        self.choices: list[torch.Tensor] = []

    def hook(self, k: int):
        def fn(module, _inputs, output):
            choice = output[0]  # router logits [T, E]
            gap, slope = float("inf"), 1.0
            if hasattr(module, "e_score_correction_bias"):
                # Gaps of sigmoid scores, in logits: divided by the sigmoid's
                # largest slope, so a last-bit logit error moves a score by
                # at most a quarter of its size.
                choice, gap = grouped_choice(module, choice)
                slope = 0.25
            top = choice.topk(k + 1, dim=-1)
            gap = min(gap, float((top.values[:, k - 1] - top.values[:, k]).min()))
            self.gaps.append(gap / slope)
            self.choices.append(top.indices[:, :k].sort(dim=-1).values)

        return fn


def grouped_choice(router, logits: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The scores a DeepSeek-V3 / GLM-4.5 router chooses its top-k by, and the
    smallest gap of its group choice.

    sigmoid(logits) + e_score_correction_bias, minus infinity outside the
    topk_group groups whose two best scores sum highest; the gap is between
    the topk_group-th and the next group's sum (infinite with one group kept
    of one).
    """
    scores = logits.sigmoid() + router.e_score_correction_bias
    groups, keep = router.num_group, router.topk_group
    group_scores = scores.view(scores.shape[0], groups, -1).topk(2, dim=-1).values.sum(-1)
    gap = float("inf")
    if keep < groups:
        ordered = group_scores.sort(dim=-1, descending=True).values
        gap = float((ordered[:, keep - 1] - ordered[:, keep]).min())
    kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(keep, dim=-1).indices, 1)
    mask = kept.unsqueeze(-1).expand(-1, groups, scores.shape[1] // groups).reshape(scores.shape)
    return scores.masked_fill(~mask.bool(), float("-inf")), gap


def routing_differences(a: RouterLog, b: RouterLog) -> int:
    """Number of (layer, token) routing decisions whose expert sets differ."""
    assert len(a.choices) == len(b.choices)
    return sum(int((x != y).any(dim=-1).sum()) for x, y in zip(a.choices, b.choices))


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor, router: RouterLog | None = None) -> torch.Tensor:
    """Logits [T, V] of one forward pass over `tokens`, without a cache."""
    handles = []
    if router is not None:
        hook = router.hook(model.config.num_experts_per_tok)
        handles = [m.register_forward_hook(hook) for n, m in model.named_modules()
                   if n.endswith(("mlp.gate", "mlp.router"))]
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


def rel_l2_per_position(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """||a_t - ref_t|| / ||ref_t|| for every position t of [T, V] logits."""
    return (a - ref).norm(dim=-1) / ref.norm(dim=-1)


def compare(lq: torch.Tensor, l: torch.Tensor) -> dict:
    per_pos = rel_l2_per_position(lq, l)
    return {
        "rel_l2": float((lq - l).norm() / l.norm()),
        "max_rel_l2_per_position": float(per_pos.max()),
        "mean_rel_l2_per_position": float(per_pos.mean()),
        "max_abs": float((lq - l).abs().max()),
        "top1_agreement": float((lq.argmax(-1) == l.argmax(-1)).float().mean()),
    }


def _zero_output(_module, _inputs, output):
    """Forward hook: the module's contribution becomes zero."""
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]),) + tuple(output[1:])
    return torch.zeros_like(output)


def _open_output_gate(head_dim: int):
    """Forward hook for q_proj of a gated attention: sigmoid(gate) becomes 1.

    The gated attentions of Qwen3-Next / Qwen3.5 compute
    q_proj(x).view(..., heads, 2 * head_dim) -> (query, gate) halves and
    multiply the attention output by sigmoid(gate); setting the gate half to
    GATE_OPEN turns that factor into exactly 1.
    """

    def hook(_module, _inputs, output):
        out = output.clone()
        out.view(*out.shape[:-1], -1, 2 * head_dim)[..., head_dim:] = GATE_OPEN
        return out

    return hook


@torch.no_grad()
def check_sensitivities(model, seqs: list[torch.Tensor]) -> dict:
    """Knock out one part at a time; the logits must move clearly every time.

    Parts: each layer's mixer output and feed-forward output (set to zero), the
    shared expert of each MoE layer that has one (set to zero), and the output
    gate of each gated attention (sigmoid(gate) replaced by 1).  The effect is
    the relative L2 change of the logits per position, over all positions of
    `seqs`; its mean must reach SENS_BRANCH_MIN (SENS_GATE_MIN for gates), else
    this raises: a fixture in which a part barely matters cannot catch an
    engine bug in that part.
    """
    assert float(torch.sigmoid(torch.tensor(GATE_OPEN))) == 1.0
    base = [forward_logits(model, t) for t in seqs]
    probes = []  # (layer, part, kind, module to hook, hook, threshold)
    for b in residual_branches(model):
        probes.append((b["layer"], b["part"], b["kind"], b["module"], _zero_output, SENS_BRANCH_MIN))
        for shared in ("shared_expert", "shared_experts"):
            if b["kind"] == "moe" and hasattr(b["module"], shared):
                probes.append((b["layer"], "shared_expert", "moe", getattr(b["module"], shared), _zero_output,
                               SENS_BRANCH_MIN))
        attn = b["module"]
        if b["kind"] == FULL and getattr(attn, "q_proj", None) is not None and hasattr(attn, "head_dim") \
                and attn.q_proj.out_features == 2 * model.config.num_attention_heads * attn.head_dim:
            # A gated attention (Qwen3-Next / Qwen3.5): q_proj also yields the gate.
            probes.append((b["layer"], "attn_output_gate", FULL, attn.q_proj, _open_output_gate(attn.head_dim),
                           SENS_GATE_MIN))
    results, failures = [], []
    for layer, part, kind, module, hook, threshold in probes:
        handle = module.register_forward_hook(hook)
        try:
            rel = torch.cat([rel_l2_per_position(forward_logits(model, t), l) for t, l in zip(seqs, base)])
        finally:
            handle.remove()
        r = {"layer": layer, "part": part, "kind": kind, "mean_rel_l2": float(rel.mean()),
             "min_rel_l2": float(rel.min()), "max_rel_l2": float(rel.max()), "threshold": threshold}
        results.append(r)
        if r["mean_rel_l2"] < threshold:
            failures.append(r)
    if failures:
        raise AssertionError(f"parts that barely change the logits: {failures}")
    summary = {}
    for part in ("mixer", "ffn", "shared_expert", "attn_output_gate"):
        vals = [r["mean_rel_l2"] for r in results if r["part"] == part]
        if vals:
            summary[f"min_mean_rel_l2_{part}"] = min(vals)
    return {
        "method": "forward hooks on the float32 reference: mixer (self_attn / linear_attn), feed-forward "
        "(mlp) and shared_expert outputs set to zero; attention output gate opened by setting the gate "
        "half of q_proj's output to %g (sigmoid == 1). Value: relative L2 change of the logits per "
        "position over tokens_short and tokens_long; mean must reach the threshold." % GATE_OPEN,
        **summary,
        "parts": results,
    }


@torch.no_grad()
def check_rope(model) -> dict:
    """Compare the model's rotary tables with plain (1-D) RoPE on the text positions (YaRN differs)."""
    cfg = model.config
    rp = cfg.rope_parameters
    head_dim = cfg.head_dim
    rot_dim = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rp["rope_theta"] ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    rotary = model.model.rotary_emb
    info = {"rotary_dim": rot_dim, "num_frequencies": rot_dim // 2, "rope_type": rp.get("rope_type", "default"),
            "attention_scaling": float(model.model.rotary_emb.attention_scaling)}
    info["inv_freq_matches_formula"] = bool(torch.equal(rotary.inv_freq, inv_freq))
    pos = torch.arange(SEQ_LONG)
    x = torch.zeros(1, SEQ_LONG, head_dim)
    if isinstance(model, Qwen3_5MoeForCausalLM):
        # Text-only input: the T, H and W position streams are all equal.
        cos, sin = rotary(x, pos.view(1, 1, -1).expand(3, 1, -1))
    else:
        cos, sin = rotary(x, pos[None])
    freqs = pos[:, None].float() * inv_freq[None, :]
    # gpt-oss's tables hold each frequency once, the others twice.
    emb = freqs if cos.shape[-1] == rot_dim // 2 else torch.cat((freqs, freqs), dim=-1)
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
    "model.language_model.layers.1.mlp.experts.3.up_proj.weight",
    "model.language_model.layers.2.mlp.experts.6.gate_proj.weight",
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
    """Write qwen3_5_moe/hf_hub_sharded from the float32 reference model.

    A real tiny Qwen3_5MoeForConditionalGeneration is built around the text
    weights: its logits on text-only input must equal the CausalLM's, and its
    own save_pretrained output must match our hand-built tensor names and
    values (which pins down the Hub naming).  The tensors are then written in
    three shards, with mtp.* extras, and transformers must load them back.
    """
    info = {}
    cfg = Qwen3_5MoeConfig(
        text_config=qwen3_5_moe_config(),  # fresh: no load-time fields (_name_or_path, dtype)
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
        cond.to(torch.bfloat16).save_pretrained(tmp)  # (cond is not used after this)
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


def longest_run(ids: list[int]) -> int:
    best = cur = 1
    for prev, nxt in zip(ids, ids[1:]):
        cur = cur + 1 if prev == nxt else 1
        best = max(best, cur)
    return best


def build_candidate(spec: dict, seed: int, fdir: Path) -> dict:
    """Build, save and reload one random model; compute all references for it.

    Returns the references plus a list of `problems` that make it unsuitable
    as a fixture (empty if it is fine).
    """
    cls = spec["cls"]
    if fdir.exists():
        shutil.rmtree(fdir)
    hf_dir = fdir / "hf"
    hf_dir.mkdir(parents=True)
    config = spec["config"]()

    gen = torch.Generator().manual_seed(seed)
    vocab = config.vocab_size
    tokens_short = torch.randint(0, vocab, (SEQ_SHORT,), generator=gen, dtype=torch.int64)
    tokens_long = torch.randint(0, vocab, (spec.get("seq_long", SEQ_LONG),), generator=gen, dtype=torch.int64)
    tokens_calib = torch.randint(0, vocab, (CALIB_LEN,), generator=gen, dtype=torch.int64)

    # 1. Build, randomise, calibrate the branch sizes, save as bf16.
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.set_attn_implementation("eager")  # (only for calibrate_branches)
    model.set_experts_implementation("eager")
    randomize_parameters(model, seed)
    calibrate_branches(model, tokens_calib)
    check_all_parameters_varied(model)
    save_bf16_checkpoint(model, hf_dir, spec["fused_experts"])  # `model` is bf16 from here on
    layout = checkpoint_layout(hf_dir, config, spec["fused_experts"])

    # 2. Reload as float32: the reference model.
    ref = load_reference_model(cls, hf_dir)
    check_reload(ref, model)
    check_all_parameters_varied(ref)
    del model

    routers: dict[str, RouterLog] = {}  # every forward pass below, by name

    def fwd(model, tokens, key):
        routers[key] = RouterLog()
        return forward_logits(model, tokens, routers[key])

    logits_short = fwd(ref, tokens_short, "f32_short")
    logits_long = fwd(ref, tokens_long, "f32_long")
    generate_ids, step_logits = greedy_generate(ref, tokens_short)
    # Teacher-forced full forward over prompt + generated tokens: must agree
    # with the cached decode path (and covers its routing decisions).
    full = fwd(ref, torch.cat([tokens_short, generate_ids[:-1]]), "f32_generated")[SEQ_SHORT - 1 :]
    # A prefix of the long sequence must give the same logits as a full pass.
    prefix = forward_logits(ref, tokens_long[:SEQ_SHORT])
    top2 = step_logits.topk(2, dim=-1).values
    ids = generate_ids.tolist()
    gen_check = {
        "decode_vs_full_forward_max_abs_diff": float((step_logits - full).abs().max()),
        "decode_tokens_equal_full_forward_argmax": bool(torch.equal(full.argmax(-1), generate_ids)),
        "prefix_vs_full_sequence_max_abs_diff": float((prefix - logits_long[:SEQ_SHORT]).abs().max()),
        "min_top1_top2_margin": float((top2[:, 0] - top2[:, 1]).min()),
        "distinct_tokens": len(set(ids)),
        "longest_run": longest_run(ids),
    }

    # 3. Quantized references.
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
        qs = fwd(qmodel, tokens_short, f"q{bits}_short")
        ql = fwd(qmodel, tokens_long, f"q{bits}_long")
        tensors[f"logits_short_q{bits}"] = qs
        tensors[f"logits_long_q{bits}"] = ql
        both = compare(torch.cat([qs, ql]), torch.cat([logits_short, logits_long]))
        quant_info[f"q{bits}"] = {
            "short": compare(qs, logits_short),
            "long": compare(ql, logits_long),
            "both": both,
            # Informational for q4 (its run is only compared with its own
            # dequantized reference); must be 0 for q8.
            "routing_decisions_differing_from_float32": sum(
                routing_differences(routers[f"f32_{k}"], routers[f"q{bits}_{k}"]) for k in ("short", "long")
            ),
            "num_quantized_tensors": len(used),
            "bits_per_tensor": used,
        }
        del qmodel

    # Smallest router gap of each run (float32, q4, q8), each checked on its own.
    gaps = {run: min(g for k, r in routers.items() if k.startswith(run) for g in r.gaps) for run in ("f32", "q4", "q8")}
    min_gap = min(gaps.values())
    q8 = quant_info["q8"]
    problems = []
    if min_gap < ROUTER_GAP_MIN:
        problems.append(f"router top-k gap {min_gap:.2e} < {ROUTER_GAP_MIN} ({gaps})")
    if q8["routing_decisions_differing_from_float32"]:
        problems.append(f"q8 routes {q8['routing_decisions_differing_from_float32']} decisions unlike float32")
    if q8["both"]["max_rel_l2_per_position"] > Q8_MAX_REL_L2:
        problems.append(f"q8 rel L2 {q8['both']['max_rel_l2_per_position']:.2e} > {Q8_MAX_REL_L2} at some position")
    if gen_check["min_top1_top2_margin"] < GEN_MARGIN_MIN:
        problems.append(f"greedy margin {gen_check['min_top1_top2_margin']:.2e} < {GEN_MARGIN_MIN}")
    if gen_check["distinct_tokens"] < GEN_MIN_DISTINCT or gen_check["longest_run"] > GEN_MAX_RUN:
        problems.append(f"repetitive greedy continuation {ids}")
    if not gen_check["decode_tokens_equal_full_forward_argmax"]:
        problems.append("cached decode and full forward disagree on a greedy token")
    return {
        "ref": ref,
        "seed": seed,
        "tensors": tensors,
        "tokens_calib": tokens_calib,
        "layout": layout,
        "quant_info": quant_info,
        "gen_check": gen_check,
        "router_min_gap": min_gap,
        "router_min_gap_per_run": gaps,
        "problems": problems,
    }


def make_fixture(name: str, spec: dict, out_root: Path) -> dict:
    cls = spec["cls"]
    fdir = out_root / name
    # Random models are occasionally fragile (an expert choice or a greedy
    # token decided by a hair); try seeds in a fixed order until one is robust.
    rejected = []
    for attempt in range(MAX_ATTEMPTS):
        cand = build_candidate(spec, spec["seed"] + attempt, fdir)
        if not cand["problems"]:
            break
        rejected.append({"seed": cand["seed"], "problems": cand["problems"]})
    else:
        raise RuntimeError(f"{name}: no robust seed in {MAX_ATTEMPTS} attempts")
    ref, tensors, quant_info = cand["ref"], cand["tensors"], cand["quant_info"]
    check_quantizer(ref)
    seqs = [tensors["tokens_short"], tensors["tokens_long"]]
    sensitivity = check_sensitivities(ref, seqs)
    branches = residual_branches(ref)
    ratios_calib = branch_rms_ratios(ref, cand["tokens_calib"], branches)
    ratios_long = branch_rms_ratios(ref, tensors["tokens_long"], branches)
    save_file(tensors, fdir / "reference.safetensors")

    stats = {"short": logit_stats(tensors["logits_short"]), "long": logit_stats(tensors["logits_long"])}
    info = {
        "fixture": name,
        "model_class": cls.__name__,
        "config_class": type(ref.config).__name__,
        "model_type": ref.config.model_type,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "safetensors_version": safetensors.__version__,
        "numpy_version": np.__version__,
        "seed": cand["seed"],
        "rejected_seeds": rejected,
        "checkpoint_layout": cand["layout"],
        "seq_len_short": SEQ_SHORT,
        "seq_len_long": int(tensors["tokens_long"].numel()),
        "generate_new_tokens": NEW_TOKENS,
        "generate_ids": tensors["generate_ids"].tolist(),
        "reference_recipe": (
            "bf16 checkpoint reloaded with dtype=float32, attn_implementation=eager, "
            "experts_implementation=eager, CPU, torch.no_grad(); logits from one forward over the "
            "whole sequence with use_cache=False; generate_ids from model.generate(tokens_short, "
            "max_new_tokens=16, do_sample=False, eos_token_id=None) (cached decode path)."
        ),
        "quantization": {
            "group_size": GROUP_SIZE,
            "description": QUANT_DESCRIPTION,
            "names": "bits_per_tensor uses transformers' in-memory names: in a per-expert checkpoint "
            "(checkpoint_layout.experts), mlp.experts.gate_up_proj is experts.{e}.gate_proj + "
            "experts.{e}.up_proj and mlp.experts.down_proj is experts.{e}.down_proj; a tied lm_head "
            "shares embed_tokens.",
            **quant_info,
        },
        "logit_stats": stats,
        "conditioning": {
            "method": "after randomisation, each residual branch's output projection (o_proj / out_proj / "
            "down_proj / experts.down_proj with shared_expert.down_proj) is rescaled, in forward order, so "
            "that RMS(branch output) = %g x RMS(residual stream entering the branch) on a separate random "
            "sequence of %d tokens (float32, before the bf16 cast)." % (BRANCH_RMS_RATIO, CALIB_LEN),
            "target_ratio": BRANCH_RMS_RATIO,
            "weights": "matrices zero-mean uniform; norms, conv1d normal; see randomize_parameters",
            **({"linear_attention_qk_rho": LINEAR_QK_RHO} if any(b["kind"] == LIN for b in branches) else {}),
            "q8_max_rel_l2_per_position_threshold": Q8_MAX_REL_L2,
            "branch_rms_ratio": [
                {"layer": b["layer"], "part": b["part"], "kind": b["kind"],
                 "calibration_tokens": rc, "tokens_long": rl}
                for b, rc, rl in zip(branches, ratios_calib, ratios_long)
            ],
        },
        "sensitivity": sensitivity,
        "robustness": {
            "router_min_topk_logit_gap": cand["router_min_gap"],
            "router_min_topk_logit_gap_per_run": cand["router_min_gap_per_run"],
            "router_gap_threshold": ROUTER_GAP_MIN,
            "greedy_margin_threshold": GEN_MARGIN_MIN,
            "note": "router gap: over every routing decision of the float32, q4 and q8 forwards "
            "(short, long, and for float32 prompt+generated tokens), each run checked on its own. "
            "The q8 run must also pick the same experts as float32 everywhere; q4 may differ "
            "(quantization.q4.routing_decisions_differing_from_float32).",
        },
        "generation_check": cand["gen_check"],
        "rope": check_rope(ref),
    }
    if name == "qwen3_5_moe":
        info["hf_hub_sharded"] = write_qwen3_5_hub_checkpoint(
            ref, tensors["tokens_short"], tensors["logits_short"], fdir / "hf_hub_sharded"
        )
    (fdir / "reference.json").write_text(json.dumps(info, indent=2) + "\n")

    # Console summary.
    print(f"\n== {name} ({cls.__name__}), seed {cand['seed']} ({len(rejected)} rejected)")
    for k, st in stats.items():
        print(f"   logits_{k:5s} std mean {st['std_mean']:.3f} [{st['std_min']:.3f}, {st['std_max']:.3f}]"
              f"  min top1-top2 margin {st['top1_top2_margin_min']:.4f} (pos {st['top1_top2_margin_argmin']})")
        if st["top1_top2_margin_min"] < MARGIN_WARN:
            print(f"   WARNING: logits_{k} has a top-1/top-2 margin below {MARGIN_WARN}")
    for q in ("q4", "q8"):
        d = quant_info[q]
        print(f"   {q}: rel L2 per position max {d['both']['max_rel_l2_per_position']:.4f} "
              f"mean {d['both']['mean_rel_l2_per_position']:.4f}; top-1 agreement "
              f"{d['both']['top1_agreement']:.3f} (short {d['short']['top1_agreement']:.3f}, long "
              f"{d['long']['top1_agreement']:.3f}); routing decisions unlike float32 "
              f"{d['routing_decisions_differing_from_float32']}")
    print("   branch RMS ratios (tokens_long) " + " ".join(f"{r:.3f}" for r in ratios_long))
    print("   sensitivity (min mean rel L2) " + ", ".join(
        f"{k[len('min_mean_rel_l2_'):]} {v:.3f}" for k, v in sensitivity.items() if k.startswith("min_")))
    print(f"   layout {cand['layout']['experts']}, config num-experts key {cand['layout']['config_num_experts_key']}")
    print(f"   generate_ids {info['generate_ids']}")
    print(f"   generation check {cand['gen_check']}")
    print(f"   router min top-k logit gap {cand['router_min_gap']:.2e} {cand['router_min_gap_per_run']}; "
          f"rope {info['rope']}")
    if "hf_hub_sharded" in info:
        print(f"   hf_hub_sharded {info['hf_hub_sharded']}")
    return info


def print_layout(out_root: Path, names: list[str]) -> None:
    print("\n== files")
    total = 0
    for f in sorted(p for n in names for p in (out_root / n).rglob("*") if p.is_file()):
        total += f.stat().st_size
        print(f"   {f.stat().st_size:>10,d}  {f.relative_to(out_root)}")
    print(f"   {total:>10,d}  total")
    if total > SIZE_BUDGET:
        print(f"   NOTE: over the {SIZE_BUDGET:,d}-byte budget for fixtures/")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("fixtures"), help="output folder (default: fixtures)")
    ap.add_argument("--only", nargs="+", choices=sorted(FIXTURES), help="build only these fixtures")
    args = ap.parse_args()
    names = args.only or list(FIXTURES)
    args.out.mkdir(parents=True, exist_ok=True)
    from make_mtp_fixtures import MTP_FIXTURES, add_mtp_head  # (imports this module)

    for name in names:
        make_fixture(name, FIXTURES[name], args.out)
        if name in MTP_FIXTURES:
            add_mtp_head(name, args.out)
    print_layout(args.out, names)


if __name__ == "__main__":
    main()
