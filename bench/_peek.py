"""The lookup table's read beside a gRPC Match, under inserts (bench/rpc_latency.py's peek_4k).

One reader process alternates timed windows of `Client.peek` and `Client.match` (+ Release) of
one cached 4,096-token prompt (256 blocks of 16, pinned by a lease for the run so that every read
is a full hit), while another process inserts new prompts as fast as it can (Allocate + Insert +
Release of 256 blocks a call; the pool evicts to make room), and reports the blocks it
inserted per second. Each peek is checked against the Match's answer (the same blocks)."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
from _common import percentile_us  # noqa: I001 (bench/ is on sys.path)

NAMESPACE = "peek"


def _inserter(target: str, tokens: int, block_size: int, stop: Any, out: Any) -> None:
    from radixkv.client import Client

    rng = np.random.default_rng(7)
    blocks = 0
    with Client(target) as kv:
        t0 = time.perf_counter()
        while not stop.is_set():
            prompt = rng.integers(0, 32000, tokens, dtype="<u4").tobytes()
            a = kv.allocate(tokens // block_size, namespace="insert")
            kv.insert("insert", prompt, a.block_ids, a.lease_id, release=True)
            blocks += len(a.block_ids)
        out.put(blocks / (time.perf_counter() - t0))


def run_peek(target: str, prompt: bytes, block_size: int, seconds: float,
             rounds: int) -> dict[str, Any]:
    """peek_4k and match_4k (p50_us, p99_us, calls) with the insert rate and read retries."""
    from radixkv.client import Client

    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    inserter = ctx.Process(target=_inserter, args=(target, len(prompt) // 4, block_size,
                                                    stop, out))
    with Client(target) as kv:
        a = kv.allocate(len(prompt) // 4 // block_size, namespace=NAMESPACE)
        kv.insert(NAMESPACE, prompt, a.block_ids, a.lease_id)  # the lease keeps it pinned
        want = kv.peek(NAMESPACE, prompt)
        assert want.block_ids == tuple(a.block_ids), "the table disagrees with the Insert"
        inserter.start()
        lat: dict[str, list[float]] = {"peek": [], "match": []}
        wrong = 0
        time.sleep(0.5)  # the inserter's imports
        for r in range(rounds):
            for case in (("peek", "match") if r % 2 == 0 else ("match", "peek")):
                deadline = time.perf_counter() + seconds
                while time.perf_counter() < deadline:
                    t0 = time.perf_counter()
                    if case == "peek":
                        got = kv.peek(NAMESPACE, prompt)
                        lat[case].append(time.perf_counter() - t0)
                        wrong += got.block_ids != want.block_ids
                    else:
                        m = kv.match(NAMESPACE, prompt)
                        lat[case].append(time.perf_counter() - t0)
                        wrong += m.block_ids != want.block_ids
                        kv.release(m.lease_id)
        stop.set()
        rate = out.get(timeout=60)
        inserter.join(30)
        reader = kv._peeks.reader
        assert reader is not None
        kv.release(a.lease_id)
    result: dict[str, Any] = {}
    for case, values in lat.items():
        arr = np.asarray(values)
        result[f"{case}_4k"] = {"p50_us": percentile_us(arr, 50),
                                "p99_us": percentile_us(arr, 99), "calls": len(values)}
    result["peek_4k"]["retry_pct"] = 100.0 * reader.retries / max(1, reader.reads)
    result["inserted_blocks_per_s"] = rate
    result["wrong_answers"] = wrong
    result["match_p50_over_peek_p50"] = (result["match_4k"]["p50_us"]
                                         / result["peek_4k"]["p50_us"])
    return result
