"""Insert: a lease's blocks committed into its namespace's tree, a batch all or nothing, the
leases it names ended after. A part of KVService (radixkv/service/service.py), which holds
the state."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from kvpool.base import BlockPool
from radixkv.index.hints import parse_hint
from radixkv.index.results import InsertResult
from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.values import InsertItem
from radixkv.service.checks import InputChecks
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
        return self.insert_many(owner, [InsertItem(lease_id, namespace, tokens, block_ids, hint,
                                                   window_ids, key_size)])[0][0]

    def insert_many(self, owner: str, items: Sequence[InsertItem], release: Collection[int] = (),
                    ) -> tuple[list[InsertResult], dict[int, int]]:
        """`insert` for each item, all or nothing: every item is checked against the state
        before the first one is applied, and a block id may be claimed by one item only. Then
        the leases in `release` (ids of these items) end as `release` ends them. Returns the
        results and {released lease id: blocks freed}."""
        codes = [parse_hint(item.hint) for item in items]
        for item in items:
            self._checks.insert(item.namespace, item.tokens, item.block_ids, item.window_ids,
                                item.key_size)
        with self._lock:
            leases = [self._get_lease(owner, item.lease_id) for item in items]
            self._namespaces.check_kinds(
                (lease.namespace, item.key_size) for lease, item in zip(leases, items, strict=True))
            claimed: set[int] = set()
            for lease, item in zip(leases, items, strict=True):
                self._leases.check_namespace(lease, item.namespace)
                for b, what in self._namespaces[item.namespace].check_claims(
                        lease, item.tokens, item.block_ids, item.window_ids, claimed):
                    self._leases.claim(lease, b, claimed, what, self.pool.is_free(b))
            if not {lease.lease_id for lease in leases}.issuperset(release):
                raise InvalidArgument("an insert can only release the leases of its items")
            ending = set(release)
            results = [self._apply_insert(lease, item, code, pin=lease.lease_id not in ending)
                       for lease, item, code in zip(leases, items, codes, strict=True)]
            freed = {lid: self._end_lease(self._leases.find(lid))
                     for lid in dict.fromkeys(release)}
            return results, freed

    def _apply_insert(self, lease: Lease, item: InsertItem, hint: int, pin: bool) -> InsertResult:
        ns = self._namespaces[lease.namespace]
        self._leases.touch(lease)
        result = ns.insert(lease, item.tokens, item.block_ids, hint, item.window_ids, pin)
        if ns.tiered:
            self._tier.inserted(ns.name, item.tokens, item.block_ids, result)
        if result.duplicates:
            self.pool.free(list(result.duplicates))
        self.events.publish(ns.name, ns.tree.take_events(), ns.key_size)
        return result
