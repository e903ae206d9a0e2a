"""Input checks of the service's calls, before any state is read: namespace names, token lists,
TTLs, retention hints, the ids an Insert names and the counts an Allocate asks. Each failure is
an InvalidArgument naming the value and the limit. The router imports `check_namespace` from
here (not the service)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from radixkv.index.hints import NO_HINT, parse_hint
from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.limits import HOLE, MAX_KEY_SIZE, MIN_KEY_SIZE, MIN_LEASE_TTL_S
from radixkv.protocol.tokens import TOKEN_BYTES, from_token_bytes, num_tokens

if TYPE_CHECKING:
    from kvpool.base import BlockPool
    from radixkv.service.config import ServiceConfig

MAX_NAMESPACE_LEN = 256
# Namespace names: printable ASCII without spaces ("llama3-8b@rev1", "tenant-a/chat:v2").
NAMESPACE_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))


def check_namespace(namespace: str) -> None:
    """InvalidArgument unless `namespace` is a valid name: 1-256 printable ASCII characters,
    no spaces."""
    if not namespace:
        raise InvalidArgument("namespace must not be empty")
    if len(namespace) > MAX_NAMESPACE_LEN:
        raise InvalidArgument(f"namespace is {len(namespace)} characters, "
                              f"limit {MAX_NAMESPACE_LEN}")
    if not NAMESPACE_CHARS.issuperset(namespace):
        bad = next(c for c in namespace if c not in NAMESPACE_CHARS)
        raise InvalidArgument(f"namespace {namespace!r} has {bad!r}: names are printable "
                              "ASCII without spaces")


def hint_codes(hints: Sequence[str | int | None] | None, count: int) -> list[int]:
    """One hint code per item (all NO_HINT for None); InvalidArgument on a bad one."""
    if hints is None or not len(hints):
        return [NO_HINT] * count
    if len(hints) != count:
        raise InvalidArgument(f"{len(hints)} retention hints for {count} items: give none "
                              "or one per item")
    return [parse_hint(h) for h in hints]


def key_sizes_of(sizes: Sequence[int] | None, count: int) -> Sequence[int]:
    """One key size per query (all 0, tokens, for None); InvalidArgument on a count mismatch."""
    if sizes is None:
        return [0] * count
    if len(sizes) != count:
        raise InvalidArgument(f"{len(sizes)} key sizes for {count} items")
    return sizes


class InputChecks:
    """The checks that depend on the service's limits and its pool's geometry."""

    def __init__(self, config: ServiceConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.block_size = pool.layout.block_size

    def ttl(self, ttl_s: float | None) -> float:
        """The TTL a call asked for (None or 0: the default), within [min(1 s, default), cap]:
        a lease that would expire before its answer arrives is no use to anyone."""
        if not ttl_s:
            return self.config.lease_ttl_s
        low = min(MIN_LEASE_TTL_S, self.config.lease_ttl_s)
        if not low <= ttl_s <= self.config.max_lease_ttl_s:
            raise InvalidArgument(f"lease ttl {ttl_s:g} s is outside [{low:g}, "
                                  f"{self.config.max_lease_ttl_s:g}] (the server's cap)")
        return ttl_s

    def tokens(self, tokens: bytes) -> None:
        if not tokens:
            raise InvalidArgument("empty token list")
        if len(tokens) % TOKEN_BYTES:
            raise InvalidArgument(f"tokens are {len(tokens)} bytes, not a whole number of "
                                  "little-endian uint32 ids")
        n = num_tokens(tokens)
        if n > self.config.max_tokens:
            raise InvalidArgument(f"{n} tokens, limit {self.config.max_tokens}")
        vocab = self.config.vocab_size
        if vocab is not None:
            ids = from_token_bytes(tokens)
            if int(ids.max()) >= vocab:
                i = int(np.argmax(ids >= vocab))
                raise InvalidArgument(f"token id {int(ids[i])} at index {i} is out of range "
                                      f"(vocab_size {vocab})")

    def data(self, data: bytes, key_size: int) -> None:
        """A query's tokens, or its block keys when `key_size` is not 0."""
        if key_size:
            self.keys(data, key_size)
        else:
            self.tokens(data)

    def keys(self, keys: bytes, key_size: int) -> None:
        """Block keys of a key-keyed call: key_size a multiple of 4 in 8..64, whole keys, at
        most as many as max_tokens allows blocks, on a full-attention pool."""
        if key_size % TOKEN_BYTES or not MIN_KEY_SIZE <= key_size <= MAX_KEY_SIZE:
            raise InvalidArgument(f"key_size must be a multiple of 4 in {MIN_KEY_SIZE}.."
                                  f"{MAX_KEY_SIZE} bytes, got {key_size}")
        if self.pool.layout.window_blocks:
            raise InvalidArgument("block keys on a sliding-window pool: key-keyed namespaces "
                                  "need a full-attention pool")
        if not keys:
            raise InvalidArgument("empty key list")
        if len(keys) % key_size:
            raise InvalidArgument(f"keys are {len(keys)} bytes, not a whole number of "
                                  f"{key_size}-byte keys")
        limit = self.config.max_tokens // self.block_size
        if len(keys) // key_size > limit:
            raise InvalidArgument(f"{len(keys) // key_size} keys, limit {limit} (max_tokens "
                                  f"{self.config.max_tokens} / block_size {self.block_size})")

    def allocate(self, num_blocks: int, num_window_blocks: int) -> None:
        """The counts an Allocate asks: window parts only of a windowed pool; at least one
        block unless it asks window parts; no more than the pool has."""
        pool, windows = self.pool, num_window_blocks
        if windows and not pool.layout.window_blocks:
            raise InvalidArgument("window parts asked of a pool without a sliding window")
        if not 0 <= windows <= pool.num_window_blocks:
            raise InvalidArgument(f"num_window_blocks must be in 0.."
                                  f"{pool.num_window_blocks}, got {windows}")
        if not (0 if windows else 1) <= num_blocks <= pool.num_full_blocks:
            raise InvalidArgument(
                f"num_blocks must be in 1..{pool.num_full_blocks}, got {num_blocks}")

    def insert(self, namespace: str, tokens: bytes, block_ids: Sequence[int],
               window_ids: Sequence[int] = (), key_size: int = 0) -> None:
        """One Insert item against the pool: a block id per full block (per key where
        `key_size`: then `tokens` are the keys), in range, no repeats, a sink block at
        position 0 where the pool has sinks; window parts only of a windowed pool, at most one
        per block, each a window part id (HOLE: none)."""
        check_namespace(namespace)
        self.data(tokens, key_size)
        pool = self.pool
        if key_size:
            if len(block_ids) != len(tokens) // key_size:
                raise InvalidArgument(f"{len(block_ids)} block ids for "
                                      f"{len(tokens) // key_size} keys: give one per key")
        elif len(block_ids) != num_tokens(tokens) // self.block_size:
            raise InvalidArgument(
                f"{len(block_ids)} block ids for {num_tokens(tokens) // self.block_size} full "
                f"blocks ({num_tokens(tokens)} tokens, block_size {self.block_size})")
        num_full = len(block_ids)
        if window_ids:
            if not pool.layout.window_blocks:
                raise InvalidArgument("window parts given for a pool without a sliding window")
            if len(window_ids) > num_full:
                raise InvalidArgument(f"{len(window_ids)} window parts for {num_full} full "
                                      "blocks: a window part needs its block's full part")
            real = [w for w in window_ids if w != HOLE]
            if len(set(real)) != len(real):
                raise InvalidArgument("window part ids repeat within one insert")
            for w in real:
                if not (0 <= w < pool.num_blocks and pool.is_window(w)):
                    raise InvalidArgument(f"id {w} is not a window part of this pool")
        if len(set(block_ids)) != len(block_ids):
            raise InvalidArgument("block ids repeat within one insert")
        full = pool.num_full_blocks
        if block_ids and not (0 <= min(block_ids) and max(block_ids) < full):
            b = next(b for b in block_ids if not 0 <= b < full)
            raise InvalidArgument(f"block id {b} is out of range (pool has {full} blocks"
                                  + (", then window parts)" if pool.layout.window_blocks
                                     else ")"))
        if pool.num_sink_blocks and block_ids and not pool.is_sink(block_ids[0]):
            raise InvalidArgument(
                f"block {block_ids[0]} holds position 0 but is not a sink block: this pool "
                f"keeps the first {pool.layout.sink_tokens} tokens of every sequence in "
                f"{pool.layout.model_dtype} (Allocate with starts_sequence)")
