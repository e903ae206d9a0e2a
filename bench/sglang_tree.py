"""`bench/tree_replay.py --sglang`: the same workload through radixkv's tree and SGLang's compiled
Rust radix tree (the TreeCore of sglang.srt.mem_cache.rust_tree_core, driven by
bench/_sglang_tree_worker.py in .venv-sglang's python), alternating the two round by round.

Both replays follow radixkv.replay.simulate's steps with the same block (page) size, capacity,
free list and eviction policy, and time the same calls: `match` is the call that returns the
matched prefix's KV ids (radixkv: `tree.match`; SGLang: `match_prefix` then
`collect_full_device_indices`, as its cache does), `insert` the insert of the prompt's full blocks.
SGLang's `match_prefix` with its params' construction (no ids: what its adapter calls) is
reported beside it as `match_call`, and the bare `match_prefix` call as `match_walk`. A figure
is the median over the rounds; a ratio is radixkv / SGLang (below 1: radixkv is faster / lower).
Without .venv-sglang (scripts/bootstrap_sglang makes it) the comparison is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO

from radixkv.replay.simulate import ReplayResult, replay_tree
from radixkv.replay.workload import Request

SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
WORKER = Path(__file__).resolve().parent / "_sglang_tree_worker.py"
POLICIES = ("lru", "lfu")  # the eviction policies both trees have


def unavailable(policy: str) -> str | None:
    """Why the comparison cannot run here, or None."""
    if not SGLANG_PYTHON.exists():
        return f"{SGLANG_PYTHON} is missing (scripts/bootstrap_sglang makes it)"
    if policy not in POLICIES:
        return f"policy {policy!r}: SGLang's tree has {', '.join(POLICIES)} in common"
    return None


def _write_workload(requests: Sequence[Request], path: Path) -> None:
    arrays = [np.frombuffer(r.tokens, dtype="<u4") for r in requests]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(a) for a in arrays])
    np.savez(path, tokens=np.concatenate(arrays) if arrays else np.zeros(0, np.uint32),
             offsets=offsets)


def _figures(match: float, insert: float, rps: float, hit: float) -> dict[str, float]:
    return {"match_p50_us": match, "insert_p50_us": insert, "requests_per_s": rps,
            "token_hit_rate": hit}


def against_sglang(requests: Sequence[Request], block_size: int, capacity_blocks: int,
                   policy: str, warmup: int, rounds: int) -> dict[str, Any]:
    """Alternate `rounds` replays of `requests` through each tree (the order flips every round);
    {"available": False, "reason"} when SGLang's tree cannot run here."""
    reason = unavailable(policy)
    if reason is not None:
        return {"available": False, "reason": reason}
    with tempfile.TemporaryDirectory(prefix="radixkv-sglang-tree-") as tmp:
        path = Path(tmp) / "workload.npz"
        _write_workload(requests, path)
        worker = subprocess.Popen(
            [str(SGLANG_PYTHON), str(WORKER), str(path), str(block_size), str(capacity_blocks),
             policy, str(warmup)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdin is not None and worker.stdout is not None
            ready = worker.stdout.readline()
            if not ready:
                return {"available": False,
                        "reason": f"the worker exited ({worker.wait()}) before it was ready"}
            version = json.loads(ready)["sglang"]
            mine: list[ReplayResult] = []
            theirs: list[dict[str, Any]] = []
            for i in range(rounds):
                for side in ("radixkv", "sglang")[:: 1 if i % 2 == 0 else -1]:
                    if side == "radixkv":
                        replay_tree(requests[:warmup], block_size, capacity_blocks, policy)
                        mine.append(replay_tree(requests, block_size, capacity_blocks, policy))
                    else:
                        worker.stdin.write("replay\n")
                        worker.stdin.flush()
                        line = worker.stdout.readline()
                        if not line:
                            raise SystemExit(f"the SGLang tree worker exited ({worker.wait()})")
                        theirs.append(json.loads(line))
        finally:
            if worker.stdin is not None:
                worker.stdin.close()
            worker.wait(timeout=60)
    med = lambda xs: float(np.median(xs))  # noqa: E731
    a = _figures(med([r.match_us.p50 for r in mine]), med([r.insert_us.p50 for r in mine]),
                 med([r.requests_per_s for r in mine]), mine[0].token_hit_rate)
    b = _figures(med([r["match_us"]["p50"] for r in theirs]),
                 med([r["insert_us"]["p50"] for r in theirs]),
                 med([r["requests_per_s"] for r in theirs]), theirs[0]["token_hit_rate"])
    walk = med([r["match_walk_us"]["p50"] for r in theirs])
    call = med([r["match_call_us"]["p50"] for r in theirs])
    return {"available": True, "sglang_version": version, "rounds": rounds, "policy": policy,
            "load_avg_1m": os.getloadavg()[0],  # the machine may be shared: say how busy
            "radixkv": a, "sglang": b | {"match_call_p50_us": call, "match_walk_p50_us": walk,
                                         "evicted_blocks": theirs[0]["evicted_blocks"]},
            "radixkv_evicted_blocks": mine[0].num_evicted_blocks,
            "ratio": {"match_p50": a["match_p50_us"] / b["match_p50_us"],
                      "match_p50_over_call": a["match_p50_us"] / call,
                      "match_p50_over_walk": a["match_p50_us"] / walk,
                      "insert_p50": a["insert_p50_us"] / b["insert_p50_us"],
                      "requests_per_s": a["requests_per_s"] / b["requests_per_s"]}}


def print_table(r: dict[str, Any]) -> None:
    """The side-by-side figures, or why there are none."""
    if not r["available"]:
        print(f"SGLang's tree: not compared: {r['reason']}")
        return
    a, b, q = r["radixkv"], r["sglang"], r["ratio"]
    print(f"radixkv vs SGLang {r['sglang_version']} Rust tree, policy {r['policy']}, "
          f"median of {r['rounds']} alternating rounds")
    print(f"{'':24}{'radixkv':>12}{'SGLang':>12}{'radixkv/SGLang':>16}")
    print(f"{'match p50 (us)':24}{a['match_p50_us']:12.2f}{b['match_p50_us']:12.2f}"
          f"{q['match_p50']:16.2f}")
    print(f"{'  SGLang without ids':24}{'':12}{b['match_call_p50_us']:12.2f}"
          f"{q['match_p50_over_call']:16.2f}")
    print(f"{'  SGLang bare walk':24}{'':12}{b['match_walk_p50_us']:12.2f}"
          f"{q['match_p50_over_walk']:16.2f}")
    print(f"{'insert p50 (us)':24}{a['insert_p50_us']:12.2f}{b['insert_p50_us']:12.2f}"
          f"{q['insert_p50']:16.2f}")
    print(f"{'requests / s':24}{a['requests_per_s']:12,.0f}{b['requests_per_s']:12,.0f}"
          f"{q['requests_per_s']:16.2f}")
    print(f"{'token hit rate':24}{a['token_hit_rate']:12.2%}{b['token_hit_rate']:12.2%}")
