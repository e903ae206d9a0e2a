"""The SGLang side of `bench/tree_replay.py --sglang`, run by .venv-sglang's python: the same
workload replayed through SGLang's compiled Rust radix tree (sglang.srt.mem_cache.rust_tree_core,
the `RustUnifiedTreeCoreBinding` its UnifiedRadixCache drives), driven the way that cache drives
it, with the steps of radixkv.replay.simulate:

1. match: `match_prefix(MatchParamsBinding(key))`, then `collect_full_device_indices(last
   device node, root)`: the matched prefix's KV indices, which radixkv's match returns too
   (as block ids). `match_us` times both with the params' construction; `match_call_us` the
   params and `match_prefix` (what SGLang's adapter calls before it wraps the result, no ids);
   `match_walk_us` `match_prefix` alone. `inc_lock_ref` on the matched node.
2. need = full pages of the prompt - matched pages; short of free pages, the device eviction walk
   UnifiedRadixCache._evict_components runs (`evict_device_start`, `evict_device_next_node` /
   `evict_device_leaf` until the tracker reaches the request, `evict_device_end`); the freed
   token indices return their pages to the free list.
3. the same free list as radixkv's replay (ids 0, 1, ... first, freed ids reused last-in
   first-out); page p holds token indices p * page .. p * page + page - 1.
4. insert: `insert(InsertParamsBinding(key, value))` with the prompt's full pages and the
   matched + new pages' token indices; `insert_us` times the params and the call (the value
   tensor is built before, as the engine has it in its request-to-token table), and
   `prev_prefix_len` the matched length, as UnifiedRadixCache.cache_finished_req passes
   (the tree frees only duplicates past it).
5. `dec_lock_ref` with the lock's receipt.

    python bench/_sglang_tree_worker.py WORKLOAD.npz PAGE CAPACITY_PAGES POLICY WARMUP

WORKLOAD.npz: `tokens` (uint32, all prompts concatenated) and `offsets` (int64, n + 1).
Prints `{"ready": true, "sglang": VERSION}` once loaded, then for each line read on stdin
replays the first WARMUP requests in a fresh tree (untimed) and the whole workload in another,
and prints one JSON line with the keys of radixkv's replay (requests_per_s, match_us, ...).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.rust_tree_core.extension import bindings as B

FULL = 0  # sglang.srt.mem_cache.unified_cache.component_type.ComponentType.FULL


def stats(ns: list[int]) -> dict[str, float]:
    us = np.asarray(ns, dtype=np.float64) / 1e3
    p50, p99 = np.percentile(us, [50, 99]) if us.size else (0.0, 0.0)
    return {"mean": float(us.mean()) if us.size else 0.0, "p50": float(p50), "p99": float(p99)}


def replay(keys: list[np.ndarray], page: int, capacity: int, policy: str) -> dict[str, Any]:
    core = B.RustUnifiedTreeCoreBinding(
        B.TreeCoreInitParamsBinding(eviction_policy=policy, page_size=page, device="cpu"), [FULL])
    root = core.root_node_handle(None)
    free = list(range(capacity - 1, -1, -1))
    offs = np.arange(page, dtype=np.int64)
    clock = time.perf_counter_ns
    match_ns: list[int] = []
    walk_ns: list[int] = []
    call_ns: list[int] = []
    insert_ns: list[int] = []
    busy = hits = prompt = evicted = dropped = peak = cached = 0
    for key in keys:
        num_pages = len(key) // page
        t0 = clock()
        params = B.MatchParamsBinding(key=key)
        ta = clock()
        m = core.match_prefix(params)
        tb = clock()
        node = m.last_device_node_id
        matched = core.collect_full_device_indices(node, root)
        t1 = clock()
        lock = core.inc_lock_ref(node, [])
        have = m.device_prefix_len // page
        need = num_pages - have
        if need > len(free):
            want, got = (need - len(free)) * page, 0
            core.evict_device_start(FULL, want)
            try:
                while True:
                    nxt = core.evict_device_next_node(FULL, {FULL: got})
                    if nxt.node_id is None:
                        if not nxt.made_progress:
                            break
                        continue
                    leaf = core.evict_device_leaf(nxt.node_id)
                    got += leaf.tracker.get(FULL, 0)
                    for t in leaf.new_device_frees.get(FULL, ()):
                        free += (t[::page] // page).tolist()
            finally:
                core.evict_device_end(FULL)
            evicted += got // page
            cached -= got // page
        take = min(need, len(free))
        new = free[len(free) - take:][::-1]
        del free[len(free) - take:]
        value = torch.cat([matched[: have * page],
                           (torch.tensor(new, dtype=torch.int64)[:, None] * page
                            + torch.from_numpy(offs)).reshape(-1)])
        t2 = clock()
        res = core.insert(B.InsertParamsBinding(key=key[: (have + take) * page], value=value,
                                                 prev_prefix_len=have * page))
        t3 = clock()
        for action in res.cache_actions:  # duplicates: none in a serial replay
            if action[0] == "free_device_kv":
                for t in action[1]:
                    free += (t[::page] // page).tolist()
        core.dec_lock_ref(node, B.DecLockRefParamsBinding(
            node_id=lock.node_id, skipped_lock_components=list(lock.skipped_lock_components),
            component_lock_uuids=dict(lock.component_lock_uuids),
            component_host_lock_uuids=dict(lock.component_host_lock_uuids)))
        busy += clock() - t0
        match_ns.append(t1 - t0)
        walk_ns.append(tb - ta)
        call_ns.append(tb - t0)
        insert_ns.append(t3 - t2)
        dropped += need - take
        cached += take
        peak = max(peak, cached)
        hits += m.device_prefix_len
        prompt += len(key)
    wall = busy / 1e9
    return {"requests": len(keys), "prompt_tokens": prompt,
            "token_hit_rate": hits / prompt if prompt else 0.0,
            "evicted_blocks": evicted, "dropped_blocks": dropped, "peak_cached_blocks": peak,
            "requests_per_s": len(keys) / wall if wall else 0.0, "tree_s": wall,
            "match_us": stats(match_ns), "match_call_us": stats(call_ns),
            "match_walk_us": stats(walk_ns),
            "insert_us": stats(insert_ns)}


def main() -> int:
    path, page, capacity, policy, warmup = sys.argv[1:6]
    data = np.load(path)
    tokens, offsets = data["tokens"].astype(np.int64), data["offsets"]
    keys = [tokens[offsets[i]: offsets[i + 1]].copy() for i in range(len(offsets) - 1)]
    import sglang  # the version, for the record

    print(json.dumps({"ready": True, "sglang": sglang.__version__}), flush=True)
    for _ in sys.stdin:  # one line in, one replay (after its warm-up) out
        replay(keys[: int(warmup)], int(page), int(capacity), policy)
        print(json.dumps(replay(keys, int(page), int(capacity), policy)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
