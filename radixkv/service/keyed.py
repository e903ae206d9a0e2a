"""The key-keyed kind of namespace: blocks named by opaque fixed-size keys, not token ids.

Engines such as SGLang's HiCache know a block only by its key (a SHA-256 chain hash of the
block's tokens and everything before it). A key-keyed namespace holds such sequences of keys in
the same radix tree as token prefixes: the tree sees each key as key_size / 4 uint32 symbols,
so one key is one tree block, and match, insert, leases, eviction and events work unchanged.
Each key stands for one pool block of block_size tokens, so the token figures (num_tokens of a
match, hit and query tokens, depth in a tree dump) count keys x block_size.

A namespace is key-keyed (with one key size) or token-keyed from its first call on
(`Namespaces.open`); a call of the other kind is a FailedPrecondition. Key-keyed namespaces
live on full-attention pools only (a window part needs token positions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from radixkv.index.eviction import EvictionPolicy
from radixkv.index.results import InsertResult, MatchResult, NodeView
from radixkv.index.tree import RadixTree
from radixkv.protocol.tokens import TOKEN_BYTES
from radixkv.protocol.values import LeaseMatch, NamespaceStats
from radixkv.service.kinds import Counters, Namespace
from radixkv.service.leases import Lease


class KeyNamespace(Namespace):
    """A namespace whose blocks are named by `key_size`-byte keys."""

    tiered = False  # a slot's chain hash and its restart check are over token ids

    def __init__(self, name: str, block_size: int, key_size: int,
                 policy: EvictionPolicy[Any], clock: Callable[[], int]) -> None:
        self.name = name
        self.block_size = block_size  # tokens a key stands for (the pool's block size)
        self.key_size = key_size
        self.units = key_size // TOKEN_BYTES  # tree symbols per key
        self.tree = RadixTree(self.units, policy, clock=clock)
        self.num_leases = 0
        self.life = Counters()

    def num_keys(self, keys: bytes) -> int:
        return len(keys) // self.key_size

    def span(self, keys: bytes) -> int:
        return self.num_keys(keys) * self.block_size

    def blocks_to_store(self, keys: bytes, store_tokens: int) -> int:
        return min(store_tokens // self.block_size, self.num_keys(keys))

    def match(self, lease: Lease, keys: bytes) -> MatchResult:
        m = self.tree.match(keys)
        if m.block_ids:
            self.tree.lock(m.handle)
            self._pin(lease, m.handle)
        self.life.requests += 1
        self.life.query_tokens += self.span(keys)
        self.life.hit_tokens += len(m.block_ids) * self.block_size
        return m

    def answer(self, lease_id: int, m: MatchResult, epoch: str) -> LeaseMatch:
        return LeaseMatch(lease_id, len(m.block_ids) * self.block_size, m.block_ids, epoch)

    def insert(self, lease: Lease, keys: bytes, block_ids: Sequence[int], hint: int,
               window_ids: Sequence[int], pin: bool) -> InsertResult:
        result = super().insert(lease, keys, block_ids, hint, window_ids, pin)
        cached = result.num_cached_tokens // self.units * self.block_size
        return dataclasses.replace(result, num_cached_tokens=cached)

    def stats(self) -> NamespaceStats:
        return dataclasses.replace(super().stats(), key_size=self.key_size)

    def nodes(self, max_depth: int = 0) -> list[NodeView]:
        """The tree's nodes with their keys (`keys`, not `tokens`) and depths in tokens."""
        return [dataclasses.replace(n, tokens=b"", keys=n.tokens,
                                    depth_tokens=n.depth_tokens // self.units * self.block_size)
                for n in super().nodes(max_depth)]

    def shown(self, nodes: list[NodeView]) -> list[NodeView]:
        """Paged nodes (depths already in tokens) with their keys, not tokens."""
        return [dataclasses.replace(n, tokens=b"", keys=n.tokens) for n in nodes]

    @property
    def cursor_unit(self) -> tuple[int, str]:
        """A tree-dump cursor is a path of whole keys."""
        return self.key_size, f"{self.key_size}-byte keys"
