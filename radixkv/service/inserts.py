"""Insert: a lease's blocks committed into its namespace's tree, a batch all or nothing, the
leases it names ended after. A part of KVService (radixkv/service/service.py), which holds
the state."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from kvpool.base import BlockPool
from radixkv.index.results import InsertResult
from radixkv.protocol.errors import InvalidArgument
from radixkv.service.checks import InputChecks, hint_codes
from radixkv.service.events import EventLog
from radixkv.service.leases import Lease, LeaseTable
from radixkv.service.namespaces import Namespaces
from radixkv.service.tier import NoTier, SettlingLock


class Inserts:
    """KVService's Insert calls (the service's state, as KVService.__init__ sets it)."""

    pool: BlockPool
    events: EventLog
    _lock: SettlingLock
    _checks: InputChecks
    _namespaces: Namespaces
    _leases: LeaseTable
    _tier: NoTier
    _end_lease: Callable[..., int]
    _get_lease: Callable[[str, int], Lease]

    def insert(
        self, owner: str, lease_id: int, namespace: str, tokens: bytes, block_ids: Sequence[int],
        hint: str | int | None = None, window_ids: Sequence[int] = (), key_size: int = 0,
    ) -> InsertResult:
        """Commit `block_ids` (one per full block of `tokens`) into the namespace's tree. Each
        id must be leased to `lease_id` or be the id the tree already holds at that position.
        Prefixes already cached are not adopted: those leased blocks return to the free list.
        `hint`: a retention hint for the node where `tokens` end (RadixTree.hint).
        `window_ids` (windowed pools): the window parts of the last len(window_ids) blocks,
        each leased to the lease or the one cached there. `key_size`: `tokens` are block keys
        of this size, one per block id (a key-keyed namespace)."""
        return self.insert_many(owner, [(lease_id, namespace, tokens, block_ids)],
                                hints=[hint], window_ids=[window_ids],
                                key_sizes=[key_size] if key_size else None)[0][0]

    def insert_many(
        self, owner: str, items: Sequence[tuple[int, str, bytes, Sequence[int]]],
        release: Collection[int] = (), hints: Sequence[str | int | None] | None = None,
        window_ids: Sequence[Sequence[int]] | None = None,
        key_sizes: Sequence[int] | None = None,
    ) -> tuple[list[InsertResult], dict[int, int]]:
        """`insert` for each (lease_id, namespace, tokens, block_ids), all or nothing: every
        item is checked against the state before the first one is applied, and a block id may
        be claimed by one item only. Then the leases in `release` (ids of these items) end as
        `release` ends them. `hints`: None or one retention hint per item; `window_ids`: None
        or each item's window parts (`insert`); `key_sizes`: None or each item's key size (0:
        tokens). Returns the results and {released lease id: blocks freed}."""
        codes = hint_codes(hints, len(items))
        wins: Sequence[Sequence[int]] = window_ids or [()] * len(items)
        if len(wins) != len(items):
            raise InvalidArgument(f"{len(wins)} window-part lists for {len(items)} items")
        sizes = self._key_sizes(key_sizes, len(items))
        for (_, namespace, tokens, block_ids), w, key_size in zip(items, wins, sizes,
                                                                 strict=True):
            self._checks.insert(namespace, tokens, block_ids, w, key_size)
        with self._lock:
            leases = [self._get_lease(owner, lease_id) for lease_id, *_ in items]
            self._namespaces.check_kinds(
                (lease.namespace, size) for lease, size in zip(leases, sizes, strict=True))
            claimed: set[int] = set()
            for lease, (_, namespace, tokens, block_ids), w in zip(leases, items, wins,
                                                                  strict=True):
                self._leases.check_namespace(lease, namespace)
                for b, what in self._namespaces[namespace].check_claims(lease, tokens, block_ids,
                                                                        w, claimed):
                    self._leases.claim(lease, b, claimed, what, self.pool.is_free(b))
            if not {lease.lease_id for lease in leases}.issuperset(release):
                raise InvalidArgument("an insert can only release the leases of its items")
            ending = set(release)
            results = [self._apply_insert(lease, tokens, block_ids,
                                          pin=lease.lease_id not in ending, hint=code,
                                          window_ids=w)
                       for lease, (_, _, tokens, block_ids), code, w
                       in zip(leases, items, codes, wins, strict=True)]
            freed = {lid: self._end_lease(self._leases.find(lid))
                     for lid in dict.fromkeys(release)}
            return results, freed

    def _apply_insert(self, lease: Lease, tokens: bytes, block_ids: Sequence[int],
                      pin: bool, hint: int, window_ids: Sequence[int]) -> InsertResult:
        ns = self._namespaces[lease.namespace]
        self._leases.touch(lease)
        result = ns.insert(lease, tokens, block_ids, hint, window_ids, pin)
        if ns.tiered:
            self._tier.inserted(ns.name, tokens, block_ids, result)
        if result.duplicates:
            self.pool.free(list(result.duplicates))
        self.events.publish(ns.name, ns.tree.take_events(), ns.key_size)
        return result

    @staticmethod
    def _key_sizes(key_sizes: Sequence[int] | None, count: int) -> Sequence[int]:
        if key_sizes is None:
            return [0] * count
        if len(key_sizes) != count:
            raise InvalidArgument(f"{len(key_sizes)} key sizes for {count} items")
        return key_sizes
