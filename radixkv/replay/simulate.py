"""Replay a workload against a bare RadixTree, as one engine would: hit rate and tree latency.

Per request, in trace order (a service-level replay that does the same, one request at a time,
gets the same hits):

1. `m = tree.match(tokens)`; `tree.lock(m.handle)`. The request's hit tokens are m.num_tokens.
2. `need` = full blocks of the prompt - matched blocks. The pool is a free list of
   `capacity_blocks` ids (0, 1, ... first; freed ids are reused last-in first-out). If it holds
   fewer than `need`, `tree.evict(need - free)` and the freed ids go back on the list.
3. `take = min(need, free)` ids are popped. take < need only when the locked path leaves no room
   (in a serial replay: a prompt longer than the whole capacity); then only the first `take` new
   blocks are cached and the rest are counted in `num_dropped_blocks`.
4. `tree.insert(first matched + take blocks of tokens, m.block_ids + popped ids, hint)`;
   duplicates (none in a serial replay) go back on the free list. `hint` is the request's
   retention hint when the replay is given them (radixkv.replay.hints), else none.
5. `tree.unlock(m.handle)`.

Trailing partial blocks are never cached, and output tokens are not inserted (the traces put an
answer into the next turn's prompt). `wall_s` and the latencies time steps 1-5 only, not trace
loading; `match_us` is match() alone and `insert_us` insert() alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from radixkv.index.policies import DEFAULT_POLICY, make_policy
from radixkv.index.tree import RadixTree
from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.tokens import block_bytes, num_tokens
from radixkv.replay.workload import Request


@dataclass(frozen=True, slots=True)
class LatencyUs:
    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, ns: list[int]) -> LatencyUs:
        if not ns:
            return cls(0.0, 0.0, 0.0)
        us = np.asarray(ns, dtype=np.float64) / 1e3
        p50, p99 = np.percentile(us, [50, 99])
        return cls(float(us.mean()), float(p50), float(p99))


@dataclass(frozen=True, slots=True)
class ReplayResult:
    policy: str
    block_size: int
    capacity_blocks: int
    num_requests: int
    prompt_tokens: int
    cacheable_tokens: int  # prompt tokens in full blocks
    hit_tokens: int
    token_hit_rate: float  # hit_tokens / prompt_tokens
    num_evicted_blocks: int
    num_dropped_blocks: int  # new blocks not cached for lack of room (step 3)
    peak_cached_blocks: int
    wall_s: float
    requests_per_s: float
    match_us: LatencyUs
    insert_us: LatencyUs
    per_request_hit_tokens: tuple[int, ...] | None


class _FreeList:
    """The pool as a free list of `capacity` ids: 0, 1, ... first; returned ids are reused
    last-in first-out (steps 2-3 of the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self._ids = list(range(capacity - 1, -1, -1))  # pop() from the end hands out 0, 1, ...

    def __len__(self) -> int:
        return len(self._ids)

    def take(self, n: int) -> tuple[int, ...]:
        """The next `n` ids (n <= len(self))."""
        ids = self._ids[len(self._ids) - n :][::-1]
        del self._ids[len(self._ids) - n :]
        return tuple(ids)

    def give(self, ids: Iterable[int]) -> None:
        self._ids += ids


def replay_tree(
    requests: Iterable[Request],
    block_size: int,
    capacity_blocks: int,
    policy: str = DEFAULT_POLICY,
    *,
    keep_per_request: bool = False,
    hints: Sequence[str | None] | None = None,
) -> ReplayResult:
    """Replay `requests` (one namespace) through a new tree; see the module docstring.
    `hints`: None, or one retention hint per request (client-supplied knowledge)."""
    if capacity_blocks < 0:
        raise InvalidArgument(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    tree = RadixTree(block_size, make_policy(policy, capacity_blocks), record_events=False)
    bb = block_bytes(block_size)
    free = _FreeList(capacity_blocks)
    namespace: str | None = None
    prompt_tokens = cacheable = evicted = dropped = peak = 0
    match_ns: list[int] = []
    insert_ns: list[int] = []
    per_request: list[int] = []
    clock = time.perf_counter_ns
    busy_ns = 0
    for index, req in enumerate(requests):
        if namespace is None:
            namespace = req.namespace
        elif req.namespace != namespace:
            raise InvalidArgument(
                f"replay_tree replays one namespace; got {req.namespace!r} after {namespace!r}"
            )
        tokens = req.tokens
        num_blocks = len(tokens) // bb
        t0 = clock()
        m = tree.match(tokens)  # step 1
        t1 = clock()
        tree.lock(m.handle)
        need = num_blocks - len(m.block_ids)  # step 2
        if need > len(free):
            gone = tree.evict(need - len(free))
            evicted += len(gone)
            free.give(gone)
        new_ids = free.take(min(need, len(free)))  # step 3
        t2 = clock()
        res = tree.insert(tokens[: (len(m.block_ids) + len(new_ids)) * bb],  # step 4
                          m.block_ids + new_ids, hints[index] if hints is not None else None)
        t3 = clock()
        free.give(res.duplicates)
        tree.unlock(m.handle)  # step 5
        busy_ns += clock() - t0
        match_ns.append(t1 - t0)
        insert_ns.append(t3 - t2)
        dropped += need - len(new_ids)
        peak = max(peak, tree.num_cached_blocks)
        prompt_tokens += num_tokens(tokens)
        cacheable += num_blocks * block_size
        per_request.append(m.num_tokens)
    hits = sum(per_request)
    wall_s = busy_ns / 1e9
    return ReplayResult(
        policy=policy,
        block_size=block_size,
        capacity_blocks=capacity_blocks,
        num_requests=len(per_request),
        prompt_tokens=prompt_tokens,
        cacheable_tokens=cacheable,
        hit_tokens=hits,
        token_hit_rate=hits / prompt_tokens if prompt_tokens else 0.0,
        num_evicted_blocks=evicted,
        num_dropped_blocks=dropped,
        peak_cached_blocks=peak,
        wall_s=wall_s,
        requests_per_s=len(per_request) / wall_s if wall_s else 0.0,
        match_us=LatencyUs.of(match_ns),
        insert_us=LatencyUs.of(insert_ns),
        per_request_hit_tokens=tuple(per_request) if keep_per_request else None,
    )
