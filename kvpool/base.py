"""The block pool's two sides over a slab (kvpool/slab.py: the regions, views and the
engine-facing read/write):

- `BlockPool` (the owner, one per service): owns the memory and the free lists, exports a
  `PoolHandle` (kvpool/handle.py), and releases the memory on `close()`.
- `PoolMapping` (an attaching process, e.g. an engine): maps the same memory from a handle, with
  the same zero-copy views and no free list.

The backends (kvpool/host.py, kvpool/cuda.py) subclass both; `create_pool` and `attach`
(kvpool/factory.py) pick one. The pool knows no tokens, trees or leases.
"""

from __future__ import annotations

import threading
import uuid
from abc import abstractmethod
from collections import deque
from collections.abc import Iterable
from typing import Any

from kvpool.errors import IntegrityError, InvalidArgument, OutOfBlocks, as_index
from kvpool.handle import BACKENDS, PoolHandle
from kvpool.layout import KVLayout
from kvpool.sizing import check_window_region, slab_bytes
from kvpool.slab import Slab

__all__ = ["BACKENDS", "BlockPool", "PoolHandle", "PoolMapping"]


class BlockPool(Slab):
    """The owner's side: the slab plus its free lists. Not picklable; share `export()`.

    Free-list order is FIFO: `alloc` hands out the blocks freed longest ago (initially 0, 1, 2,
    ... in order), so a just-freed block is reused last. `alloc`/`free` are atomic (a lock) and
    change nothing when they raise.

    The last `num_sink_blocks` ids are the sink region (quantized layouts with sink tokens): a
    sink block can hold any block, a regular one cannot hold a sequence's first block. `alloc(n,
    sinks=s)` takes s sink blocks first, then regular ones, falling back to sink blocks (not
    with `exact`: a block whose bytes exist already needs a block of their format).

    A sliding-window layout's pool: the last `num_window_blocks` ids are window parts, the
    first `num_full_blocks` full parts (the module notes). `alloc` hands out full parts and
    `num_free` counts them, as for any pool; `alloc_window` and `num_free_window` are the
    window parts'; `free` takes both."""

    backend: str = ""

    def __init__(self, layout: KVLayout, num_blocks: int, num_sink_blocks: int = 0,
                 num_window_blocks: int = 0) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
        num_blocks = as_index(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise InvalidArgument(f"num_blocks must be >= 1, got {num_blocks}")
        num_sink_blocks = as_index(num_sink_blocks, "num_sink_blocks")
        num_window_blocks = as_index(num_window_blocks, "num_window_blocks")
        if layout.is_windowed or num_window_blocks:
            check_window_region(layout, num_blocks, num_sink_blocks, num_window_blocks)
        if not 0 <= num_sink_blocks <= num_blocks:
            raise InvalidArgument(f"num_sink_blocks {num_sink_blocks} is not within "
                                  f"0..{num_blocks}")
        if layout.sink_tokens and not num_sink_blocks:
            raise InvalidArgument(f"a layout with {layout.sink_tokens} sink tokens needs a sink "
                                  "region (num_sink_blocks >= 1)")
        if num_sink_blocks and not layout.sink_tokens:
            raise InvalidArgument("sink blocks need a layout with sink tokens")
        self._set_regions(layout, num_blocks, num_sink_blocks, num_window_blocks)
        self.epoch = uuid.uuid4().hex
        self._closed = False
        self._lock = threading.Lock()
        first = self.num_regular_blocks  # of the sink or window region
        self._free: deque[int] = deque(range(first))
        self._free_sink: deque[int] = deque(range(first, num_blocks) if num_sink_blocks else ())
        self._free_window: deque[int] = deque(range(first, num_blocks) if num_window_blocks
                                              else ())
        self._two_regions = bool(num_sink_blocks or num_window_blocks)  # `free` sorts ids
        self._is_free = bytearray(b"\x01") * num_blocks

    # --- free list -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Free blocks `alloc` can hand out (a windowed pool: full parts)."""
        return len(self._free) + len(self._free_sink)

    @property
    def num_free_sink(self) -> int:
        return len(self._free_sink)

    @property
    def num_free_window(self) -> int:
        """Free window parts (0 without a window region)."""
        return len(self._free_window)

    @property
    def num_used(self) -> int:
        """Blocks `alloc` handed out and not freed (a windowed pool: full parts)."""
        return self.num_full_blocks - self.num_free

    @property
    def slab_bytes(self) -> int:
        return slab_bytes(self.layout, self.num_blocks, self.num_sink_blocks,
                          self.num_window_blocks)

    def is_free(self, block_id: int) -> bool:
        i = as_index(block_id, "block id")
        if not 0 <= i < self.num_blocks:
            raise InvalidArgument(f"block id {i} out of range 0..{self.num_blocks - 1}")
        return bool(self._is_free[i])

    def alloc(self, n: int, sinks: int = 0, exact: bool = False) -> list[int]:
        """Take `n` >= 1 free blocks (oldest-freed first), the first `sinks` of them from the
        sink region (with `exact`, the rest from the regular region only). OutOfBlocks when
        fewer are free."""
        n = as_index(n, "n")
        sinks = as_index(sinks, "sinks")
        if n <= 0:
            raise InvalidArgument(f"alloc needs n >= 1, got {n}")
        if not 0 <= sinks <= n:
            raise InvalidArgument(f"sinks must be within 0..{n}, got {sinks}")
        if sinks and not self.num_sink_blocks:
            sinks = 0  # no sink tokens: every block can start a sequence
        with self._lock:
            self._check_open()
            if sinks > len(self._free_sink):
                raise OutOfBlocks(f"asked {sinks} sink blocks (a sequence's first block), "
                                  f"{len(self._free_sink)} free of {self.num_sink_blocks}")
            if n > self.num_free:
                raise OutOfBlocks(f"asked {n} blocks, {self.num_free} free of "
                                  f"{self.num_full_blocks}")
            if exact and n - sinks > len(self._free):
                raise OutOfBlocks(f"asked {n - sinks} regular blocks, {len(self._free)} free "
                                  f"of {self.num_regular_blocks}")
            ids = [self._free_sink.popleft() for _ in range(sinks)]
            regular = min(n - sinks, len(self._free))
            ids += [self._free.popleft() for _ in range(regular)]
            ids += [self._free_sink.popleft() for _ in range(n - sinks - regular)]
            for i in ids:
                self._is_free[i] = 0
            return ids

    def alloc_window(self, m: int) -> list[int]:
        """Take `m` >= 1 free window parts (oldest-freed first; ids num_full_blocks and up).
        OutOfBlocks when fewer are free; InvalidArgument on a pool without window parts."""
        m = as_index(m, "m")
        if m <= 0:
            raise InvalidArgument(f"alloc_window needs m >= 1, got {m}")
        if not self.num_window_blocks:
            raise InvalidArgument(f"alloc_window: {self._no_window()}")
        with self._lock:
            self._check_open()
            free = self._free_window
            if m > len(free):
                raise OutOfBlocks(f"asked {m} window parts, {len(free)} free of "
                                  f"{self.num_window_blocks}")
            ids = [free.popleft() for _ in range(m)]
            for i in ids:
                self._is_free[i] = 0
            return ids

    def is_sink(self, block_id: int) -> bool:
        return block_id >= self.num_blocks - self.num_sink_blocks

    def _release(self, ids: list[int]) -> None:
        first = self.num_regular_blocks
        other = self._free_window if self.num_window_blocks else self._free_sink
        for i in ids:
            self._is_free[i] = 1
            (other if i >= first else self._free).append(i)

    def free(self, block_ids: Iterable[int]) -> None:
        """Return allocated blocks to the tail of the free list. Ids out of range, already
        free, or repeated raise InvalidArgument, and then nothing is freed."""
        ids = list(block_ids)
        if not all(type(i) is int for i in ids):  # numpy integers and the like: checked one by one
            ids = [as_index(i, "block id") for i in ids]
        with self._lock:
            self._check_open()
            is_free = self._is_free
            if (ids and len(set(ids)) == len(ids) and 0 <= min(ids) and max(ids) < self.num_blocks
                    and not any(map(is_free.__getitem__, ids))):  # the common case, in C
                if self._two_regions:
                    self._release(ids)
                    return
                for i in ids:
                    is_free[i] = 1
                self._free.extend(ids)
                return
            seen: set[int] = set()
            for i in ids:
                if not 0 <= i < self.num_blocks:
                    raise InvalidArgument(
                        f"cannot free {len(ids)} blocks: block id {i} out of range "
                        f"0..{self.num_blocks - 1}"
                    )
                if self._is_free[i]:
                    raise InvalidArgument(
                        f"cannot free {len(ids)} blocks: block {i} is already free"
                    )
                if i in seen:
                    raise InvalidArgument(f"cannot free {len(ids)} blocks: block {i} given twice")
                seen.add(i)
            self._release(ids)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless: the free lists hold distinct in-range ids of their own
        region, exactly those marked free, so allocated == num_blocks - num_free -
        num_free_window."""
        with self._lock:
            free = list(self._free) + list(self._free_sink) + list(self._free_window)
            first = self.num_regular_blocks
            if any(i >= first for i in self._free) or any(
                    i < first for i in (*self._free_sink, *self._free_window)):
                raise IntegrityError("a block id is on the other region's free list")
            marked = sum(self._is_free)
            distinct = set(free)
            if len(distinct) != len(free):
                raise IntegrityError(f"free list holds {len(free) - len(distinct)} duplicate ids")
            bad = [i for i in free if not 0 <= i < self.num_blocks]
            if bad:
                raise IntegrityError(f"free list holds out-of-range ids {bad[:8]}")
            if marked != len(free) or any(not self._is_free[i] for i in free):
                raise IntegrityError(
                    f"free list holds {len(free)} ids but {marked} blocks are marked free"
                )

    # --- sharing ---------------------------------------------------------------------------

    @abstractmethod
    def export(self) -> PoolHandle:
        """The handle another process passes to `attach()`."""

    def describe(self) -> str:
        """The blocks in words: "1024 blocks x 1024 B", or for a windowed pool
        "16 full parts x 512 B + 16 window parts x 512 B"."""
        if not self.num_window_blocks:
            return f"{self.num_blocks} blocks x {self.layout.bytes_per_block} B"
        return (f"{self.num_full_blocks} full parts x {self.layout.full_bytes_per_block} B + "
                f"{self.num_window_blocks} window parts x {self.layout.window_bytes_per_block} B")

    def __repr__(self) -> str:
        if self._closed:
            state = "closed"
        elif self.num_window_blocks:
            state = (f"{self.num_free}/{self.num_full_blocks} + "
                     f"{self.num_free_window}/{self.num_window_blocks} free")
        else:
            state = f"{self.num_free}/{self.num_blocks} free"
        return (f"{type(self).__name__}({self.layout.dtype}, {self.describe()}, {state}, "
                f"epoch {self.epoch[:8]})")

    def __reduce__(self) -> Any:
        raise TypeError("a BlockPool cannot be pickled: pass pool.export() to other processes")


class PoolMapping(Slab):
    """An attaching process's view of a pool: same views as the owner, no free list.

    `close()` is idempotent and never unlinks or frees the owner's memory; views taken before
    it stay valid (they hold the mapping) until dropped."""

    def __init__(self, handle: PoolHandle) -> None:
        self.handle = handle
        self._set_regions(handle.layout, handle.num_blocks, handle.num_sink_blocks,
                          handle.num_window_blocks)
        self.backend = handle.backend
        self.epoch = handle.epoch
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"{type(self).__name__}({self.backend}, {self.num_blocks} blocks, {state}, "
            f"epoch {self.epoch[:8]})"
        )

