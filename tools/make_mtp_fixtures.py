#!/usr/bin/env python3
"""Give transformers fixtures a multi-token-prediction (MTP) head and record
its reference outputs (tools/mtp_reference.py: vLLM's math, transformers'
decoder layers).

Usage (after tools/make_fixtures.py, which calls it for these fixtures):

    python tools/make_mtp_fixtures.py --out fixtures
    python tools/make_mtp_fixtures.py --out fixtures --only deepseek_v3

The fixture's main model is left as it is (its logits, computed before and
after, must agree bit for bit).  For each fixture:

  * hf/model.safetensors gains the head's tensors under the names the
    family's checkpoints use (qwen3_5_moe: mtp.*; deepseek_v3: decoder layer
    num_hidden_layers with eh_proj, enorm, hnorm, shared_head and copies of
    the embeddings and LM head), routed experts one per expert;
    hf/config.json names the layer (mtp_num_hidden_layers /
    num_nextn_predict_layers = 1).
  * mtp.safetensors:
        mtp_logits_long [T-1, V]   float32, row i: the head at position i of
                                   tokens_long (hidden state of i, token i+1)
        mtp_chain_P_logits [4, V]  float32, the drafting chain after the first
                                   P tokens of tokens_long and next token
                                   tokens_long[P], for P in CHAIN_STARTS
        mtp_chain_P_tokens [4]     int32, its greedy tokens
  * reference.json gains an "mtp" section (seed, robustness, checks).

Weights: drawn like the main model's (matrices uniform with unit gain, the
router at std 2/sqrt(H), norms around their identity), the attention and MoE
outputs scaled to BRANCH_RMS_RATIO of the stream entering them, rounded to
bf16 before the reference runs.  Seeds are tried until every routing decision
of the head clears ROUTER_GAP_MIN and every chained greedy step clears
GEN_MARGIN_MIN, as for the main fixtures.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import make_fixtures as mf  # noqa: E402  (sets up torch and transformers)
import torch
from mtp_reference import MtpHead, last_hidden_state
from safetensors import safe_open
from safetensors.torch import save_file

MTP_FIXTURES = {
    "qwen3_5_moe": dict(cls=mf.Qwen3_5MoeForCausalLM, seed=4400, key="mtp_num_hidden_layers"),
    "deepseek_v3": dict(cls=mf.DeepseekV3ForCausalLM, seed=7400, key="num_nextn_predict_layers"),
}
CHAIN_STARTS = (7, 40)
CHAIN_STEPS = 4


@torch.no_grad()
def randomize_head(head: MtpHead, seed: int) -> None:
    """Fresh values away from the initialisation, as make_fixtures draws the
    main model's (see its randomize_parameters)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = head.fc.out_features

    def matrix(shape, std):
        return (torch.rand(shape, generator=gen) * 2 - 1) * (3**0.5) * std

    for name, p in head.named_parameters():
        if "norm" in name:
            new = p + torch.randn(p.shape, generator=gen) * 0.15
        elif name.endswith("mlp.gate.weight"):
            new = matrix(p.shape, 2.0 / hidden**0.5)
        elif p.dim() in (2, 3):  # [out, in] or fused experts [E, out, in]
            new = matrix(p.shape, p.shape[-1] ** -0.5)
        else:
            raise ValueError(f"no randomisation rule for {name} {tuple(p.shape)}")
        p.copy_(new)
    for name, buf in head.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_((torch.rand(buf.shape, generator=gen) * 2 - 1) * mf.CORRECTION_BIAS)


@torch.no_grad()
def calibrate_head(head: MtpHead, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
    """Scale the layer's attention and MoE outputs to BRANCH_RMS_RATIO of the
    stream entering them, in order, on the teacher-forced rows."""
    layer = head.layer
    mlp = layer.mlp
    moe_out = [mlp.experts.down_proj] + [
        getattr(mlp, s).down_proj.weight for s in ("shared_expert", "shared_experts") if hasattr(mlp, s)
    ]
    branches = [
        (layer.input_layernorm, layer.self_attn, [layer.self_attn.o_proj.weight]),
        (layer.post_attention_layernorm, mlp, moe_out),
    ]
    for norm, module, params in branches:
        seen = {}
        hooks = [
            norm.register_forward_pre_hook(lambda _m, a: seen.__setitem__("in", mf._rms(a[0]))),
            module.register_forward_hook(lambda _m, _a, o: seen.__setitem__("out", mf._rms(mf._first(o)))),
        ]
        try:
            head(hidden[:-1], tokens[1:])
        finally:
            for h in hooks:
                h.remove()
        for p in params:
            p.mul_(mf.BRANCH_RMS_RATIO / (seen["out"] / seen["in"]))


def build(spec: dict, seed: int, ref, tokens: torch.Tensor, hidden: torch.Tensor) -> dict:
    """One candidate head and its references, with the problems that make it
    unsuitable (none: keep it)."""
    torch.manual_seed(seed)
    head = MtpHead(ref).eval()
    randomize_head(head, seed)
    calibrate_head(head, hidden, tokens)
    with torch.no_grad():
        for t in list(head.parameters()) + list(head.buffers()):
            t.copy_(t.to(torch.bfloat16).float())
    router = mf.RouterLog()
    hook = head.layer.mlp.gate.register_forward_hook(router.hook(ref.config.num_experts_per_tok))
    try:
        with torch.no_grad():
            logits_long, _ = head(hidden[:-1], tokens[1:])
            chains = {}
            for p in CHAIN_STARTS:
                rows = head.draft(hidden[:p], tokens[:p], int(tokens[p]), CHAIN_STEPS)
                chains[p] = (rows, rows.argmax(-1))
    finally:
        hook.remove()
    margins = [float(r.topk(2).values[0] - r.topk(2).values[1]) for rows, _ in chains.values() for r in rows[:-1]]
    problems = []
    if min(router.gaps) < mf.ROUTER_GAP_MIN:
        problems.append(f"router top-k gap {min(router.gaps):.2e} < {mf.ROUTER_GAP_MIN}")
    if min(margins) < mf.GEN_MARGIN_MIN:
        problems.append(f"chained greedy margin {min(margins):.2e} < {mf.GEN_MARGIN_MIN}")
    return {
        "head": head,
        "seed": seed,
        "logits_long": logits_long.contiguous(),
        "chains": chains,
        "router_min_gap": min(router.gaps),
        "chain_min_margin": min(margins),
        "problems": problems,
    }


def without_mtp(path: Path, num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors less an earlier MTP head's."""
    out = {}
    mtp_layer = f"model.layers.{num_hidden_layers}."
    with safe_open(path, "pt") as sf:
        for k in sf.keys():
            if not (k.startswith("mtp.") or k.startswith(mtp_layer)):
                out[k] = sf.get_tensor(k)
    return out


def add_mtp_head(name: str, out_root: Path) -> dict:
    spec = MTP_FIXTURES[name]
    fdir = out_root / name
    hf = fdir / "hf"
    ref = mf.load_reference_model(spec["cls"], hf)
    n = ref.config.num_hidden_layers
    with safe_open(fdir / "reference.safetensors", "pt") as sf:
        tokens = sf.get_tensor("tokens_long").long()
        logits_long = sf.get_tensor("logits_long")
    hidden = last_hidden_state(ref, tokens)
    before = mf.forward_logits(ref, tokens)
    with torch.no_grad():
        head_of_hidden = (ref.lm_head(hidden) - logits_long).abs().max()
    assert float(head_of_hidden) < 1e-4, f"lm_head(last_hidden_state) differs from logits_long by {head_of_hidden}"

    rejected = []
    for attempt in range(mf.MAX_ATTEMPTS):
        cand = build(spec, spec["seed"] + attempt, ref, tokens, hidden)
        if not cand["problems"]:
            break
        rejected.append({"seed": cand["seed"], "problems": cand["problems"]})
    else:
        raise RuntimeError(f"{name}: no robust MTP seed in {mf.MAX_ATTEMPTS} attempts")

    # The checkpoint and config.json gain the head.
    weights = hf / "model.safetensors"
    tensors = without_mtp(weights, n)
    head_tensors = cand["head"].checkpoint_tensors(n)
    tensors.update(head_tensors)
    # Written beside and renamed: the reference model maps the old file.
    staged = weights.with_suffix(".partial")
    save_file(tensors, staged, metadata={"format": "pt"})
    os.replace(staged, weights)
    config = json.loads((hf / "config.json").read_text())
    config[spec["key"]] = 1
    (hf / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    references = {"mtp_logits_long": cand["logits_long"]}
    for p, (rows, guesses) in cand["chains"].items():
        references[f"mtp_chain_{p}_logits"] = rows.contiguous()
        references[f"mtp_chain_{p}_tokens"] = guesses.to(torch.int32)
    save_file(references, fdir / "mtp.safetensors")

    # The main model is unchanged, the head's weights are what ran.
    reloaded = mf.load_reference_model(spec["cls"], hf)
    main_diff = float((mf.forward_logits(reloaded, tokens) - before).abs().max())
    if main_diff != 0.0:
        raise AssertionError(f"{name}: the main model's logits moved by {main_diff} with the head added")
    with safe_open(weights, "pt") as sf:
        for k, t in head_tensors.items():
            if not torch.equal(sf.get_tensor(k), t):
                raise AssertionError(f"{name}: {k} differs after the write")

    info = {
        "reference": "tools/mtp_reference.py (vLLM's qwen3_next_mtp.py / deepseek_mtp.py math, "
        "transformers' decoder layer classes); hidden states: the float32 reference model's "
        "last_hidden_state (after the final norm) over tokens_long; weights rounded to bf16",
        "seed": cand["seed"],
        "rejected_seeds": rejected,
        "config_key": spec["key"],
        "checkpoint_tensors": sorted(head_tensors),
        "chain_starts": list(CHAIN_STARTS),
        "chain_steps": CHAIN_STEPS,
        "chain_tokens": {str(p): g.tolist() for p, (_, g) in cand["chains"].items()},
        "router_min_topk_logit_gap": cand["router_min_gap"],
        "chain_min_top1_top2_margin": cand["chain_min_margin"],
        "main_logits_unchanged_max_abs_diff": main_diff,
        "lm_head_of_last_hidden_state_vs_logits_long_max_abs_diff": float(head_of_hidden),
        "depth1_top1_agreement_with_tokens_long_t_plus_2": float(
            (cand["logits_long"][:-1].argmax(-1) == tokens[2:]).float().mean()
        ),
    }
    reference_json = fdir / "reference.json"
    summary = json.loads(reference_json.read_text())
    summary["mtp"] = info
    reference_json.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"== {name}: MTP head seed {cand['seed']} ({len(rejected)} rejected); router gap "
          f"{cand['router_min_gap']:.2e}, chain margin {cand['chain_min_margin']:.3f}, chains {info['chain_tokens']}")
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("fixtures"), help="fixtures folder (default: fixtures)")
    ap.add_argument("--only", nargs="+", choices=sorted(MTP_FIXTURES), help="only these fixtures")
    args = ap.parse_args()
    for name in args.only or list(MTP_FIXTURES):
        add_mtp_head(name, args.out)


if __name__ == "__main__":
    main()
