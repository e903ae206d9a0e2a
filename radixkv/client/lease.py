"""A matched prompt's lease, the engine's handle on one request (`Client.lease`)."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol

from kvpool import PoolMapping
from radixkv.protocol.errors import RadixKVError
from radixkv.protocol.values import Allocation, InsertResult, LeaseMatch


class Calls(Protocol):
    """The calls a lease makes: radixkv.client.Client's (named here, so that this module does
    not import the client that imports it)."""

    def match(self, namespace: str, tokens: Any, ttl: float = 0.0,
              store_tokens: int = 0) -> LeaseMatch: ...

    def allocate(self, num_blocks: int, lease_id: int = 0, namespace: str = "",
                 ttl: float = 0.0, starts_sequence: bool = False,
                 num_window_blocks: int = 0) -> Allocation: ...

    def insert(self, namespace: str, tokens: Any, block_ids: Sequence[int],
               lease_id: int, epoch: str = "", release: bool = False,
               hint: str | None = None, window_ids: Sequence[int] = ()) -> InsertResult: ...

    def release(self, *lease_ids: int, hint: str | None = None) -> int: ...

    def keep_alive(self, *lease_ids: int, ttl: float = 0.0) -> float: ...

    def pool_of(self, epoch: str) -> PoolMapping: ...


class Lease:
    """A matched prompt's lease: pins the cached prefix; released on exit.

    Two round trips by default: the Match also allocates `new_block_ids` for the rest of the
    prompt's full blocks (none, with `alloc_error` set, when every other block is pinned), and
    `insert(..., release=True)` ends the lease in the same call. `allocate` and a separate
    release remain for engines that need them.

    Sliding-window pools: `window_ids` are the window parts of the last matched blocks (the
    windowed layers' KV of the last min(blocks, window_blocks) blocks: all a resume needs),
    `new_window_ids` those the Match allocated, aligned to the last blocks of the stored range
    (ending at block `window_end`) with HOLE where a block needs none; `insert(...,
    window_ids=...)` commits them the same way.

    Its block ids belong to the pool epoch of its Match: `view()` maps that pool (StalePool
    if the service restarted since) and `insert` tells the service the epoch, so KV written
    into a dead pool is never cached. On a GPU pool, synchronize reads and writes before
    `insert` and `release`: once released, its blocks may be evicted and reused."""

    def __init__(self, client: Calls, namespace: str, tokens: Any, ttl: float = 0.0,
                 store_tokens: int = 0) -> None:
        self.client = client
        self.namespace = namespace
        m = client.match(namespace, tokens, ttl, store_tokens)
        self.lease_id = m.lease_id
        self.num_tokens = m.num_tokens
        self.block_ids = m.block_ids
        self.new_block_ids = m.new_block_ids
        self.window_ids: tuple[int, ...] = getattr(m, "window_ids", ())
        self.new_window_ids: tuple[int, ...] = getattr(m, "new_window_ids", ())  # HOLE: none
        self.window_end = len(m.block_ids) + len(m.new_block_ids)  # new_window_ids end here
        self.alloc_error = m.alloc_error
        self.epoch = m.epoch
        self.released = False
        self._allocated = False  # blocks after the matched ones were handed out

    def view(self) -> Any:
        """The pool's blocks as one zero-copy tensor (`PoolMapping.view()`) of this lease's
        epoch; StalePool if the service restarted since the Match."""
        return self.client.pool_of(self.epoch).view()

    def pool(self) -> PoolMapping:
        """The pool mapping of this lease's epoch (`read`/`write` blocks in any format);
        StalePool if the service restarted since the Match."""
        return self.client.pool_of(self.epoch)

    def allocate(self, num_blocks: int) -> tuple[int, ...]:
        """`num_blocks` blocks of this lease to write into: first the ones the Match already
        allocated (no call), then from an Allocate call for the rest."""
        ids, self.new_block_ids = (self.new_block_ids[:num_blocks],
                                   self.new_block_ids[num_blocks:])
        if len(ids) < num_blocks:
            first = not self.block_ids and not ids and not self._allocated
            ids += self.client.allocate(num_blocks - len(ids), lease_id=self.lease_id,
                                        starts_sequence=first).block_ids
        self._allocated = True
        return ids

    def allocate_window(self, num_windows: int) -> tuple[int, ...]:
        """`num_windows` window parts of this lease (sliding-window pools): first the ones
        the Match allocated (no call), then from an Allocate call for the rest."""
        ids, self.new_window_ids = (self.new_window_ids[:num_windows],
                                    self.new_window_ids[num_windows:])
        if len(ids) < num_windows:
            ids += self.client.allocate(0, lease_id=self.lease_id,
                                        num_window_blocks=num_windows - len(ids)).window_ids
        return ids

    def keep_alive(self, ttl: float = 0.0) -> float:
        """Renew this lease (e.g. during a long forward pass); returns the TTL granted."""
        return self.client.keep_alive(self.lease_id, ttl=ttl)

    def insert(self, tokens: Any, block_ids: Sequence[int],
               release: bool = False, hint: str | None = None,
               window_ids: Sequence[int] = ()) -> InsertResult:
        """Commit written blocks; with `release`, end the lease in the same call. `hint`: see
        `Client.release`; `window_ids`: the window parts of the last len(window_ids) blocks."""
        result = self.client.insert(self.namespace, tokens, block_ids, self.lease_id,
                                    self.epoch, release, hint, window_ids)
        self.released = self.released or release
        return result

    def release(self, hint: str | None = None) -> int:
        if self.released:
            return 0
        self.released = True
        if hint is None:  # the plain call, as before hints existed
            return self.client.release(self.lease_id)
        return self.client.release(self.lease_id, hint=hint)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.release()
        except RadixKVError:
            if exc is None:
                raise  # otherwise keep the original error; the TTL will reclaim the lease
