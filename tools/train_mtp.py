"""The `--mtp` mode of tools/train_bundled_model.py: trains a
multi-token-prediction head for the bundled checkpoint and writes it in.

The model in --out is loaded and frozen; only the head learns (one
full-attention MoE decoder layer, fc and three norms; tools/mtp_reference.py,
vLLM's math), sharing the frozen embeddings and LM head: from the model's
last hidden state at position t and the embedding of token t+1 it predicts
token t+2, on the same training text (prose and chats) as the model.  The
checkpoint kept is the one with the lowest validation loss.  Written into
--out: the head's `mtp.*` tensors added to model.safetensors (the model's own
tensors byte for byte as they were), `mtp_num_hidden_layers: 1` in
config.json, an `mtp` section in reference.json (training record and the
acceptance measured on held-out text) and the model card regenerated.

Acceptance, measured on heldout.txt in windows of --ctx tokens (teacher
forced, float32, bf16 weights as stored): the share of positions where the
head's top token for t+2 equals the model's own greedy choice at t+1, i.e.
how often greedy decoding keeps the head's first draft.  The agreement of a
second chained draft is measured the same way on the head's own output.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from mtp_reference import MtpHead
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

import train_bundled_model as tb


def hidden_states(model, x: torch.Tensor) -> torch.Tensor:
    """The frozen model's last hidden state (after its final norm)."""
    with torch.no_grad():
        return model.model(input_ids=x, use_cache=False).last_hidden_state


def head_loss(head: MtpHead, model, x: torch.Tensor, aux_coef: float, router_logits: list) -> torch.Tensor:
    """Cross-entropy of the head's prediction of token t+2 over windows x
    [B, T], plus the router's load-balancing loss."""
    h = hidden_states(model, x)
    router_logits.clear()
    logits, _ = head(h[:, :-2], x[:, 1:-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 2:].flatten())
    cfg = model.config
    aux = load_balancing_loss_func(tuple(router_logits), cfg.num_experts, cfg.num_experts_per_tok)
    return loss + aux_coef * aux


@torch.no_grad()
def acceptance(head: MtpHead, model, ids: list[int], ctx: int, device: torch.device) -> dict:
    """How often the head's drafts agree with the model's greedy choices on
    held-out text (see the module's documentation)."""
    head.eval()
    n = len(ids) // ctx
    windows = torch.tensor(ids[: n * ctx], device=device).view(n, ctx)
    first = second = 0
    nll = 0.0
    for x in windows.split(16):
        out = model.model(input_ids=x, use_cache=False)
        h = out.last_hidden_state
        greedy = model.lm_head(h).argmax(-1)  # the model's choice of t+1 at t
        logits, chained = head(h[:, :-1], x[:, 1:])  # rows t: guesses of t+2
        guess = logits.argmax(-1)
        nll += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 2:].flatten(), reduction="sum"))
        # Greedy decoding after t+1 picks greedy[t+1]: the first draft kept.
        first += int((guess == greedy[:, 1:]).sum())
        # A second draft chains on the head's output at t and its guess,
        # one position further (rows t+1 see the true rows before them).
        positions = torch.arange(ctx - 1, device=device)
        chained_in = head.layer_input(chained[:, :-1], guess[:, :-1], positions[1:])
        true_in = head.layer_input(h[:, :-1], x[:, 1:], positions)
        rows = []
        for t in range(ctx - 3):
            inputs = torch.cat([true_in[:, : t + 1], chained_in[:, t : t + 1]], dim=1)
            step, _ = head.run_layer(inputs, positions[: t + 2])
            rows.append(step[:, -1].argmax(-1))
        second_guess = torch.stack(rows, dim=1)  # guesses of t+3 at rows t
        both = (guess[:, : ctx - 3] == greedy[:, 1 : ctx - 2]) & (second_guess == greedy[:, 2 : ctx - 1])
        second += int(both.sum())
    head.train()
    return dict(
        windows=n,
        ctx=ctx,
        first_draft_kept=round(first / (n * (ctx - 1)), 4),
        first_two_drafts_kept=round(second / (n * (ctx - 3)), 4),
        heldout_t_plus_2_nll=round(nll / (n * (ctx - 2)), 4),
    )


def train_mtp_head(args) -> None:
    t_start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = device.type == "cuda"
    out = args.out
    ref_path = out / "reference.json"
    if not (out / "model.safetensors").is_file() or not ref_path.is_file():
        tb.fail(f"{out}: no trained model (model.safetensors, reference.json); train it first without --mtp")
    ref = json.loads(ref_path.read_text(encoding="utf-8"))
    tb.log(f"device {device}; training a multi-token-prediction head for {out}")

    # --- the frozen model and the same text it was trained on -------------------
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    books = tb.load_corpus(args.corpus, args.smoke)
    train_books, val_text, test_text = tb.split_corpus(books, 0.015)
    if test_text != (out / "heldout.txt").read_text(encoding="utf-8"):
        tb.fail(f"{args.corpus}: the held-out text differs from {out}/heldout.txt: not the corpus the model saw")
    batches, val, counts = tb.training_data(args, tok, train_books, val_text, device)
    tb.log(f"corpus: {counts['plain']:,} training tokens, {counts['chat']:,} chat tokens, {counts['val']:,} validation")
    encode = tok.backend_tokenizer.encode

    # --- the head ---------------------------------------------------------------
    head = MtpHead(model).to(device)
    head.apply(model._init_weights)
    head.train()
    params = sum(p.numel() for p in head.parameters())
    tb.log(f"head: {params:,} parameters (its embeddings and LM head are the model's)")
    router_logits: list = []
    hook = head.layer.mlp.gate.register_forward_hook(lambda _m, _i, o: router_logits.append(o[0]))
    aux_coef = model.config.router_aux_loss_coef
    decay = [p for p in head.parameters() if p.ndim >= 2]
    no_decay = [p for p in head.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )

    def val_loss() -> float:
        head.eval()
        total = 0.0
        with torch.no_grad():
            for x in val.split(args.batch_size):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    total += float(head_loss(head, model, x, 0.0, router_logits)) * len(x)
        head.train()
        return total / len(val)

    start = time.time()
    progress = lambda step: step / args.steps if args.steps else (time.time() - start) / args.train_seconds  # noqa: E731
    best = {"val_loss": float("inf"), "step": 0, "state": None}
    history, step, tokens, next_eval = [], 0, 0, args.eval_every
    while progress(step) < 1.0:
        for group in opt.param_groups:
            group["lr"] = tb.lr_schedule(args.lr, progress(step))
        x = batches.next()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = head_loss(head, model, x, aux_coef, router_logits)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        if progress(step) >= next_eval or progress(step) >= 1.0:
            next_eval += args.eval_every
            v = val_loss()
            elapsed = time.time() - start
            history.append(dict(step=step, seconds=round(elapsed, 1), train_loss=round(float(loss.detach()), 4), val_loss=round(v, 4)))
            tb.log(f"step {step:6d}  {elapsed:6.1f}s  {tokens / elapsed:,.0f} tok/s  train {float(loss.detach()):.4f}  val {v:.4f}")
            if v < best["val_loss"]:
                best = {"val_loss": v, "step": step, "state": {k: t.detach().clone() for k, t in head.state_dict().items()}}
    elapsed = time.time() - start
    hook.remove()
    head.load_state_dict(best["state"])

    # --- written into the checkpoint ---------------------------------------------
    weights = out / "model.safetensors"
    with safe_open(weights, "pt") as sf:
        tensors = {k: sf.get_tensor(k) for k in sf.keys() if not k.startswith("mtp.")}
        metadata = sf.metadata()
    head_tensors = head.cpu().checkpoint_tensors(model.config.num_hidden_layers)
    head.to(device)
    staged = weights.with_suffix(".partial")
    save_file({**tensors, **head_tensors}, staged, metadata=metadata)
    os.replace(staged, weights)
    config = json.loads((out / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # --- measured from the files just written -------------------------------------
    stored = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        for name, t in head.named_parameters():
            t.copy_(t.to(torch.bfloat16).float())  # as stored
    head.main = [stored]
    heldout = encode((out / "heldout.txt").read_text(encoding="utf-8"), add_special_tokens=False).ids
    measured = acceptance(head, stored, heldout, args.ctx, device)
    tb.log(f"held-out acceptance: {measured}")
    ref["model"]["config"] = json.loads((out / "config.json").read_text())
    ref["mtp"] = dict(
        params=params,
        tensors=sorted(head_tensors),
        training=dict(
            device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            seed=args.seed,
            lr=args.lr,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            steps=step,
            seconds=round(elapsed, 1),
            tokens=tokens,
            best_step=best["step"],
            best_val_loss=round(best["val_loss"], 4),
            history=history,
        ),
        acceptance=measured,
        smoke=args.smoke,
    )
    ref_path.write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "README.md").write_text(tb.model_card(ref, out), encoding="utf-8")
    size = sum(f.stat().st_size for f in out.iterdir())
    if size > tb.SIZE_LIMIT:
        tb.fail(f"{out}: {size:,} bytes, over the {tb.SIZE_LIMIT:,}-byte budget")
    tb.log(f"done in {time.time() - t_start:.0f}s: {out} ({size:,} bytes)")
