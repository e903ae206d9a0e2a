"""Replay a trace through a bare RadixTree: hit rate, tree latency, memory, eviction cost.

    python bench/tree_replay.py --trace ../shared/traces/mooncake/conversation_trace.jsonl \
        --block-size 512 --capacity-blocks 16384 [--json]
    python bench/tree_replay.py --trace synthetic --requests 2000 --block-size 16
    python bench/tree_replay.py --trace T --block-size 512 --capacity-blocks C \
        --policy adaptive [--hints] --json
    python bench/tree_replay.py --trace synthetic --block-size 16 --capacity-blocks 8192 \
        --policy lru --sglang [--rounds 3] [--json]
    python bench/tree_replay.py --trace synthetic --eviction-sizes 1000,10000,100000
    python bench/tree_replay.py --scale [--scale-sizes 10000,100000,1000000,10000000] [--json]

Per request it follows radixkv.replay.simulate's contract (match, lock, evict what is short, insert,
unlock). After a warm-up replay it reports token hit rate (matched / prompt tokens), blocks
evicted, requests/s and match / insert latency; then, in a separate pass under tracemalloc,
the Python memory the tree uses per cached block (token bytes included, and shown apart).
--against POLICY [--rounds N] also replays with POLICY, alternating the two N times in this
process, and reports the median match / insert p50 of each and their ratio (policy / POLICY).
--sglang also replays the workload through SGLang's compiled Rust radix tree (.venv-sglang),
alternating with radixkv's for --rounds rounds, and prints both side by side (bench/sglang_tree.py
says what is timed on each side).
--hints sends each request's retention hint derived from the trace (radixkv.replay.hints:
client-supplied knowledge, it reads the future).
--eviction-sizes measures evict() cost per block at several tree sizes, in steady state
(each new request first evicts what it needs) and one block per call.
--scale fills one tree per size with synthetic chats (no eviction), times match and insert on
requests not yet seen (p50/p99), the sizes interleaved in rounds, then fills one tree through
the sizes under tracemalloc for the Python memory per cached block (token bytes, 4 per token,
shown apart).
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402
from sglang_tree import against_sglang, print_table  # noqa: E402

from radixkv.index.policies import DEFAULT_POLICY, POLICIES, make_policy  # noqa: E402
from radixkv.index.tree import RadixTree  # noqa: E402
from radixkv.replay.hints import trace_hints  # noqa: E402
from radixkv.replay.simulate import replay_tree  # noqa: E402
from radixkv.replay.workload import Request, generate_synthetic, iter_trace  # noqa: E402


def requests_of(args: argparse.Namespace, limit: int | None = None) -> Iterator[Request]:
    """The --trace requests (streamed from a file), cut to the smaller of limit and --limit."""
    limits = [x for x in (limit, args.limit) if x is not None]
    limit = min(limits) if limits else None
    if args.trace == "synthetic":
        n = args.requests if limit is None else min(limit, args.requests)
        return iter(generate_synthetic(n, args.seed))
    return iter_trace(args.trace, limit)


def memory_per_block(args: argparse.Namespace) -> dict[str, float]:
    """Fill a tree (no eviction) up to the capacity under tracemalloc; bytes per cached block."""
    bb = 4 * args.block_size
    requests = requests_of(args)  # a synthetic list is built here, outside the traced memory
    next_id = 0
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tree = RadixTree(args.block_size, args.policy, record_events=False)
    for req in requests:
        m = tree.match(req.tokens)
        n = len(req.tokens) // bb
        new = tuple(range(next_id, next_id + n - len(m.block_ids)))  # id ints count as the tree's
        next_id += len(new)
        tree.insert(req.tokens[: n * bb], m.block_ids + tuple(new))
        del m, req
        if tree.num_cached_blocks >= args.capacity_blocks:
            break
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    blocks = max(1, tree.num_cached_blocks)
    return {
        "cached_blocks": tree.num_cached_blocks,
        "nodes": tree.stats().num_nodes,
        "bytes_per_block": used / blocks,
        "token_bytes_per_block": float(bb),
        "overhead_bytes_per_block": used / blocks - bb,
    }


def synthetic_chats(seed: int) -> Iterator[Request]:
    """Endless synthetic chat traffic: chunks of 1,000 requests, each chunk with new seeds (new
    system prompts and conversations)."""
    for s in range(seed, seed + 10**9):
        yield from generate_synthetic(1000, s)


def _fill(tree: RadixTree, reqs: Iterator[Request], size: int, next_id: int) -> int:
    """Insert requests until the tree caches `size` blocks; returns the next free block id."""
    bb = tree.block_size * 4
    while tree.num_cached_blocks < size:
        tokens = next(reqs).tokens
        m = tree.match(tokens)
        n = len(tokens) // bb
        tree.insert(tokens[: n * bb], m.block_ids + tuple(range(next_id, next_id + n -
                                                                len(m.block_ids))))
        next_id += n - len(m.block_ids)
    return next_id


def tree_memory() -> int:
    """Bytes tracemalloc holds for objects allocated by the tree and its eviction policy (nodes,
    edges, children dicts, id arrays, policy entries), not for the requests feeding it."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*radixkv/index/*")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def scale(args: argparse.Namespace, sizes: list[int], samples: int = 500,
          rounds: int = 10) -> list[dict[str, Any]]:
    """Match / insert latency and memory per cached block at each of `sizes` cached blocks.

    One tree per size, each filled from the same synthetic chats, then probed with new requests
    (each inserted too, so the trees grow a little) in `rounds` interleaved rounds of
    samples / rounds per tree, starting one tree later each round: a machine that speeds up or
    slows down during the run biases no size. (Probed one size after the other, the 10M figure
    came a minute after the 10k one, and their ratio swung from 0.8x to 2.2x between runs.)"""
    trees = []
    for size in sizes:
        tree = RadixTree(args.block_size, args.policy, record_events=False)
        reqs = synthetic_chats(args.seed)
        t0 = time.perf_counter()
        next_id = _fill(tree, reqs, size, 0)
        trees.append([tree, reqs, next_id, time.perf_counter() - t0])
        print(f"scale: {size:,} blocks filled in {trees[-1][3]:.1f} s", file=sys.stderr,
              flush=True)
    bb = args.block_size * 4
    match_ns: list[list[int]] = [[] for _ in sizes]
    insert_ns: list[list[int]] = [[] for _ in sizes]
    for r in range(rounds):
        for i in [*range(r % len(sizes), len(sizes)), *range(r % len(sizes))]:
            tree, reqs, next_id, _ = trees[i]
            for _ in range(samples // rounds):
                tokens = next(reqs).tokens
                a = time.perf_counter_ns()
                m = tree.match(tokens)
                match_ns[i].append(time.perf_counter_ns() - a)
                n = len(tokens) // bb
                ids = m.block_ids + tuple(range(next_id, next_id + n - len(m.block_ids)))
                next_id += n - len(m.block_ids)
                a = time.perf_counter_ns()
                tree.insert(tokens[: n * bb], ids)
                insert_ns[i].append(time.perf_counter_ns() - a)
            trees[i][2] = next_id
    rows = []
    for i, size in enumerate(sizes):
        match_us, insert_us = np.asarray(match_ns[i]) / 1e3, np.asarray(insert_ns[i]) / 1e3
        rows.append({"cached_blocks": size, "nodes": trees[i][0].stats().num_nodes,
                     "fill_s": trees[i][3],
                     "match_p50_us": float(np.percentile(match_us, 50)),
                     "match_p99_us": float(np.percentile(match_us, 99)),
                     "insert_p50_us": float(np.percentile(insert_us, 50)),
                     "insert_p99_us": float(np.percentile(insert_us, 99))})
    del trees, tree, reqs
    tracemalloc.start()
    tree = RadixTree(args.block_size, args.policy, record_events=False)
    reqs, next_id = synthetic_chats(args.seed), 0
    for row, size in zip(rows, sizes, strict=True):
        next_id = _fill(tree, reqs, size, next_id)
        row["bytes_per_block"] = tree_memory() / tree.num_cached_blocks - 4 * args.block_size
        row["token_bytes_per_block"] = float(4 * args.block_size)
        print(f"scale: memory at {size:,} blocks measured", file=sys.stderr, flush=True)
    tracemalloc.stop()
    return rows


def eviction_cost(args: argparse.Namespace, size: int) -> dict[str, float]:
    """Fill a tree to `size` blocks with synthetic requests, then time evict() per block."""
    bb = 4 * args.block_size
    tree = RadixTree(args.block_size, make_policy(args.policy, size), record_events=False)
    next_id = 0

    def synthetic() -> Iterator[Request]:  # chunks with new seeds (and system prompts) as needed
        for seed in range(args.seed, args.seed + 10**6):
            yield from generate_synthetic(1000, seed)

    reqs = synthetic()

    def insert(req: Request) -> None:
        nonlocal next_id
        m = tree.match(req.tokens)
        n = len(req.tokens) // bb
        new = tuple(range(next_id, next_id + n - len(m.block_ids)))
        next_id += len(new)
        tree.insert(req.tokens[: n * bb], m.block_ids + new)

    while tree.num_cached_blocks < size:
        insert(next(reqs))
    tree.evict(tree.num_cached_blocks - size)
    steady_ns = steady_blocks = 0
    for _ in range(300):  # steady state: each request first evicts what it will add
        req = next(reqs)
        m = tree.match(req.tokens)
        need = len(req.tokens) // bb - len(m.block_ids)
        t0 = time.perf_counter_ns()
        steady_blocks += len(tree.evict(tree.num_cached_blocks + need - size))
        steady_ns += time.perf_counter_ns() - t0
        insert(req)
    calls = min(2000, size // 2)
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        tree.evict(1)
    single_ns = time.perf_counter_ns() - t0
    return {
        "cached_blocks": size,
        "nodes": tree.stats().num_nodes,
        "steady_us_per_block": steady_ns / 1e3 / max(1, steady_blocks),
        "evict1_us_per_call": single_ns / 1e3 / max(1, calls),
    }


def against(args: argparse.Namespace, hints: list[str | None] | None) -> dict[str, Any]:
    """Median match / insert p50 of --policy and --against over --rounds alternating replays
    (the order flips every round), and their ratios: load on a shared machine moves both."""
    p50: dict[str, list[tuple[float, float]]] = {args.policy: [], args.against: []}
    for i in range(args.rounds):
        for policy in (args.policy, args.against)[:: 1 if i % 2 == 0 else -1]:
            r = replay_tree(requests_of(args), args.block_size, args.capacity_blocks, policy,
                            hints=hints if policy == args.policy else None)
            p50[policy].append((r.match_us.p50, r.insert_us.p50))
    mine, base = ([float(np.median([x[k] for x in p50[p]])) for k in (0, 1)]
                  for p in (args.policy, args.against))
    return {"policy": args.against, "rounds": args.rounds,
            "match_p50_us": [mine[0], base[0]], "insert_p50_us": [mine[1], base[1]],
            "match_p50_ratio": mine[0] / base[0], "insert_p50_ratio": mine[1] / base[1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="synthetic", help="a trace file, or 'synthetic'")
    p.add_argument("--requests", type=int, default=2000, help="synthetic requests")
    p.add_argument("--limit", type=int, default=None, help="replay at most this many")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--capacity-blocks", type=int, default=16384)
    p.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY)
    p.add_argument("--hints", action="store_true",
                   help="retention hints derived from the trace (client-supplied knowledge)")
    p.add_argument("--against", choices=POLICIES, default=None,
                   help="also time this policy, interleaved: p50 ratios policy / this")
    p.add_argument("--sglang", action="store_true",
                   help="also replay through SGLang's Rust radix tree, side by side "
                        "(needs .venv-sglang; policy lru or lfu)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of each with --against or --sglang (3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=200, help="requests replayed first, untimed")
    p.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    p.add_argument("--eviction-sizes", default="", help="e.g. 1000,10000,100000")
    p.add_argument("--scale", action="store_true",
                   help="match / insert latency and memory per block as one tree grows")
    p.add_argument("--scale-sizes", default="10000,100000,1000000,10000000",
                   help="cached blocks at which --scale measures (default 10k,100k,1M,10M)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.sglang and args.hints:
        p.error("--sglang replays without hints (SGLang's tree takes none)")

    out: dict[str, Any] = {
        "trace": args.trace,
        "block_size": args.block_size,
        "capacity_blocks": args.capacity_blocks,
        "policy": args.policy,
        "hints": args.hints,
    }
    if args.scale:
        out["scale"] = scale(args, [int(x) for x in args.scale_sizes.split(",")])
        first, last = out["scale"][0], out["scale"][-1]
        out["match_p50_ratio_last_over_first"] = last["match_p50_us"] / first["match_p50_us"]
        if args.json:
            emit("tree_replay", out, True)
        else:
            for row in out["scale"]:
                emit("tree_scale", row, False)
            print(f"match p50 at {last['cached_blocks']:,} blocks / at "
                  f"{first['cached_blocks']:,}: {out['match_p50_ratio_last_over_first']:.2f}x")
        return 0
    if args.eviction_sizes:
        sizes = [int(s) for s in args.eviction_sizes.split(",")]
        out["eviction"] = {str(s): eviction_cost(args, s) for s in sizes}
        if not args.json:
            for s, r in out["eviction"].items():
                emit("tree_evict", {"size_blocks": int(s), **r}, False)
            return 0
        emit("tree_replay", out, True)
        return 0

    replay_tree(requests_of(args, args.warmup), args.block_size, args.capacity_blocks, args.policy)
    hints = trace_hints(requests_of(args), args.block_size) if args.hints else None
    t0 = time.perf_counter()
    r = replay_tree(requests_of(args), args.block_size, args.capacity_blocks, args.policy,
                    hints=hints)
    out |= {
        "requests": r.num_requests,
        "prompt_tokens": r.prompt_tokens,
        "token_hit_rate": r.token_hit_rate,
        "full_block_hit_rate": r.hit_tokens / r.cacheable_tokens if r.cacheable_tokens else 0.0,
        "evicted_blocks": r.num_evicted_blocks,
        "dropped_blocks": r.num_dropped_blocks,
        "peak_cached_blocks": r.peak_cached_blocks,
        "requests_per_s": r.requests_per_s,
        "tree_s": r.wall_s,
        "total_s": time.perf_counter() - t0,
        "match_us": {"mean": r.match_us.mean, "p50": r.match_us.p50, "p99": r.match_us.p99},
        "insert_us": {"mean": r.insert_us.mean, "p50": r.insert_us.p50, "p99": r.insert_us.p99},
    }
    if args.against:
        out["against"] = against(args, hints)
    if args.sglang:
        out["sglang"] = against_sglang(list(requests_of(args)), args.block_size,
                                       args.capacity_blocks, args.policy, args.warmup, args.rounds)
        if not out["sglang"]["available"]:
            print(f"SGLang's tree: not compared: {out['sglang']['reason']}", file=sys.stderr)
    if not args.no_memory:
        out["memory"] = memory_per_block(args)
    if args.json:
        emit("tree_replay", out, True)
    else:
        line = {k: v for k, v in out.items() if k not in ("memory", "sglang")}
        if "memory" in out:
            line["mem_per_block_B"] = out["memory"]["bytes_per_block"]
            line["overhead_per_block_B"] = out["memory"]["overhead_bytes_per_block"]
        emit("tree_replay", line, False)
        if "sglang" in out:
            print_table(out["sglang"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
