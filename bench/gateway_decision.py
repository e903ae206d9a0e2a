"""The gateway's decision for one prompt: tokenizing it as the engine will, then ranking the
engines by the cluster index (radixkv/gateway/choice.py), over real members.

etcd and --members members (`radixkv serve --cluster`, a one-layer layout of 16-token blocks);
member i holds the first (i + 1) / members of a --tokens-token prompt, so the index answers
every depth. A Router follows them as the gateway's does; then `choose` ranks one engine per
member for the whole prompt --repeat times (the first ranked must be the member holding all of
it), and the real model's tokenizer (SmolLM2, `radixkv.engines.models`) turns a chat of about
--tokens tokens into ids under its chat template, as the gateway does per request:

    decision_p50_us, decision_p99_us, tokenize_p50_us, tokenize_p99_us

    .venv/bin/python bench/gateway_decision.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from _common import emit, latency_us, log

from radixkv.client import Client
from radixkv.cluster.local import local_cluster
from radixkv.cluster.router import Router
from radixkv.gateway.choice import choose
from radixkv.gateway.engines import EngineServer
from radixkv.rpc.etcd import EtcdTarget

BLOCK = 16
NS = "vllm:bench-model@main/bf16"


def layout_flags(directory: str, num_blocks: int) -> tuple[str, ...]:
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump({"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
                   "head_dim": 64, "hidden_size": 64, "torch_dtype": "float16"}, f)
    return ("--model-config", path, "--block-size", str(BLOCK), "--num-blocks",
            str(num_blocks), "--log-level", "warning")


def wait_indexed(router: Router, tokens: list[int], engines: list[EngineServer],
                 timeout: float = 120.0) -> None:
    """Until every member is followed and the deepest one's whole prompt is in the index."""
    deadline = time.monotonic() + timeout
    while True:
        choice = choose(engines, router, NS, tokens)
        if len(router.followers()) == len(engines) and \
                choice.cached_tokens[engines[-1].url] == len(tokens):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the index did not catch up: {choice.cached_tokens}")
        time.sleep(0.2)


def time_decisions(router: Router, tokens: list[int], engines: list[EngineServer],
                   repeat: int) -> list[float]:
    took = []
    for _ in range(repeat):
        started = time.perf_counter()
        choice = choose(engines, router, NS, tokens)
        took.append(time.perf_counter() - started)
        assert choice.ranked[0] is engines[-1], choice.ranked[0]
    return took


def time_tokenizing(n_tokens: int, repeat: int) -> tuple[list[float], int]:
    """The gateway's chat tokenizing (radixkv/gateway/prompts.py) of a chat of about
    `n_tokens` tokens with the real model's tokenizer."""
    from radixkv.engines import models
    from radixkv.gateway.prompts import Prompts

    prompts = Prompts(str(models.ensure_converted(models.get_spec(models.REAL_MODEL))[0]))
    rng = random.Random(7)
    words = ["cache", "prefix", "block", "engine", "member", "tokens", "router", "shared"]
    text = " ".join(rng.choice(words) for _ in range(n_tokens))
    body = {"messages": [{"role": "system", "content": text},
                         {"role": "user", "content": "Which engine holds it?"}]}
    n = len(prompts.chat(body))
    took = []
    for _ in range(repeat):
        started = time.perf_counter()
        prompts.chat(body)
        took.append(time.perf_counter() - started)
    return took, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, default=16)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=2000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rng = random.Random(1)
    tokens = [rng.randrange(1, 49_000) for _ in range(args.tokens // BLOCK * BLOCK)]
    blocks = len(tokens) // BLOCK
    with tempfile.TemporaryDirectory(prefix="rkv-gwd-") as directory, \
            local_cluster(0, *layout_flags(directory, blocks + 8), router=False) as c:
        log(f"{args.members} members of {blocks + 8} blocks")
        for i in range(args.members):
            node = f"n{i}"
            c.start_member(node)
            held = tokens[:max(1, blocks * (i + 1) // args.members) * BLOCK]
            with Client(c.socket_of(node)) as kv, kv.lease(NS, held) as lease:
                lease.insert(held, lease.new_block_ids, release=True)
        router = Router(EtcdTarget.parse(c.etcd.url))
        router.start()
        engines = [EngineServer(f"http://127.0.0.1:{9000 + i}", f"n{i}")  # one per member
                   for i in range(args.members)]
        try:
            wait_indexed(router, tokens, engines)
            log(f"the index holds all {args.members} members; {args.repeat} decisions")
            decisions = time_decisions(router, tokens, engines, args.repeat)
        finally:
            router.stop()
    log("tokenizing with the real model's tokenizer")
    tokenizing, chat_tokens = time_tokenizing(args.tokens, max(50, args.repeat // 20))
    d, t = latency_us(decisions), latency_us(tokenizing)
    emit("gateway_decision", {
        "members": args.members, "prompt_tokens": len(tokens),
        "decision_p50_us": round(d["p50"], 1), "decision_p99_us": round(d["p99"], 1),
        "chat_tokens": chat_tokens,
        "tokenize_p50_us": round(t["p50"], 1), "tokenize_p99_us": round(t["p99"], 1),
        "goals": {"decision_p99_us<=1000": d["p99"] <= 1000}}, args.json)


if __name__ == "__main__":
    main()
