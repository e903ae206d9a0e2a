"""Time to first token with and without radixkv, for prompts sharing 0..90 % of their tokens.

    python bench/ttft.py --prompt-tokens 2000 --shares 0,25,50,75,90 --repeat 5

Starts `radixkv serve` (host pool, the model's layout) on a temporary socket and one engine in
this process: by default a random-weight Llama (radixkv.engines.tiny_llama, fp32, CPU) on random
tokens; `--model smollm2-135m` runs the real model on slices of the pydoc corpus and adds a
multi-turn table (a chat of pydoc topics whose greedy answers are cached, TTFT per turn with and
without radixkv). For each share and repeat, with a fresh shared prefix:

    no cache      prefill(prefix + suffix B) without radixkv            -> TTFT
    warm-up       prefill(prefix + suffix A) through radixkv (untimed: caches the prefix)
    with radixkv  prefill(prefix + suffix B) through radixkv            -> TTFT

TTFT counts everything up to the first token id: PoolInfo (epoch check), Match, the gather of
cached blocks into the model's cache, the forward of the rest, Allocate, the scatter of new full
blocks, Insert, Release, argmax. Reported: medians over repeats of the TTFTs, of the ratio of
each back-to-back pair, and of the radixkv overhead (all but the forward).
Targets: ratio <= 0.55 at 50 % shared, <= 0.2 at 90 %.

Why the ratio is not simply the uncached fraction: the linear layers scale with the computed
tokens, attention does not. A suffix of q tokens over p cached ones costs q x p + q^2 / 2 scores
against (p + q)^2 / 2 for the full prefill: at 50 % shared, 0.75 of the full prefill's attention.
The "bench" model has Llama-3-8B's MLP width, so attention is ~6 % of its prefill at 2,000 tokens
(as in the real model) and the floor at 50 % is ~0.5 x 0.94 + 0.75 x 0.06 = 0.515; GEMMs of 1,000
rows also run a little less efficiently on CPU than of 2,000. The engine's model uses
`attn_implementation="radixkv"` (radixkv/engines/attention.py: prefix and causal suffix apart,
merged by log-sum-exp); `--attn sdpa` is transformers' sdpa, whose masked suffix kernel pays for
all q x (p + q) scores; `--attn eager` computes the full n^2 in both paths. SmolLM2-135M's
attention is ~30 % of its 2,000-token prefill (hidden size 576), so its floor at 50 % is
~0.5 x 0.7 + 0.75 x 0.3 = 0.575: the 0.55 target is out of its reach (README).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _common import emit, radixkv_server

TARGETS = {50: 0.55, 90: 0.2}


def model_name(name: str) -> str:
    """A registry name (radixkv.engines.models); a bare tiny_llama size names its tiny model."""
    return f"tiny-{name}" if name in ("test", "demo", "bench") else name


def ttft(prefill: Callable[[list[int]], Any], tokens: list[int]) -> tuple[float, Any]:
    """Seconds from the call to the first token id, and the prefill result."""
    t0 = time.perf_counter()
    result = prefill(tokens)
    int(result.logits_last.argmax())
    return time.perf_counter() - t0, result


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from radixkv.engines import models
    from radixkv.engines.hf import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    loaded = models.load(model_name(args.model), seed=args.seed,
                         attn_implementation=args.attn,
                         notify=lambda m: print(m, file=sys.stderr))
    shares = [int(s) for s in args.shares.split(",")]
    n = args.prompt_tokens
    if loaded.tokenizer is not None:  # a real model reads real text: slices of the corpus
        from radixkv.engines import corpus

        source = corpus.tokens(loaded.tokenizer)

        def text(count: int) -> list[int]:
            start = rng.randrange(len(source) - count)
            return source[start:start + count]
    else:
        vocab = loaded.config["vocab_size"]

        def text(count: int) -> list[int]:
            return [rng.randrange(vocab) for _ in range(count)]

    turns: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rkv-ttft-") as directory:
        flags = [*loaded.serve_flags(directory), "--block-size", str(args.block_size),
                 "--num-blocks", str(args.num_blocks)]
        with radixkv_server(directory, *flags) as sock:
            engine = Engine(loaded.model, sock, loaded.namespace,
                            store_after_first_token=args.store_after_first_token)
            for _ in range(2):  # warm-up: allocator, kernels, the pool mapping, the channel
                engine.prefill(text(n))
                engine.wait_stored()
                engine.prefill_no_cache(text(n))
            rows = []
            for share in shares:
                shared = n * share // 100
                base, cached, ratios, overhead, hits = [], [], [], [], []
                for _ in range(args.repeat):
                    prefix = text(shared)
                    engine.prefill(prefix + text(n - shared))  # puts the prefix in the cache
                    engine.wait_stored()  # (untimed; a no-op unless the store is deferred)
                    prompt = prefix + text(n - shared)
                    # the pair back to back, so that load from elsewhere hits both alike
                    base.append(ttft(engine.prefill_no_cache, prompt)[0])
                    seconds, result = ttft(engine.prefill, prompt)
                    engine.wait_stored()
                    cached.append(seconds)
                    ratios.append(seconds / base[-1])
                    overhead.append(result.timings["total"] - result.timings["forward"])
                    hits.append(result.cached_tokens)
                    print(f"{share}% shared: {base[-1] * 1e3:.0f} -> {seconds * 1e3:.0f} ms",
                          file=sys.stderr, flush=True)
                no_cache, with_kv = statistics.median(base), statistics.median(cached)
                rows.append({"shared_pct": share, "shared_tokens": shared,
                             "cached_tokens": min(hits), "ttft_no_cache_ms": no_cache * 1e3,
                             "ttft_radixkv_ms": with_kv * 1e3,
                             "radixkv_overhead_ms": statistics.median(overhead) * 1e3,
                             "ratio": statistics.median(ratios)})
            if loaded.tokenizer is not None and args.turns:
                turns = chat_turns(engine, loaded.tokenizer, args.turns, args.answer_tokens)
            engine.close()
    targets = {f"ratio_at_{s}pct<={t}": row["ratio"] <= t
               for s, t in TARGETS.items() for row in rows if row["shared_pct"] == s}
    return {"model": args.model, "attn": args.attn, "prompt_tokens": n,
            "block_size": args.block_size, "repeat": args.repeat,
            "threads": torch.get_num_threads(), "rows": rows, "turns": turns,
            "store_after_first_token": args.store_after_first_token,
            "targets_met": targets}


def chat_turns(engine: Any, tokenizer: Any, count: int, answer_tokens: int
               ) -> list[dict[str, Any]]:
    """A chat of `count` turns whose user messages are pydoc topics (~200 tokens each) and
    whose answers are the model's own (greedy, cached for the next turn). Per turn: prompt
    tokens, tokens reused, TTFT through radixkv and without."""
    from radixkv.engines import corpus
    from radixkv.engines.chat import Conversation, answer_turn

    chat = Conversation("You are a helpful assistant. Answer briefly.")
    topics = list(corpus.topics().values())
    out = []
    for turn in range(count):
        ids = tokenizer(topics[turn * 7 % len(topics)], add_special_tokens=False)["input_ids"]
        user = "Summarize this:\n\n" + tokenizer.decode(ids[:200])
        r = chat.ask(user, lambda messages: answer_turn(engine, tokenizer, messages,
                                                        answer_tokens))
        assert r.ttft_no_cache_s is not None
        out.append({"turn": turn + 1, "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens, "ttft_radixkv_ms": r.ttft_s * 1e3,
                    "ttft_no_cache_ms": r.ttft_no_cache_s * 1e3,
                    "ratio": r.ttft_s / r.ttft_no_cache_s})
        print(f"turn {turn + 1}: {r.summary()}", file=sys.stderr, flush=True)
    return out


def print_table(report: dict[str, Any]) -> None:
    print(f"TTFT, {report['prompt_tokens']}-token prompts, model {report['model']!r} (fp32, "
          f"{report['attn']}, CPU, {report['threads']} threads), median of {report['repeat']}")
    print(f"{'shared':>7} {'cached tok':>10} {'no cache ms':>12} {'radixkv ms':>11} "
          f"{'overhead ms':>12} {'ratio':>6}")
    for r in report["rows"]:
        print(f"{r['shared_pct']:>6}% {r['cached_tokens']:>10} {r['ttft_no_cache_ms']:>12.1f} "
              f"{r['ttft_radixkv_ms']:>11.1f} {r['radixkv_overhead_ms']:>12.2f} "
              f"{r['ratio']:>6.3f}")
    if report["turns"]:
        print("\nMulti-turn chat (user turns from the pydoc corpus, greedy answers cached)")
        print(f"{'turn':>4} {'prompt tok':>10} {'reused tok':>10} {'no cache ms':>12} "
              f"{'radixkv ms':>11} {'ratio':>6}")
        for t in report["turns"]:
            print(f"{t['turn']:>4} {t['prompt_tokens']:>10} {t['cached_tokens']:>10} "
                  f"{t['ttft_no_cache_ms']:>12.1f} {t['ttft_radixkv_ms']:>11.1f} "
                  f"{t['ratio']:>6.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--shares", default="0,25,50,75,90", help="shared prefix, %% of the prompt")
    p.add_argument("--repeat", type=int, default=5, help="timed pairs per share (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="bench",
                   help="a tiny random model (test, demo, bench: random token prompts) or a "
                   "registered real one, smollm2-135m (prompts sliced from the pydoc corpus, "
                   "plus the multi-turn table)")
    p.add_argument("--turns", type=int, default=8,
                   help="turns of the multi-turn chat (real models only; 0: skip)")
    p.add_argument("--answer-tokens", type=int, default=32,
                   help="greedy tokens answered per chat turn (32)")
    p.add_argument("--attn", default="radixkv", choices=["radixkv", "sdpa", "eager"],
                   help="attention implementation of the model (both paths)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (default: torch's, one per core). 1 keeps the ratios "
                   "steady on a machine that others load: with 2 threads on 2 busy cores each "
                   "kernel waits for the thread the scheduler left out, whatever its size")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--store-after-first-token", action="store_true",
                   help="the engine writes new blocks back after the first token "
                   "(Engine(store_after_first_token=True)): the TTFT then counts Match and the "
                   "gather, not the scatter and Insert")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = p.parse_args()
    report = run(args)
    if not args.json:
        print_table(report)
    summary = {f"ratio@{r['shared_pct']}%": round(r["ratio"], 3) for r in report["rows"]}
    emit("ttft", report if args.json else {**summary, **report["targets_met"]}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
