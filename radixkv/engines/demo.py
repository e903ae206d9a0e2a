"""Two engine processes sharing KV through one radixkv service: a shared system prompt, then a
multi-turn chat whose second turn is served by the other process.

    flags = demo_serve_flags(tmpdir)        # start `radixkv serve --socket S *flags` with these
    report = run_engine_demo(S)             # -> {"requests": [...], "all_match": True, ...}

Each engine process builds the same random-weight tiny Llama ("demo" size, fixed seed), so KV
written by one is valid for the other. Every request runs twice in its process: through radixkv
and without it (the baseline), and reports the TTFT of both and whether the greedy tokens match.
"""

from __future__ import annotations

import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from radixkv.engines import tiny_llama

MODEL = "demo"
BLOCK_SIZE = 16

_engine: Any = None  # the Engine of this worker process


def demo_serve_flags(directory: str) -> list[str]:
    """The `radixkv serve` flags whose pool fits the demo model (writes its config.json)."""
    return ["--model-config", tiny_llama.write_config(directory, MODEL),
            "--block-size", str(BLOCK_SIZE)]


def init_worker(socket_path: str, model: str, seed: int) -> None:
    """ProcessPoolExecutor initializer: build the model and connect, once per process."""
    import torch

    from radixkv.engines.hf import Engine

    global _engine
    torch.set_num_threads(1)  # two engines share the machine; keep them from oversubscribing
    _engine = Engine(tiny_llama.build_model(model, seed), socket_path,
                     tiny_llama.namespace_for(model, seed))
    _engine.prefill_no_cache(list(range(32)))  # warm-up: first-call costs out of the TTFTs


def serve_request(tokens: list[int], max_new_tokens: int) -> dict[str, Any]:
    """In a worker: the request through radixkv (caching prompt and answer), then the baseline."""
    assert _engine is not None, "init_worker was not run"
    cached = _engine.prefill(tokens)
    out = _engine.decode(tokens, cached, max_new_tokens)
    _engine.store(tokens + out[:-1], cached.cache)
    base = _engine.prefill_no_cache(tokens)
    base_out = _engine.decode(tokens, base, max_new_tokens)
    ttft, ttft_base = cached.timings["total"], base.timings["total"]
    return {"prompt_tokens": len(tokens), "cached_tokens": cached.cached_tokens,
            "ttft_s": ttft, "ttft_no_cache_s": ttft_base, "ttft_saved_s": ttft_base - ttft,
            "tokens": out, "match": out == base_out}


def start_engines(socket_path: str, count: int, model: str = MODEL,
                  seed: int = 0) -> list[ProcessPoolExecutor]:
    """`count` engine processes (spawned: torch and gRPC are not fork-safe), one executor each."""
    ctx = multiprocessing.get_context("spawn")
    return [ProcessPoolExecutor(1, mp_context=ctx, initializer=init_worker,
                                initargs=(socket_path, model, seed)) for _ in range(count)]


def run_engine_demo(socket_path: str, *, max_new_tokens: int = 8, seed: int = 0,
                    system_tokens: int = 400, turn_tokens: int = 60) -> dict[str, Any]:
    """Run the demo against the service at `socket_path` (started with `demo_serve_flags`).
    Returns {"requests": [{"name", "engine", "prompt_tokens", "cached_tokens", "ttft_s",
    "ttft_no_cache_s", "ttft_saved_s", "tokens", "match"}], "all_match", "ttft_saved_s"}."""
    rng = random.Random(seed)
    vocab = tiny_llama.config_dict(MODEL)["vocab_size"]

    def text(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    system = text(system_tokens)
    user_a, user_b, user_a2, user_b2 = (text(turn_tokens) for _ in range(4))
    engines = start_engines(socket_path, 2, seed=seed)
    requests: list[dict[str, Any]] = []
    try:
        def run(name: str, engine: int, tokens: list[int]) -> list[int]:
            r = engines[engine].submit(serve_request, tokens, max_new_tokens).result()
            requests.append({"name": name, "engine": engine, **r})
            return list(r["tokens"])

        answer_a = run("chat A turn 1 (cold)", 0, system + user_a)
        answer_b = run("chat B turn 1 (shared system prompt)", 1, system + user_b)
        run("chat A turn 2 (turn 1 + answer cached)", 1, system + user_a + answer_a + user_a2)
        run("chat B turn 2 (turn 1 + answer cached)", 0, system + user_b + answer_b + user_b2)
    finally:
        for ex in engines:
            ex.shutdown()
    return {"requests": requests, "all_match": all(r["match"] for r in requests),
            "ttft_saved_s": sum(r["ttft_saved_s"] for r in requests)}
