"""Making room in the pool, across namespaces, and handing the room to leases.

Every namespace's tree shares one clock and one policy state, so their victims compare: an
eviction takes the policy's first victim across all of them (the oldest tree's victims while
they stay older than the runner-up's). Two rules on top:

- the sink region: a sequence's first block comes from the pool's sink blocks (quantized pools
  keep the first tokens of every sequence at the model's precision), so a request that starts
  a sequence evicts until a sink block is free;
- window parts (sliding-window pools): unprotected window parts alone go first, oldest
  namespace's first, then whole leaves.

Evicted blocks go to the tier below the pool first (`tier.demote`; radixkv/service/tier.py), if
there is one: it copies their bytes out after the locked section (`settle`), so a block is handed
out only once no other call still copies out of it (`tier.claimed`). `take` gives a lease the blocks
made room for; `store` does both for a Match that stores the rest of its prompt (the two-trip path),
with the window parts its namespace's kind plans.
"""

from __future__ import annotations

import dataclasses

from kvpool.base import BlockPool
from radixkv.index.results import MatchResult
from radixkv.protocol.errors import OutOfBlocks
from radixkv.protocol.values import LeaseMatch
from radixkv.service.events import EventLog
from radixkv.service.kinds import Namespace
from radixkv.service.leases import Lease, LeaseTable
from radixkv.service.namespaces import Namespaces
from radixkv.service.tier import NoTier


class Reclaimer:
    def __init__(self, pool: BlockPool, namespaces: Namespaces, leases: LeaseTable,
                 events: EventLog, tier: NoTier | None = None) -> None:
        self.pool = pool
        self.tier = tier or NoTier()  # where evicted blocks go (demoted), if anywhere
        self.namespaces = namespaces
        self.leases = leases  # for the numbers of an OutOfBlocks message
        self.events = events

    def take(self, lease: Lease, num_blocks: int, sinks: int = 0,
             windows: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """`num_blocks` blocks (the first `sinks` from the sink region) and `windows` window
        parts from the pool (`make_room` made room), now the lease's."""
        ids = tuple(self.pool.alloc(num_blocks, sinks=sinks)) if num_blocks else ()
        self.tier.claimed(ids)  # (a block another call demoted is written once copied out)
        wids = tuple(self.pool.alloc_window(windows)) if windows else ()
        lease.owned.update(dict.fromkeys(ids + wids))
        return ids, wids

    def store(self, o: LeaseMatch, tokens: bytes, store_tokens: int,
              m: MatchResult) -> LeaseMatch:
        """`o` with blocks allocated for the uncached full blocks of tokens[:store_tokens] (and
        the window parts its namespace's kind plans; `m`: the tree's match behind `o`), or
        with `alloc_error` saying why there was no room."""
        lease = self.leases.find(o.lease_id)
        ns = self.namespaces[lease.namespace]
        end = ns.blocks_to_store(tokens, store_tokens)
        want = end - len(o.block_ids)
        if want <= 0:
            return o
        sinks = 0 if o.block_ids else 1  # a sequence's first block comes from the sink region
        need = ns.plan_store(o, tokens, end, m)  # blocks that get window parts
        try:
            num_evicted = self.make_room(want, sinks=sinks, windows=len(need))
        except OutOfBlocks as e:
            return dataclasses.replace(o, alloc_error=str(e))
        ids, wids = self.take(lease, want, sinks, len(need))
        return ns.stored(o, ids, wids, need, end, num_evicted)

    def make_room(self, num_blocks: int, keep: Namespace | None = None, sinks: int = 0,
                  windows: int = 0, regular: int = 0) -> int:
        """Evict until `num_blocks` are free, `sinks` of them sink blocks and `regular` of them
        regular ones (a promotion's blocks keep their format), and `windows` window parts.
        Raises OutOfBlocks, evicting nothing, when even that cannot make room (a search for a
        sink or regular block or a window part keeps what it evicted). Namespaces left empty
        are dropped, except `keep` (about to get a lease). Returns the blocks evicted."""
        evicted = 0
        if windows:
            evicted += self._evict_windows_for(windows, keep)
        pool = self.pool
        while pool.num_free_sink < min(sinks, pool.num_sink_blocks):
            try:
                evicted += self._evict_for(pool.num_free + 1, keep)  # one more block
            except OutOfBlocks:
                raise OutOfBlocks(
                    f"no sink block for a sequence's first block: all "
                    f"{pool.num_sink_blocks} are leased or pinned (serve with a larger "
                    f"--kv-sink-fraction)") from None
        while pool.num_free - pool.num_free_sink < regular:
            try:
                evicted += self._evict_for(pool.num_free + 1, keep)
            except OutOfBlocks:
                raise OutOfBlocks(
                    f"no regular block: {pool.num_free - pool.num_free_sink} free of "
                    f"{pool.num_regular_blocks}, the rest leased or pinned") from None
        return evicted + self._evict_for(num_blocks, keep)

    def _evict_windows_for(self, windows: int, keep: Namespace | None) -> int:
        """Free window parts until `windows` are: unprotected ones first (oldest namespace's
        first), then whole leaves. Returns the full parts evicted on the way."""
        pool, evicted = self.pool, 0
        for ns in list(self.namespaces):
            need = windows - pool.num_free_window
            if need <= 0:
                break
            freed = ns.evict_windows(need)
            if freed:
                pool.free(freed)
                self.events.publish(ns.name, ns.tree.take_events())
        while pool.num_free_window < windows:
            try:  # a whole leaf's tail: its window parts go with its full parts
                evicted += self._evict_for(pool.num_free + 1, keep)
            except OutOfBlocks:
                raise OutOfBlocks(
                    f"asked {windows} window parts: {pool.num_free_window} free of "
                    f"{pool.num_window_blocks}, the rest leased or pinned (serve with a larger "
                    f"--window-fraction)") from None
        return evicted

    def _evict_for(self, num_blocks: int, keep: Namespace | None) -> int:
        need = num_blocks - self.pool.num_free
        if need <= 0:
            return 0
        spaces = self.namespaces
        evictable = sum(ns.tree.num_evictable_blocks for ns in spaces)
        if evictable < need:
            raise OutOfBlocks(
                f"asked {num_blocks} blocks: {self.pool.num_free} free, {evictable} evictable, "
                f"{self.leases.leased_blocks()} leased, "
                f"{sum(ns.tree.num_locked_blocks for ns in spaces)} pinned "
                f"(pool {self.pool.num_full_blocks})")
        evicted = 0
        while evicted < need:
            keyed = sorted((key, ns.name) for ns in spaces
                           if (key := ns.tree.next_victim_key()) is not None)
            ns = spaces[keyed[0][1]]
            if len(keyed) == 1:
                freed = ns.evict(need - evicted)
            else:  # the oldest tree's victims while they stay older than the runner-up's
                freed = []  # (a leaf at a time: its blocks share one key)
                while evicted + len(freed) < need:
                    freed += ns.evict(need - evicted - len(freed), max_leaves=1)
                    key = ns.tree.next_victim_key()
                    if key is None or key > keyed[1][0]:
                        break
            demoted = ns.tiered and self.tier.present
            if demoted:
                known = self.events.block_hashes(ns.name)
                self.tier.demote(ns.name, freed, [known.get(b) for b in freed])
            self.pool.free(freed)
            events, count = ns.evicted(freed)
            self.events.publish(ns.name, events, tier="disk" if demoted else "")
            if demoted:  # after the demotion's own events: it may have dropped what it marked
                self.events.publish_dropped(self.tier.take_dropped())
            ns.life.evicted_blocks += count
            evicted += count
            if ns is not keep:
                spaces.drop_if_empty(ns)
        return evicted
