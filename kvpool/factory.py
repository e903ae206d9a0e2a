"""Making a pool and mapping one: `create_pool` (the owner picks a backend and sizes the
regions) and `attach` (another process maps an exported handle)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool.base import BlockPool, PoolMapping
from kvpool.cuda import CudaBlockPool, attach_cuda
from kvpool.errors import InvalidArgument, as_index
from kvpool.handle import BACKENDS, PoolHandle
from kvpool.host import HostBlockPool, attach_host
from kvpool.layout import KVLayout
from kvpool.sizing import (
    check_window_region,
    fit_blocks,
    fit_window_blocks,
    sink_blocks_for,
    window_blocks_for,
)


def create_pool(
    layout: KVLayout,
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
    backend: str = "host",
    device: int = 0,
    name_prefix: str = "radixkv",
    sink_fraction: float = 0.125,
    num_window_blocks: int | None = None,
    window_fraction: float | None = None,
) -> BlockPool:
    """Create the owner's pool: give exactly one of `num_blocks` or `memory_bytes`.
    `device` is used by the cuda backend, `name_prefix` by the host backend. For layouts with
    sink tokens, `sink_fraction` of the blocks are sink blocks (`memory_bytes` then buys fewer
    blocks: a sink block is larger).

    Sliding-window layouts get full parts and window parts (the module notes). `num_blocks`
    is then the full parts F, and the window parts are `num_window_blocks` (default: F) or
    those that make `window_fraction` of the bytes (`window_blocks_for`); the pool has F + W
    ids. `memory_bytes` is split by `window_fraction` (default `default_window_fraction`;
    `fit_window_blocks`). Both are refused for other layouts."""
    if (num_blocks is None) == (memory_bytes is None):
        raise InvalidArgument("give exactly one of num_blocks or memory_bytes")
    if layout.is_windowed:
        n, windows = _window_counts(layout, num_blocks, memory_bytes, num_window_blocks,
                                    window_fraction)
    else:
        if num_window_blocks or window_fraction is not None:
            raise InvalidArgument(f"window parts need a sliding-window layout; {layout!r} has "
                                  "full attention on every layer")
        n = (fit_blocks(layout, memory_bytes, sink_fraction) if memory_bytes is not None
             else as_index(num_blocks, "num_blocks"))
        windows = 0
    sinks = sink_blocks_for(layout, n, sink_fraction)
    if backend == "host":
        return HostBlockPool(layout, n, name_prefix=name_prefix, num_sink_blocks=sinks,
                             num_window_blocks=windows)
    if backend == "cuda":
        return CudaBlockPool(layout, n, device=device, num_sink_blocks=sinks,
                             num_window_blocks=windows)
    raise InvalidArgument(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")


def _window_counts(layout: KVLayout, num_blocks: int | None, memory_bytes: int | None,
                   num_window_blocks: int | None, window_fraction: float | None
                   ) -> tuple[int, int]:
    """(ids, window parts) of a windowed pool from create_pool's arguments."""
    if layout.sink_tokens:
        check_window_region(layout, 2, 0, 1)  # says sinks are not supported yet
    if num_window_blocks is not None and window_fraction is not None:
        raise InvalidArgument("give num_window_blocks or window_fraction, not both")
    if memory_bytes is not None:
        if num_window_blocks is not None:
            raise InvalidArgument("with memory_bytes, size the window parts by window_fraction "
                                  "(num_window_blocks goes with num_blocks)")
        full, windows = fit_window_blocks(layout, memory_bytes, window_fraction)
        return full + windows, windows
    full = as_index(num_blocks, "num_blocks")
    if full < 1:
        raise InvalidArgument(f"num_blocks must be >= 1, got {full}")
    windows = (window_blocks_for(layout, full, window_fraction) if num_window_blocks is None
               else as_index(num_window_blocks, "num_window_blocks"))
    if windows < 1:
        raise InvalidArgument(f"num_window_blocks must be >= 1, got {windows}")
    return full + windows, windows


def attach(handle: PoolHandle | Mapping[str, Any]) -> PoolMapping:
    """Map a pool exported by `BlockPool.export()` (a PoolHandle or its `to_dict()`)."""
    if not isinstance(handle, PoolHandle):
        handle = PoolHandle.from_dict(handle)
    if handle.backend == "host":
        return attach_host(handle)
    return attach_cuda(handle)
