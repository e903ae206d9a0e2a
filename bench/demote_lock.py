"""Match latency while every Allocate demotes many blocks to the disk tier.

    python bench/demote_lock.py --json

In process, KVService over a host pool of --preset's layout (fp32, 16-token blocks:
llama-3.2-1b's are 1 MiB) with a disk tier in --dir (default: a temporary directory under
/tmp). A short prompt is cached and pinned in namespace "hot". Then, for --seconds:

    demoter   one thread: Allocate --alloc-blocks blocks in namespace "cold" (the pool is full
              of cached cold blocks, so each Allocate evicts, so demotes, that many), write
              them, Insert, Release; again
    matcher   another thread: a Match of the hot prompt (a hit in the pool: nothing to
              promote) due every --match-interval-ms, then Release; each Match timed from
              when it was due (open loop: one stuck behind the lock delays the next ones too)

Reported: the Matches' p50 / p99 / max (microseconds), how many ran, the Allocates' p50 / p99,
and the blocks demoted per second; a baseline of the same Matches with no demoter first.
A Match waits for the service lock while an Allocate holds it: with Matches due at a steady
rate, the share of them that wait, and how long, follow the share of the time the Allocates
hold the lock.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
from _common import emit, latency_us

HOT_BLOCKS = 4


def _tokens(i: int, blocks: int, block_size: int) -> bytes:
    return np.arange(i * 1_000_000, i * 1_000_000 + blocks * block_size, dtype="<u4").tobytes()


def _matches(svc: Any, tokens: bytes, interval: float, stop: threading.Event,
             out: list[float]) -> None:
    """Open loop: a Match due every `interval` seconds, each timed from when it was due (one
    that waited behind the lock delays those after it, as it would delay their callers)."""
    due = time.perf_counter()
    while not stop.is_set():
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        m = svc.match("b", "hot", tokens)
        out.append(time.perf_counter() - due)
        svc.release("b", [m.lease_id])
        assert m.num_tokens == len(tokens) // 4, "the hot prompt must stay a hit"
        due += interval


def figures(directory: str, preset: str, pool_blocks: int, alloc_blocks: int,
            disk_blocks: int, seconds: float, interval: float) -> dict[str, Any]:
    from kvpool import create_pool
    from kvpool.layout import KVLayout
    from radixkv.disk.tier import DiskTier
    from radixkv.service import KVService, ServiceConfig

    layout = KVLayout.from_preset(preset, "fp32", 16)
    bs = layout.block_size
    pool = create_pool(layout, num_blocks=pool_blocks)
    pool.numpy_view().fill(0)  # touched, as a running service's pool is
    tier = DiskTier(pool, directory, disk_blocks)
    svc = KVService(pool, ServiceConfig(lease_ttl_s=600), tier=tier)
    hot = _tokens(0, HOT_BLOCKS, bs)
    r = svc.allocate("b", None, "hot", HOT_BLOCKS, starts_sequence=True)
    svc.insert("b", r.lease_id, "hot", hot, r.block_ids)  # the lease stays: pinned
    n = 0

    def demote_once(timed: list[float] | None = None) -> None:
        nonlocal n
        n += 1
        t0 = time.perf_counter()
        a = svc.allocate("b", None, "cold", alloc_blocks, starts_sequence=True)
        if timed is not None:
            timed.append(time.perf_counter() - t0)
        for b in a.block_ids:
            pool.block_bytes(b)[:] = n % 251
        svc.insert("b", a.lease_id, "cold", _tokens(n, alloc_blocks, bs), a.block_ids)
        svc.release("b", [a.lease_id])

    while svc.stats().free_blocks >= alloc_blocks:  # fill the pool with cached cold blocks
        demote_once()
    tier.flush()

    base: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=_matches, args=(svc, hot, interval, stop, base))
    t.start()
    time.sleep(min(2.0, seconds / 4))
    stop.set()
    t.join()

    before = svc.stats().disk.demoted_blocks
    loaded: list[float] = []
    allocs: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=_matches, args=(svc, hot, interval, stop, loaded))
    t.start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        demote_once(allocs)
    elapsed = time.perf_counter() - t0
    stop.set()
    t.join()
    demoted = svc.stats().disk.demoted_blocks - before
    tier.flush()
    svc.check_integrity()
    svc.close_tier(write_down=False)
    pool.close()
    lat, idle, alloc = latency_us(loaded), latency_us(base), latency_us(allocs)
    return {
        "preset": preset, "bytes_per_block": layout.bytes_per_block, "pool_blocks": pool_blocks,
        "alloc_blocks": alloc_blocks, "disk_blocks": disk_blocks, "seconds": elapsed,
        "match_interval_ms": interval * 1e3,
        "idle_match_p50_us": idle["p50"], "idle_match_p99_us": idle["p99"],
        "matches": len(loaded), "match_p50_us": lat["p50"], "match_p99_us": lat["p99"],
        "match_max_us": max(loaded, default=0.0) * 1e6,
        "allocates": len(allocs), "allocate_p50_us": alloc["p50"],
        "allocate_p99_us": alloc["p99"], "demoted_blocks_per_s": demoted / elapsed,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", help="where the tier file goes (default: a temporary directory)")
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--pool-blocks", type=int, default=320)
    p.add_argument("--alloc-blocks", type=int, default=64, help="blocks per Allocate")
    p.add_argument("--disk-blocks", type=int, default=1024, help="the tier's capacity")
    p.add_argument("--seconds", type=float, default=10.0, help="of demotion")
    p.add_argument("--match-interval-ms", type=float, default=1.0, help="between Matches due")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="rkv-demote-bench-")
    try:
        out = figures(directory, args.preset, args.pool_blocks, args.alloc_blocks,
                      args.disk_blocks, args.seconds, args.match_interval_ms / 1e3)
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    emit("demote_lock", out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
