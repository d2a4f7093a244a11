"""A plain PyTorch multi-token-prediction (MTP) head, following vLLM's math
(vllm/model_executor/models/qwen3_next_mtp.py and deepseek_mtp.py), with
transformers' own decoder-layer classes for its inner layer.

transformers runs no MTP head for Qwen3-Next / Qwen3.5, and its generic
`MtpModel` for DeepSeek-V3 / GLM-4.5 differs from vLLM (it does not zero
the embedding at position 0 and chains the normed output); this module is
the reference moeflux's head is tested against (tools/make_fixtures.py) and
the head tools/train_bundled_model.py trains.

Position i takes the main model's hidden state at i (its last_hidden_state,
after the final norm, as vLLM and transformers feed it) and the embedding of
the token at i + 1:

    x = fc(cat(norm_e(embed(t[i+1])), norm_h(h[i])))
    x = decoder_layer(x)            full attention, the family's MoE
    logits(t[i+2]) = lm_head(norm(x))

Qwen (`mtp.*` tensors): fc, pre_fc_norm_embedding, pre_fc_norm_hidden,
layers.0, norm; a drafting chain continues from norm(x).  DeepSeek-V3 /
GLM-4.5 (decoder layer num_hidden_layers): eh_proj, enorm, hnorm, the
layer, shared_head.norm, shared_head.head (a copy of lm_head) and
embed_tokens (a copy of the embeddings); the embedding at position 0 is
zeroed; a chain continues from x before the norm.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def causal_mask(n: int) -> torch.Tensor:
    """An additive [1, 1, n, n] mask: position i sees positions 0..i."""
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


class MtpHead(nn.Module):
    """The MTP head of `model` (a transformers CausalLM of qwen3_next,
    qwen3_5_moe, deepseek_v3 or glm4_moe), with fresh weights."""

    def __init__(self, model: nn.Module):
        super().__init__()
        cfg = copy.deepcopy(model.config)
        self.family = "qwen" if cfg.model_type.startswith("qwen") else "deepseek"
        base = model.model
        layer_cls = type(base.layers[-1])
        norm_cls = type(base.norm)
        h = cfg.hidden_size
        if self.family == "qwen":
            # vLLM builds it as a full-attention layer numbered 0.
            cfg.layer_types = ["full_attention"]
            index = 0
        else:
            index = cfg.num_hidden_layers
        self.layer = layer_cls(cfg, index)
        self.eager = cfg._attn_implementation == "eager"
        self.embed_norm = norm_cls(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = norm_cls(h, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.norm = norm_cls(h, eps=cfg.rms_norm_eps)
        # Shared with the main model (DeepSeek's checkpoints store copies).
        self.main = [model]

    @property
    def embed_tokens(self) -> nn.Module:
        return self.main[0].get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.main[0].lm_head

    def rotary(self, x: torch.Tensor, positions: torch.Tensor):
        base = self.main[0].model
        ids = positions[None]
        if self.family == "qwen" and getattr(base.config, "rope_parameters", {}).get("mrope_section"):
            ids = positions.view(1, 1, -1).expand(3, 1, -1)  # text: the three streams agree
        return base.rotary_emb(x, ids)

    def layer_input(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor):
        """fc over [norm_e(embedding); norm_h(hidden)] for rows [..., T, h]
        at `positions` [T]."""
        e = self.embed_tokens(next_tokens.long())
        if self.family == "deepseek":
            e = e * (positions != 0)[:, None].to(e.dtype)
        return self.fc(torch.cat([self.embed_norm(e), self.hidden_norm(hidden)], dim=-1))

    def run_layer(self, x: torch.Tensor, positions: torch.Tensor):
        """The decoder layer over rows [..., T, h] attending causally;
        returns (logits [..., T, V], chained hidden [..., T, h])."""
        single = x.dim() == 2
        if single:
            x = x[None]
        out = self.layer(
            x,
            position_embeddings=self.rotary(x, positions),
            # sdpa is causal without a mask, eager needs one.
            attention_mask=causal_mask(x.shape[1]).to(x.device) if self.eager else None,
            position_ids=positions[None],
        )
        out = out[0] if isinstance(out, tuple) else out
        if single:
            out = out[0]
        normed = self.norm(out)
        logits = self.lm_head(normed)
        return logits, (normed if self.family == "qwen" else out)

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor):
        """Teacher-forced: row i from the hidden state of position i and the
        token at i + 1 (rows [..., T, h], tokens [..., T]); logits
        [..., T, V] of the token at i + 2."""
        positions = torch.arange(hidden.shape[-2], device=hidden.device)
        return self.run_layer(self.layer_input(hidden, next_tokens, positions), positions)

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, next_token: int, k: int):
        """The drafting chain after a prompt `tokens` [P] (whose hidden states
        are `hidden` [P, h]) and the chosen `next_token`: k logit rows, each
        step taking the previous one's chained output and greedy token one
        position further.  Runs the layer over every row each step (causal,
        so equal to a cached run)."""
        p = tokens.shape[0]
        after = torch.cat([tokens[1:], torch.tensor([next_token])])
        positions = torch.arange(p)
        inputs = self.layer_input(hidden, after, positions)
        rows = []
        for step in range(k):
            logits, chained = self.run_layer(inputs, torch.arange(inputs.shape[0]))
            rows.append(logits[-1])
            guess = logits[-1].argmax()
            pos = torch.tensor([p + step])
            inputs = torch.cat([inputs, self.layer_input(chained[-1:], guess[None], pos)])
        return torch.stack(rows)

    def checkpoint_tensors(self, num_hidden_layers: int) -> dict[str, torch.Tensor]:
        """The head's weights under the checkpoint names its family ships,
        routed experts one per expert (as the Hub stores them)."""
        layer = {}
        for name, t in self.layer.state_dict().items():
            if name.endswith("mlp.experts.gate_up_proj"):
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    layer[f"mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                    layer[f"mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
            elif name.endswith("mlp.experts.down_proj"):
                for e in range(t.shape[0]):
                    layer[f"mlp.experts.{e}.down_proj.weight"] = t[e]
            else:
                layer[name] = t
        if self.family == "qwen":
            out = {f"mtp.layers.0.{n}": t for n, t in layer.items()}
            out.update({
                "mtp.fc.weight": self.fc.weight,
                "mtp.pre_fc_norm_embedding.weight": self.embed_norm.weight,
                "mtp.pre_fc_norm_hidden.weight": self.hidden_norm.weight,
                "mtp.norm.weight": self.norm.weight,
            })
        else:
            p = f"model.layers.{num_hidden_layers}."
            out = {p + n: t for n, t in layer.items()}
            out.update({
                p + "eh_proj.weight": self.fc.weight,
                p + "enorm.weight": self.embed_norm.weight,
                p + "hnorm.weight": self.hidden_norm.weight,
                p + "shared_head.norm.weight": self.norm.weight,
                p + "shared_head.head.weight": self.lm_head.weight,
                p + "embed_tokens.weight": self.embed_tokens.weight,
            })
        return {n: t.detach().to(torch.bfloat16).contiguous().clone() for n, t in out.items()}


def last_hidden_state(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The main model's hidden states [T, h] after its final norm (no cache)."""
    with torch.no_grad():
        return model.model(input_ids=tokens[None].long(), use_cache=False).last_hidden_state[0]
