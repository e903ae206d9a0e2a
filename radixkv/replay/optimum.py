"""The offline optimum of a prefix cache: Belady's MIN over prefix blocks, and the ceiling.

Input: per request, the identities of its full blocks in order (a key names a whole prefix, as a
radix-tree node does: Mooncake hash ids, or a chained hash of namespace + prefix tokens). A
request hits the longest cached run of its leading blocks.

    request r:  k0 -> k1 -> k2 -> k3          cached {k0, k1}: 2 hit blocks, k2 and k3 new

MIN evicts the cached block whose next use lies farthest in the future. Positions are counted
in the flattened sequence (request 0's blocks, then request 1's, ...), so a block's next use is
always earlier than any of its descendants' (every request using a child uses its parent first,
one position before). Hence the farthest block is always a leaf: leaf-only eviction, as the tree
must do, costs MIN nothing, the cache stays prefix-closed, and "blocks of the request that are
cached" equals "its longest cached prefix". Blocks never used again tie at infinity; the
deepest goes first, so even then only leaves go. This is MIN on the flattened block sequence
with bypass (a new block may be dropped at once), which is optimal for the number of block hits.

Capacity is checked between requests: a request's new blocks are all offered, then blocks are
evicted, farthest next use first (possibly the new ones), until at most `capacity_blocks` stay.
That is the same as offering them one at a time. Any policy the replay can run (the request's
matched path pinned, new blocks forced in or dropped when nothing is left to evict) is a valid
schedule here too, so MIN's hits are an upper bound on every policy's at that capacity, and
`ceiling()` (infinite capacity: every block seen before hits) bounds MIN.

Pure: no I/O. O(B log B) for B blocks in the trace: next uses are precomputed in one backward
pass, and the max-heap uses lazy deletion (an entry is live only while its next use is the one
stored for its key).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from radixkv.protocol.errors import InvalidArgument

NEVER = 1 << 62  # "next use" of a block that is not used again


@dataclass(frozen=True, slots=True)
class OptimumResult:
    capacity_blocks: int | None  # None: infinite (the ceiling)
    num_blocks: int  # full blocks over all requests
    hit_blocks: int
    num_evicted_blocks: int
    peak_cached_blocks: int
    per_request_hit_blocks: tuple[int, ...]


def next_uses(requests: Sequence[Sequence[Hashable]]) -> list[int]:
    """For each block in flattened order, the flattened position of its key's next occurrence
    (NEVER if none)."""
    total = sum(len(r) for r in requests)
    out = [NEVER] * total
    seen: dict[Hashable, int] = {}
    pos = total
    for keys in reversed(requests):
        for key in reversed(keys):
            pos -= 1
            out[pos] = seen.get(key, NEVER)
            seen[key] = pos
    return out


def belady(requests: Sequence[Sequence[Hashable]], capacity_blocks: int) -> OptimumResult:
    """MIN at `capacity_blocks` (see the module docstring); per-request hits in blocks."""
    if capacity_blocks < 0:
        raise InvalidArgument(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    nxt = next_uses(requests)
    # key -> its live heap entry (-next use, -depth, position, key): the max-heap pops the
    # farthest next use first and, among blocks never used again, the deepest
    cached: dict[Hashable, tuple[int, int, int, Hashable]] = {}
    heap: list[tuple[int, int, int, Hashable]] = []
    per_request: list[int] = []
    hits = evicted = peak = pos = 0
    for keys in requests:
        n = len(keys)
        h = 0
        while h < n and keys[h] in cached:
            h += 1
        for j in range(n):
            key = keys[j]
            if j < h or key not in cached:  # re-key a hit, or offer a new block
                entry = (-nxt[pos + j], -j, pos + j, key)
                cached[key] = entry
                heapq.heappush(heap, entry)
            # a cached key after the first miss (keys not prefix-chained) keeps its old entry
        pos += n
        hits += h
        per_request.append(h)
        while len(cached) > capacity_blocks:
            entry = heapq.heappop(heap)
            if cached.get(entry[3]) is entry:
                del cached[entry[3]]
                evicted += 1
        peak = max(peak, len(cached))
        if len(heap) > 2 * len(cached) + 1024:  # too many stale entries: keep the live ones
            heap = list(cached.values())
            heapq.heapify(heap)
    return OptimumResult(capacity_blocks, pos, hits, evicted, peak, tuple(per_request))


def ceiling(requests: Sequence[Sequence[Hashable]]) -> OptimumResult:
    """Infinite capacity: a block hits if its prefix was seen before."""
    seen: set[Hashable] = set()
    per_request: list[int] = []
    hits = total = 0
    for keys in requests:
        h = 0
        while h < len(keys) and keys[h] in seen:
            h += 1
        seen.update(keys)
        hits += h
        total += len(keys)
        per_request.append(h)
    return OptimumResult(None, total, hits, 0, len(seen), tuple(per_request))
