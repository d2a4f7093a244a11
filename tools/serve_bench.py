#!/usr/bin/env python3
"""Load benchmark of `moeflux serve`: concurrent streaming clients, each
sending completions of random token-id prompts one after another, and the
time to first token of a conversation's second turn.

Python's standard library only, so it runs on any machine with the server:

    moeflux serve -m MODEL --max-sequences 64 --port 8080 &
    python3 tools/serve_bench.py --clients 16 --rounds 2 --prompt-len 256 --max-tokens 256
    python3 tools/serve_bench.py --second-turn 8

Load: every client sends `--rounds` requests in turn (`/v1/completions`,
streamed, greedy, `ignore_eos`, so every answer is `--max-tokens` long).
Prints the aggregate output speed (tokens received over the wall time from
the first request to the last answer), and p50/p99 of the time to first token and of the gaps between a
request's tokens as the clients saw them (tokens counted by the usage the
server reports; times of the chunks that carry text).

Second turn: `--second-turn N` runs N conversations of two requests; the
second's prompt is the first's prompt and answer and `--turn-len` new
tokens, the way a chat's next turn reads. Its time to first token is short
when the server resumes from the first turn's checkpoint (prefix reuse);
start the server with `--prefix-cache-mb 0` for the figure without it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Server:
    def __init__(self, url: str, api_key: str | None):
        parts = urllib.parse.urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        conn.request("GET", path, headers=self.headers)
        response = conn.getresponse()
        body = response.read()
        conn.close()
        if response.status != 200:
            sys.exit(f"serve_bench: GET {path}: {response.status} {body[:300]!r}")
        return json.loads(body)

    def stream(self, prompt: list[int], max_tokens: int) -> dict:
        """One streamed completion; its token ids, time to first token and
        the gaps between tokens, in seconds."""
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers=self.headers)
        response = conn.getresponse()
        if response.status != 200:
            text = response.read()[:300]
            conn.close()
            raise RuntimeError(f"HTTP {response.status}: {text!r}")
        first, last, gaps, texts, tokens = None, None, [], [], 0
        while True:
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error chunk: {chunk}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            text = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
            if not text:
                continue
            now = time.perf_counter()
            if first is None:
                first = now - start
            else:
                gaps.append(now - last)
            last = now
            texts.append(text)
        conn.close()
        return {"first": first, "gaps": gaps, "text": "".join(texts), "tokens": tokens}


def load(server: Server, args: argparse.Namespace, vocab: int) -> None:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.clients * args.rounds)]
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for r in range(args.rounds):
            try:
                out = server.stream(prompts[i * args.rounds + r], args.max_tokens)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(str(e))
                return
            with lock:
                results.append(out)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        sys.exit(f"serve_bench: {len(errors)} requests failed, first: {errors[0]}")
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["first"] for r in results if r["first"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    print(
        f"load: {args.clients} clients x {args.rounds} requests, prompts of {args.prompt_len} tokens, "
        f"{args.max_tokens} out: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s aggregate"
    )
    print(
        f"  time to first token p50 {percentile(ttft, 0.5) * 1e3:.1f} ms, p99 {percentile(ttft, 0.99) * 1e3:.1f} ms; "
        f"between tokens p50 {percentile(gaps, 0.5) * 1e3:.1f} ms, p99 {percentile(gaps, 0.99) * 1e3:.1f} ms"
    )


def second_turn(server: Server, args: argparse.Namespace, vocab: int) -> None:
    rng = random.Random(args.seed + 1)
    firsts, seconds = [], []
    for _ in range(args.second_turn):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        one = server.stream(prompt, args.answer_len)
        answer = server_tokens(server, one["text"])
        follow = prompt + answer + [rng.randrange(vocab) for _ in range(args.turn_len)]
        two = server.stream(follow, 8)
        firsts.append(one["first"])
        seconds.append(two["first"])
    print(
        f"second turn: {args.second_turn} conversations, first turn {args.prompt_len} prompt tokens + "
        f"{args.answer_len} answered, second turn {args.turn_len} more: time to first token "
        f"first turn median {statistics.median(firsts) * 1e3:.1f} ms, second turn median "
        f"{statistics.median(seconds) * 1e3:.1f} ms"
    )


def server_tokens(server: Server, text: str) -> list[int]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", "/tokenize", body=json.dumps({"prompt": text, "add_special_tokens": False}), headers=server.headers)
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    return body["tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--api-key")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="requests each client sends in turn")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--second-turn", type=int, default=0, help="conversations of two turns to time (0: none)")
    parser.add_argument("--answer-len", type=int, default=64, help="tokens the first turn answers")
    parser.add_argument("--turn-len", type=int, default=32, help="new tokens of the second turn")
    parser.add_argument("--no-load", action="store_true", help="only the second-turn measurement")
    parser.add_argument("--vocab", type=int, default=1000, help="prompts draw token ids below this")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    server = Server(args.url, args.api_key)
    for _ in range(600):
        try:
            server.get("/health")
            break
        except (ConnectionError, OSError):
            time.sleep(1)
    if not args.no_load:
        load(server, args, args.vocab)
    if args.second_turn:
        second_turn(server, args, args.vocab)


if __name__ == "__main__":
    main()
