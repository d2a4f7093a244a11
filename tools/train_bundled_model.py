#!/usr/bin/env python3
"""Train moeflux's bundled default model: a tiny Qwen3.5-MoE that writes English.

The model is a `Qwen3_5MoeForCausalLM` (model_type qwen3_5_moe_text: Gated
DeltaNet and gated full attention 3:1, routed top-2 experts plus a shared
expert) of about 8 M parameters, trained from scratch on Jane Austen's novels
with its own byte-level BPE tokenizer and a Qwen3-style chat template.  The
script also records what the Rust engine is checked against: perplexity on
held-out text (float32 weights and bf16 weights), tokenizer and chat-template
fixtures, and generated samples.

Prepare the corpus first (Debian package, see the script):

    python3 tools/fetch_corpus.py                 # -> corpus/

Full run, on one H100 or H200 (PyTorch 2.11, transformers 5.17, tokenizers;
no network needed), about 3.5 minutes in all, 3 of them training:

    python3 tools/train_bundled_model.py --out bundled/qwen35-tiny

Why 3 minutes and not more: transformers' pure-PyTorch Gated DeltaNet trains
this model at about 135k tokens/s on an H100 (190k on an H200), so 3 minutes
are about 16 passes over the 1.5 M training tokens.  Measured on an H200
(held-out perplexity at ctx 256): 300 s with dropout 0.2 peaks after 60 s and
then overfits (best checkpoint ppl 62); 100-120 s (19-24 M tokens) with
dropout 0.35-0.4 and the schedule run to its end reaches ppl 55, while more
dropout (0.5) or a higher lr does worse.  On an H100, 120 s (16 M tokens)
gave ppl 58.5.  More training needs more text, not more time.

Smoke test on a CPU (tiny model, a few steps, a slice of the corpus; checks
that every output is produced, in a minute or two):

    python3 tools/train_bundled_model.py --smoke --out /tmp/qwen35-smoke

A multi-token-prediction head for a trained model (`--mtp`, tools/train_mtp.py):
the model is frozen and only the head trains, then is written into the same
checkpoint with the acceptance it measures in the model card; about 2.5
minutes on an H100, 2 of them training:

    python3 tools/train_bundled_model.py --mtp --out bundled/qwen35-tiny
    python3 tools/train_bundled_model.py --smoke --mtp --out /tmp/qwen35-smoke   # CPU smoke test

Outputs, all in --out (at most 20 MB together, checked):

    config.json, model.safetensors (bf16), generation_config.json
    tokenizer.json, tokenizer_config.json (with the chat template)
    heldout.txt       the held-out text perplexity is measured on
    reference.json    perplexity (its exact definition included), tokenizer
                      and chat-template fixtures, samples, training record
    README.md         the model card

Training data: each novel minus its last 3% of paragraphs (the final 1.5% is
held out for the perplexity test, the 1.5% before it is the validation set
that picks the checkpoint).  About one training sequence in eight is a chat:
a passage as the user turn and the passage that follows it as the assistant
turn, rendered with the chat template, so `moeflux chat` gets answers in the
same English.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import random
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import NoReturn

# The GPU machine has no network: never try the Hub (kernels, configs).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import tokenizers  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
)

SIZE_LIMIT = 20_000_000  # bytes, everything in --out

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"

# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs with one
# leading non-letter, single digits, punctuation runs, newlines, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3-style: system prompt first, reasoning kept only for turns after the
# last user message, and `enable_thinking=false` pre-fills an empty think block.
CHAT_TEMPLATE = r"""{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is not string %}
        {{- raise_exception('message ' ~ loop.index0 ~ ': content must be a string') }}
    {%- endif %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('the system message must be the first message') }}
        {%- endif %}
        {{- '<|im_start|>system\n' + message.content.strip() + '<|im_end|>\n' }}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_user and reasoning %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
            {{- content + '<|im_end|>\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unsupported role "' ~ message.role ~ '": use system, user or assistant') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

SYSTEM_PROMPTS = [
    "You are a novelist who writes in the manner of Jane Austen.",
    "You are a helpful assistant.",
    "Continue the story in the same style.",
]

# Strings whose token ids the Rust tokenizer must reproduce exactly.
ENCODE_FIXTURES = [
    "",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife.",
    "Hello, world! How are you today?",
    "  two leading spaces, trailing space \n",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "Numbers: 1234567, 3.14159, 1,000,000 and 2026-11-21.",
    "Mrs. Bennet's daughters weren't there; they'd gone.",
    "naïve café résumé — déjà vu, Größe, Ångström",
    "日本語のテキストと中文测试",
    "emoji: 🎉 👍🏽 👨‍👩‍👧 and ❤️",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello.<|im_end|>",
    "an <|endoftext|> in the middle",
    "   \t  ",
]

CHAT_FIXTURES = [
    dict(messages=[{"role": "user", "content": "Who is Mr. Darcy?"}], add_generation_prompt=True, kwargs={}),
    dict(
        messages=[
            {"role": "system", "content": "  You are a helpful assistant.\n"},
            {"role": "user", "content": "Tell me about Emma."},
        ],
        add_generation_prompt=True,
        kwargs={"enable_thinking": False},
    ),
    dict(
        messages=[
            {"role": "system", "content": "You are a novelist."},
            {"role": "user", "content": "Begin a story."},
            {"role": "assistant", "content": "<think>\nA quiet opening.\n</think>\n\nIt was a fine morning."},
            {"role": "user", "content": "Go on — and mention the café."},
        ],
        add_generation_prompt=True,
        kwargs={"enable_thinking": True},
    ),
    dict(
        messages=[
            {"role": "user", "content": "What do you think of Bath?"},
            {"role": "assistant", "content": "<think>\nShe likes it.\n\n</think>\n\n\nI find it charming. 🎉"},
        ],
        add_generation_prompt=False,
        kwargs={},
    ),
    dict(
        messages=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Good day."}],
        add_generation_prompt=False,
        kwargs={"enable_thinking": False},
    ),
    dict(messages=[{"role": "narrator", "content": "Once upon a time"}], add_generation_prompt=True, kwargs={}),
    dict(
        messages=[{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late system prompt"}],
        add_generation_prompt=True,
        kwargs={},
    ),
]

PLAIN_PROMPTS = [
    "It is a truth universally acknowledged, that",
    "Emma Woodhouse, handsome, clever, and rich,",
    "The weather was",
]
CHAT_PROMPTS = [
    "What should a young lady do when she is invited to a ball?",
    "Tell me about Mr. Knightley.",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fail(msg: str) -> NoReturn:
    print(f"train_bundled_model: error: {msg}", file=sys.stderr)
    sys.exit(1)


# =============================================================================
# Corpus
# =============================================================================


def load_corpus(corpus_dir: Path, smoke: bool) -> dict[str, list[str]]:
    """Paragraphs of every `*.txt` novel in the prepared corpus folder."""
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        fail(f"{corpus_dir}: no *.txt files; prepare the corpus with `python3 tools/fetch_corpus.py` first")
    books = {}
    for f in files:
        paragraphs = [p.strip() for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]
        if smoke:
            paragraphs = paragraphs[:300]
        if len(paragraphs) < 100:
            fail(f"{f}: only {len(paragraphs)} paragraphs; is the corpus complete?")
        books[f.stem] = paragraphs
    return books


def split_corpus(books: dict[str, list[str]], frac: float) -> tuple[dict, str, str]:
    """Per novel: the last `frac` of paragraphs is test, the `frac` before it validation."""
    train, val, test = {}, [], []
    for name, paras in books.items():
        n = max(2, round(len(paras) * frac))
        train[name] = paras[: -2 * n]
        val.extend(paras[-2 * n : -n])
        test.extend(paras[-n:])
    return train, "\n\n".join(val) + "\n", "\n\n".join(test) + "\n"


def chat_examples(train: dict[str, list[str]], rng: random.Random, tokenizer, count: int) -> list[str]:
    """Conversations where the assistant answers a passage with the passage after it."""
    pairs = []
    for paras in train.values():
        for a, b in zip(paras, paras[1:], strict=False):
            if 20 <= len(a) <= 600 and 40 <= len(b) <= 900:
                pairs.append((a, b))
    rng.shuffle(pairs)
    out = []
    for i in range(min(count, len(pairs) // 2)):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        turns = [pairs[2 * i]] if rng.random() < 0.7 else [pairs[2 * i], pairs[2 * i + 1]]
        for user, assistant in turns[:-1]:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        user, assistant = turns[-1]
        messages.append({"role": "user", "content": user})
        if rng.random() < 0.5:
            prompt = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            out.append(prompt + assistant + IM_END + "\n")
        else:
            messages.append({"role": "assistant", "content": assistant})
            out.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return out


# =============================================================================
# Tokenizer
# =============================================================================


def train_tokenizer(texts: list[str], vocab_size: int, max_len: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None
    added = [THINK, END_THINK]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        min_frequency=2,
        special_tokens=[EOT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if tok.get_vocab_size() != vocab_size:
        fail(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size} (corpus too small for the vocabulary?)")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )


# =============================================================================
# Model
# =============================================================================


def model_config(args, vocab_size: int, tok) -> Qwen3_5MoeTextConfig:
    layers = args.layers
    rotary = args.head_dim // 4  # partial_rotary_factor 0.25
    freqs = rotary // 2
    mrope = [freqs - 2 * (freqs // 4), freqs // 4, freqs // 4]  # Qwen's [11, 11, 10]-style split
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        linear_num_key_heads=args.linear_k_heads,
        linear_num_value_heads=args.linear_v_heads,
        linear_key_head_dim=args.linear_head_dim,
        linear_value_head_dim=args.linear_head_dim,
        linear_conv_kernel_dim=4,
        num_experts=args.experts,
        num_experts_per_tok=2,
        moe_intermediate_size=args.expert_dim,
        shared_expert_intermediate_size=args.shared_dim,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=args.max_positions,
        initializer_range=0.02,
        partial_rotary_factor=0.25,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": mrope,
            "mrope_interleaved": True,
        },
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids(IM_END),
        pad_token_id=tok.convert_tokens_to_ids(EOT),
    )


def add_dropout(model, p: float) -> list:
    """Embedding and residual-branch dropout while training: Qwen3.5 has none, and
    a few MB of text is seen dozens of times in the time budget."""

    def hook(module, inputs, output):
        if isinstance(output, tuple):  # attention returns (output, weights)
            return (F.dropout(output[0], p, module.training),) + tuple(output[1:])
        return F.dropout(output, p, module.training)

    handles = [model.model.embed_tokens.register_forward_hook(hook)]
    for layer in model.model.layers:
        mixer = layer.linear_attn if layer.block_type == "linear_attention" else layer.self_attn
        handles += [mixer.register_forward_hook(hook), layer.mlp.register_forward_hook(hook)]
    return handles


def count_params(model) -> tuple[int, int]:
    """Total parameters, and those one token uses (top-k of the routed experts)."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - routed + routed * cfg.num_experts_per_tok // cfg.num_experts
    return total, active


# =============================================================================
# Training
# =============================================================================


def training_data(args, tok, train_books: dict[str, list[str]], val_text: str, device: torch.device):
    """What training reads: Batches of the prose and the chats built from it,
    the validation windows, and token counts."""
    # The backend tokenizer directly: the wrapper warns about texts longer than the model.
    encode = tok.backend_tokenizer.encode
    eot = tok.convert_tokens_to_ids(EOT)
    plain = []
    for paras in train_books.values():
        plain += encode("\n\n".join(paras) + "\n", add_special_tokens=False).ids + [eot]
    chats = chat_examples(train_books, random.Random(args.seed), tok, count=args.chats)
    chat = []
    for text in chats:
        chat += encode(text, add_special_tokens=False).ids + [eot]
    val_ids = encode(val_text, add_special_tokens=False).ids
    n_val = len(val_ids) // args.seq_len
    if n_val == 0 or len(chat) <= args.seq_len:
        fail("corpus too small for --seq-len")
    val = torch.tensor(val_ids[: n_val * args.seq_len], device=device).view(n_val, args.seq_len)
    batches = Batches(
        torch.tensor(plain, device=device),
        torch.tensor(chat, device=device),
        args.chat_frac,
        args.seq_len,
        args.batch_size,
        args.seed,
    )
    return batches, val, dict(plain=len(plain), chat=len(chat), chats=len(chats), val=len(val_ids))


class Batches:
    """Random windows of a token stream: plain text, or (with `chat_frac`) chats."""

    def __init__(self, plain: torch.Tensor, chat: torch.Tensor, chat_frac: float, seq: int, batch: int, seed: int):
        self.plain, self.chat, self.chat_frac, self.seq, self.batch = plain, chat, chat_frac, seq, batch
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.offsets = torch.arange(seq, device=plain.device)

    def next(self) -> torch.Tensor:
        n_chat = int((torch.rand(self.batch, generator=self.gen) < self.chat_frac).sum())
        rows = []
        for stream, n in ((self.chat, n_chat), (self.plain, self.batch - n_chat)):
            if n:
                starts = torch.randint(0, len(stream) - self.seq, (n,), generator=self.gen).to(stream.device)
                rows.append(stream[starts[:, None] + self.offsets])
        return torch.cat(rows)


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor, batch: int, autocast: bool) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x).loss
        total += float(loss) * len(x)
        count += len(x)
    model.train()
    return total / count


def lr_schedule(lr: float, progress: float) -> float:
    """Linear warm-up over the first 3 % of training, then cosine down to 10 %."""
    if progress < 0.03:
        return lr * max(progress / 0.03, 0.01)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - 0.03) / 0.97)))
    return lr * (0.1 + 0.9 * cos)


def train(model, batches: Batches, val: torch.Tensor, args, device: torch.device) -> dict:
    autocast = device.type == "cuda"
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )

    def progress_now(step: int, start: float) -> float:
        if args.steps:
            return step / args.steps
        return (time.time() - start) / args.train_seconds

    history, best = [], {"val_loss": float("inf"), "step": 0, "state": None}
    model.train()
    start = time.time()
    next_eval = args.eval_every
    step, tokens, loss_acc, loss_n = 0, 0, 0.0, 0
    while True:
        progress = progress_now(step, start)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_schedule(args.lr, progress)
        x = batches.next()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x, output_router_logits=True).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        loss_acc += loss.detach()
        loss_n += 1
        if progress_now(step, start) >= next_eval or progress_now(step, start) >= 1.0:
            next_eval += args.eval_every
            train_loss = float(loss_acc) / loss_n
            loss_acc, loss_n = 0.0, 0
            val_loss = mean_loss(model, val, args.batch_size, autocast)
            elapsed = time.time() - start
            history.append(
                dict(
                    step=step,
                    seconds=round(elapsed, 1),
                    tokens=tokens,
                    train_loss=round(train_loss, 4),
                    val_loss=round(val_loss, 4),
                )
            )
            log(
                f"step {step:6d}  {elapsed:6.1f}s  {tokens / elapsed:,.0f} tok/s  lr {opt.param_groups[0]['lr']:.2e}  "
                f"train {train_loss:.4f}  val {val_loss:.4f}"
            )
            if val_loss < best["val_loss"]:
                best = {
                    "val_loss": val_loss,
                    "step": step,
                    "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                }
    elapsed = time.time() - start
    model.load_state_dict(best["state"])
    return dict(
        steps=step,
        seconds=round(elapsed, 1),
        tokens=tokens,
        tokens_per_second=round(tokens / elapsed),
        best_step=best["step"],
        best_val_loss=round(best["val_loss"], 4),
        history=history,
    )


# =============================================================================
# Evaluation and fixtures
# =============================================================================

PPL_DEFINITION = (
    "ids = tokenizer.encode(heldout.txt as UTF-8, add_special_tokens=false) (no BOS/EOS). "
    "Split ids into n_windows = floor(len(ids) / ctx) non-overlapping windows ids[w*ctx:(w+1)*ctx]; "
    "the remainder is dropped. Each window is evaluated on its own, from an empty state (no cache "
    "carried between windows). In a window, the logits at position i (0 <= i < ctx-1) score token i+1: "
    "nll = -log_softmax(logits[i])[ids[i+1]], natural log, in float32. The first token of each window "
    "is context only (not scored), so each window scores ctx-1 tokens. "
    "ppl = exp(sum of nll over all windows / (n_windows * (ctx-1))). window_nll lists each window's sum."
)


@torch.no_grad()
def perplexity(model, ids: list[int], ctx: int, device: torch.device) -> dict:
    model.eval()
    n = len(ids) // ctx
    windows = torch.tensor(ids[: n * ctx], device=device).view(n, ctx)
    sums = []
    for i in range(0, n, 16):
        x = windows[i : i + 16]
        logits = model(input_ids=x).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        nll = -logp.gather(-1, x[:, 1:, None]).squeeze(-1)
        sums.extend(nll.sum(dim=1).double().tolist())
    mean = sum(sums) / (n * (ctx - 1))
    return {"ppl": round(math.exp(mean), 4), "mean_nll": round(mean, 6), "window_nll": [round(s, 4) for s in sums]}


def ids_sha256(ids: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()


def encode_fixtures(tok) -> list[dict]:
    out = []
    for text in ENCODE_FIXTURES:
        ids = tok.encode(text, add_special_tokens=False)
        out.append(
            dict(
                text=text,
                ids=ids,
                ids_with_special_tokens=tok.encode(text, add_special_tokens=True),
                decoded=tok.decode(ids, skip_special_tokens=False),
                decoded_skip_special=tok.decode(ids, skip_special_tokens=True),
            )
        )
    return out


def chat_fixtures(tok) -> list[dict]:
    out = []
    for case in CHAT_FIXTURES:
        entry = dict(
            messages=case["messages"], add_generation_prompt=case["add_generation_prompt"], kwargs=case["kwargs"]
        )
        try:
            text = tok.apply_chat_template(
                case["messages"], tokenize=False, add_generation_prompt=case["add_generation_prompt"], **case["kwargs"]
            )
            entry.update(text=text, ids=tok.encode(text, add_special_tokens=False))
        except Exception as e:  # the template's raise_exception
            entry["error"] = str(e)
        out.append(entry)
    return out


@torch.no_grad()
def samples(model, tok, gen_cfg: GenerationConfig, device: torch.device, max_new: int, seed: int) -> list[dict]:
    model.eval()
    out = []
    prompts = [(p, False) for p in PLAIN_PROMPTS] + [(p, True) for p in CHAT_PROMPTS]
    for i, (prompt, chat) in enumerate(prompts):
        text = (
            tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            if chat
            else prompt
        )
        ids = tok.encode(text, add_special_tokens=False)
        x = torch.tensor([ids], device=device)
        for kind in ("greedy", "sampled"):
            torch.manual_seed(seed + i)
            if kind == "greedy":
                # Every field set: generate() fills unset ones from the model's sampling defaults.
                cfg = GenerationConfig(
                    do_sample=False,
                    temperature=1.0,
                    top_k=50,
                    top_p=1.0,
                    repetition_penalty=1.0,
                    eos_token_id=gen_cfg.eos_token_id,
                    pad_token_id=gen_cfg.pad_token_id,
                )
            else:
                cfg = copy.deepcopy(gen_cfg)
            cfg.max_new_tokens = max_new
            new = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)[0, len(ids) :].tolist()
            out.append(
                dict(
                    kind=kind,
                    chat=chat,
                    prompt=prompt,
                    prompt_ids=ids,
                    ids=new,
                    text=tok.decode(new, skip_special_tokens=True),
                )
            )
    return out


# =============================================================================
# Model card
# =============================================================================


def model_card(ref: dict, out: Path) -> str:
    m, t, p = ref["model"], ref["training"], ref["perplexity"]
    cfg = m["config"]
    lines = [
        "---",
        "license: other",
        "license_name: mit-or-apache-2.0",
        "language: en",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "---",
        "",
        "# qwen35-tiny",
        "",
        "moeflux's bundled default model: a tiny `Qwen3_5MoeForCausalLM` trained from scratch on Jane "
        "Austen's six novels, so that the engine can be run and tested end to end on a real model with real "
        "text, in seconds, on any machine. It writes recognisably English, Austen-flavoured prose; it knows "
        "nothing and follows no instructions.",
        "",
        "## Architecture",
        "",
        f"- `{m['class']}` (`model_type: {cfg['model_type']}`), {m['params_total']:,} parameters, "
        f"{m['params_active']:,} used per token.",
        f"- {cfg['num_hidden_layers']} layers, hidden size {cfg['hidden_size']}: "
        f"{cfg['layer_types'].count('linear_attention')} Gated DeltaNet layers "
        f"({cfg['linear_num_key_heads']} key / {cfg['linear_num_value_heads']} value heads of "
        f"{cfg['linear_key_head_dim']}) and {cfg['layer_types'].count('full_attention')} gated full-attention layer(s) "
        f"({cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} key-value heads of {cfg['head_dim']}, "
        "partial rotary 0.25), 3:1 like Qwen3.5.",
        f"- Every layer MoE: {cfg['num_experts']} routed experts (intermediate {cfg['moe_intermediate_size']}), "
        f"top-{cfg['num_experts_per_tok']}, plus a shared expert (intermediate "
        f"{cfg['shared_expert_intermediate_size']}). Untied input and output embeddings.",
        f"- Byte-level BPE tokenizer trained on the same text, {cfg['vocab_size']} ids, with `<|endoftext|>`, "
        "`<|im_start|>`, `<|im_end|>` and `<think>`/`</think>`; a Qwen3-style chat template with the "
        "`enable_thinking` switch (in `tokenizer_config.json`).",
        f"- Context: {cfg['max_position_embeddings']} positions (trained on sequences of {t['seq_len']} tokens).",
        "- Weights stored in bfloat16.",
        "",
        "## Training data",
        "",
        "Jane Austen's completed novels (Emma, Mansfield Park, Northanger Abbey, Persuasion, Pride and "
        "Prejudice, Sense and Sensibility): public-domain Project Gutenberg texts, taken from Debian's "
        f"`r-cran-janeaustenr` package ({ref['corpus'].get('version', '?')}; its packaging is MIT licensed) by "
        "`tools/fetch_corpus.py`. Of each novel the last 1.5 % of paragraphs is held out for the perplexity "
        "test (`heldout.txt`) and the 1.5 % before it picks the checkpoint; the model never trained on either. "
        f"Training text: {t['train_tokens']:,} tokens of prose plus {t['chat_tokens']:,} tokens of chats built from "
        "it (a passage as the user turn, the following passage as the answer).",
        "",
        "## Training",
        "",
        f"`tools/train_bundled_model.py`, seed {t['seed']}, on {t['device']}: AdamW (lr {t['lr']}, betas 0.9/0.95, "
        f"weight decay 0.1), dropout {t['dropout']} on embeddings and residual branches, warm-up then cosine, "
        f"batches of {t['batch_size']} × {t['seq_len']} tokens, "
        f"{'bf16 autocast' if t['device'] != 'cpu' else 'float32'}, router load-balancing loss 0.01. "
        f"{t['steps']:,} steps ({t['tokens']:,} tokens, "
        f"{t['seconds']:.0f} s, {t['tokens_per_second']:,} tokens/s); the checkpoint kept is the one with the "
        f"lowest validation loss ({t['best_val_loss']}, step {t['best_step']:,}).",
        "",
        "## Perplexity",
        "",
        f"On `heldout.txt` ({p['n_tokens']:,} tokens), context {p['ctx']}, {p['n_windows']} non-overlapping windows, "
        "first token of each window not scored (exact definition in `reference.json`):",
        "",
        "| weights | perplexity |",
        "| --- | --- |",
        f"| float32 (as trained) | {p['float32']['ppl']} |",
        f"| bfloat16 (this checkpoint) | {p['bfloat16_weights']['ppl']} |",
        "",
        "## Samples",
        "",
        "Greedy, then sampled with `generation_config.json`'s settings, from the bf16 checkpoint:",
        "",
    ]
    for s in ref["samples"]:
        label = "chat" if s["chat"] else "text"
        lines.append(f"- **{label}, {s['kind']}** — _{s['prompt']}_ → {s['text'].strip()!r}")
    if "mtp" in ref:
        lines += mtp_card(ref["mtp"])
    lines += [
        "",
        "## Files",
        "",
        "`reference.json` holds what moeflux's tests compare with: the perplexity above with each window's "
        "loss, token ids of test strings, rendered chat templates, and the samples' token ids. Versions: "
        + ", ".join(f"{k} {v}" for k, v in ref["versions"].items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def mtp_card(mtp: dict) -> list[str]:
    """The model card's section on the multi-token-prediction head."""
    t, a = mtp["training"], mtp["acceptance"]
    return [
        "",
        "## Multi-token prediction",
        "",
        f"A multi-token-prediction head (`mtp.*`, {mtp['params']:,} parameters: one full-attention MoE decoder layer, "
        "`fc` over the normed embedding and hidden state, three norms; the model's embeddings and LM head) "
        "predicts the token after next from the model's last hidden state and the next token, as Qwen3.5's "
        "does; `moeflux generate --draft mtp` drafts with it. Trained by `tools/train_bundled_model.py --mtp` "
        f"on {t['device']} with the model frozen: {t['steps']:,} steps ({t['tokens']:,} tokens, {t['seconds']:.0f} s), "
        f"batches of {t['batch_size']} × {t['seq_len']}, lr {t['lr']}; lowest validation loss {t['best_val_loss']} "
        f"(step {t['best_step']:,}).",
        "",
        f"On `heldout.txt` ({a['windows']} windows of {a['ctx']} tokens, teacher forced, bf16 weights): the head's "
        f"first draft equals the model's greedy choice at {100 * a['first_draft_kept']:.1f} % of positions, its first "
        f"two chained drafts both do at {100 * a['first_two_drafts_kept']:.1f} %; "
        f"loss of the token after next {a['heldout_t_plus_2_nll']}.",
    ]


# =============================================================================
# Main
# =============================================================================


def parse_args() -> argparse.Namespace:
    repo_root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=repo_root / "corpus", help="prepared corpus (tools/fetch_corpus.py)")
    ap.add_argument("--out", type=Path, default=repo_root / "bundled" / "qwen35-tiny", help="output folder")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run: a slice of the corpus, a tiny model, few steps")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--train-seconds", type=float, default=None, help="training time budget (the schedule follows it; 180, --mtp 120)"
    )
    ap.add_argument("--mtp", action="store_true", help="train a multi-token-prediction head for the model in --out")
    ap.add_argument("--steps", type=int, default=0, help="train this many steps instead of --train-seconds")
    ap.add_argument("--eval-every", type=float, default=0.1, help="validation every this fraction of training")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--dropout", type=float, default=0.35, help="embedding and residual dropout while training")
    ap.add_argument("--chat-frac", type=float, default=0.125, help="share of training sequences that are chats")
    ap.add_argument("--chats", type=int, default=4000, help="chats built from the training text")
    ap.add_argument("--ctx", type=int, default=256, help="perplexity window")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--linear-k-heads", type=int, default=4)
    ap.add_argument("--linear-v-heads", type=int, default=8)
    ap.add_argument("--linear-head-dim", type=int, default=32)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--expert-dim", type=int, default=64)
    ap.add_argument("--shared-dim", type=int, default=128)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--sample-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.smoke:
        args.vocab_size = min(args.vocab_size, 1024)
        args.hidden, args.layers, args.experts, args.expert_dim, args.shared_dim = 64, 4, 4, 32, 32
        args.heads, args.kv_heads, args.head_dim = 2, 1, 32
        args.linear_k_heads, args.linear_v_heads, args.linear_head_dim = 2, 4, 16
        args.batch_size, args.seq_len, args.ctx, args.sample_tokens = 8, 128, 64, 12
        args.steps = args.steps or 12
        args.eval_every = 0.5
    if args.train_seconds is None:
        args.train_seconds = 120.0 if args.mtp else 180.0
    if args.seq_len < args.ctx or args.ctx < 2:
        fail(f"--ctx {args.ctx} must be at least 2 and at most --seq-len {args.seq_len}")
    return args


def main() -> None:
    args = parse_args()
    if args.mtp:
        from train_mtp import train_mtp_head

        train_mtp_head(args)
        return
    t_start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    log(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else platform.processor() or 'cpu'})")

    # --- data and tokenizer ---------------------------------------------------
    books = load_corpus(args.corpus, args.smoke)
    train_books, val_text, test_text = split_corpus(books, 0.015)
    train_texts = ["\n\n".join(p) + "\n" for p in train_books.values()]
    tok = train_tokenizer(train_texts, args.vocab_size, args.max_positions)
    eot = tok.convert_tokens_to_ids(EOT)
    log(f"tokenizer: {len(tok)} ids, trained in {time.time() - t_start:.1f}s")

    test_ids = tok.backend_tokenizer.encode(test_text, add_special_tokens=False).ids
    if len(test_ids) < args.ctx:
        fail("corpus too small for --ctx")
    batches, val, counts = training_data(args, tok, train_books, val_text, device)
    log(
        f"corpus: {counts['plain']:,} training tokens, {counts['chat']:,} chat tokens ({counts['chats']} chats), "
        f"{counts['val']:,} validation, {len(test_ids):,} held-out"
    )

    # --- model and training -----------------------------------------------------
    cfg = model_config(args, len(tok), tok)
    model = Qwen3_5MoeForCausalLM(cfg).to(device)
    log(f"layer types {cfg.layer_types}, mrope section {cfg.rope_parameters['mrope_section']}")
    total, active = count_params(model)
    log(f"model: {total:,} parameters ({active:,} active), experts via {model.config._experts_implementation}")
    hooks = add_dropout(model, args.dropout)
    record = train(model, batches, val, args, device)
    for h in hooks:
        h.remove()
    log(
        f"trained {record['steps']} steps, {record['tokens']:,} tokens in {record['seconds']}s "
        f"({record['tokens_per_second']:,} tok/s); "
        f"best val loss {record['best_val_loss']} at step {record['best_step']}"
    )

    # --- export ---------------------------------------------------------------
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    fp32_state = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(
        do_sample=True,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        repetition_penalty=1.1,
        bos_token_id=None,
        eos_token_id=[tok.convert_tokens_to_ids(IM_END), eot],
        pad_token_id=eot,
    )
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out, save_jinja_files=False)
    (out / "heldout.txt").write_text(test_text, encoding="utf-8")

    # --- evaluation (from the files just written) -------------------------------
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    tok = AutoTokenizer.from_pretrained(out)
    heldout_ids = tok.backend_tokenizer.encode(
        (out / "heldout.txt").read_text(encoding="utf-8"), add_special_tokens=False
    ).ids
    m32 = Qwen3_5MoeForCausalLM(cfg)
    m32.load_state_dict(fp32_state)
    m32.to(device)
    m16 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device)
    n_windows = len(heldout_ids) // args.ctx
    ppl = dict(
        definition=PPL_DEFINITION,
        text_file="heldout.txt",
        ctx=args.ctx,
        add_special_tokens=False,
        n_tokens=len(heldout_ids),
        n_windows=n_windows,
        scored_tokens=n_windows * (args.ctx - 1),
        token_ids_sha256=ids_sha256(heldout_ids),
        first_ids=heldout_ids[:32],
        float32=perplexity(m32, heldout_ids, args.ctx, device),
        bfloat16_weights=perplexity(m16, heldout_ids, args.ctx, device),
    )
    log(f"perplexity (ctx {args.ctx}): float32 {ppl['float32']['ppl']}, bf16 weights {ppl['bfloat16_weights']['ppl']}")
    del m32

    sample_list = samples(m16, tok, GenerationConfig.from_pretrained(out), device, args.sample_tokens, args.seed)
    for s in sample_list:
        log(f"{'chat' if s['chat'] else 'text'} {s['kind']}: {s['prompt']!r} -> {s['text']!r}")

    corpus_source = {}
    if (args.corpus / "SOURCE.json").is_file():
        corpus_source = json.loads((args.corpus / "SOURCE.json").read_text(encoding="utf-8"))
    ref = dict(
        format=1,
        versions=dict(
            python=platform.python_version(),
            torch=torch.__version__,
            transformers=transformers.__version__,
            tokenizers=tokenizers.__version__,
        ),
        smoke=args.smoke,
        corpus=dict(
            package=corpus_source.get("package"),
            version=corpus_source.get("version"),
            deb_sha256=corpus_source.get("deb_sha256"),
            licence=corpus_source.get("licence"),
        ),
        model=dict(
            **{"class": "Qwen3_5MoeForCausalLM"},
            params_total=total,
            params_active=active,
            config=json.loads((out / "config.json").read_text()),
        ),
        training=dict(
            seed=args.seed,
            device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            lr=args.lr,
            dropout=args.dropout,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            chat_frac=args.chat_frac,
            train_tokens=counts["plain"],
            chat_tokens=counts["chat"],
            **{k: v for k, v in record.items()},
        ),
        special_tokens=dict(
            eos_token=tok.eos_token,
            eos_token_id=tok.eos_token_id,
            pad_token=tok.pad_token,
            pad_token_id=tok.pad_token_id,
            bos_token=tok.bos_token,
            generation_eos_token_ids=GenerationConfig.from_pretrained(out).eos_token_id,
        ),
        perplexity=ppl,
        encode=encode_fixtures(tok),
        chat_template=chat_fixtures(tok),
        samples=sample_list,
    )
    ref["total_seconds"] = round(time.time() - t_start, 1)
    (out / "reference.json").write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "README.md").write_text(model_card(ref, out), encoding="utf-8")

    size = sum(f.stat().st_size for f in out.iterdir())
    for f in sorted(out.iterdir()):
        log(f"  {f.name:24s} {f.stat().st_size:>12,} bytes")
    if size > SIZE_LIMIT:
        fail(f"{out}: {size:,} bytes, over the {SIZE_LIMIT:,}-byte budget: make the model smaller")
    log(f"done in {time.time() - t_start:.0f}s: {out} ({size:,} bytes)")


if __name__ == "__main__":
    main()
