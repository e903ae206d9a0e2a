"""The pool's byte math, for the owner, attaching processes and the tools that size a pool:
the slab's shape, strides and bytes, the sink region's share, how many blocks fit in memory, and
how a sliding-window pool splits its memory between full parts and window parts (kvpool/slab.py
describes the regions). Allocates nothing."""

from __future__ import annotations

from kvpool.errors import InvalidArgument, as_index
from kvpool.layout import KVLayout

ITEMSIZE: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def slab_shape(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    """Shape of `view()`: [num_blocks, layers, 2, block_size, kv_heads, head_dim], or
    [num_blocks, bytes_per_block] (uint8) for quantized layouts, whose blocks also hold scales."""
    if layout.is_quantized:
        return (num_blocks, layout.bytes_per_block)
    return (num_blocks, *layout.block_shape)


def slab_strides(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    """Byte strides of `view()` (C-contiguous)."""
    shape = slab_shape(layout, num_blocks)
    step = 1 if layout.is_quantized else ITEMSIZE[layout.dtype]
    strides = []
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def slab_bytes(layout: KVLayout, num_blocks: int, num_sink_blocks: int = 0,
               num_window_blocks: int = 0) -> int:
    """Bytes the blocks use: regular blocks first, then the sink region (quantized layouts with
    sink tokens: each of its blocks also carries a sequence's first tokens in the model dtype)
    or the window region (sliding-window layouts: the first num_blocks - num_window_blocks ids
    are full parts, the rest window parts)."""
    if num_window_blocks:
        return ((num_blocks - num_window_blocks) * layout.full_bytes_per_block
                + num_window_blocks * layout.window_bytes_per_block)
    return ((num_blocks - num_sink_blocks) * layout.bytes_per_block
            + num_sink_blocks * layout.sink_bytes_per_block)


def sink_blocks_for(layout: KVLayout, num_blocks: int, sink_fraction: float) -> int:
    """The sink region's share of `num_blocks` (at least 1 when the layout has sink tokens)."""
    if not layout.sink_tokens:
        return 0
    if not 0 < sink_fraction <= 1:
        raise InvalidArgument(f"sink fraction must be in (0, 1], got {sink_fraction}")
    return max(1, min(num_blocks, round(num_blocks * sink_fraction)))


def fit_blocks(layout: KVLayout, memory_bytes: int, sink_fraction: float = 0.125) -> int:
    """The most blocks (sink region included) whose slab fits in `memory_bytes`. Sliding-window
    layouts have two kinds of block: `fit_window_blocks`."""
    if layout.is_windowed:
        raise InvalidArgument("a sliding-window pool holds full parts and window parts: size "
                              "it with fit_window_blocks")
    n = num_blocks_for(layout, memory_bytes)
    if layout.sink_tokens:  # sink blocks are larger: solve, then step down to fit
        avg = layout.bytes_per_block + sink_fraction * layout.sink_bytes
        n = max(1, int(memory_bytes // avg))
        while n > 1 and slab_bytes(layout, n, sink_blocks_for(layout, n, sink_fraction)) \
                > memory_bytes:
            n -= 1
    return n


# Sizing a sliding-window pool. A full part is needed for every cached block position, a window
# part only for positions inside some sequence's last window, so the two regions are sized by
# the bytes a typical cached conversation holds in each: WINDOW_SIZING_TOKENS tokens, whose
# windowed layers keep their last `window_blocks` blocks (`KVLayout.conversation_bytes`).
WINDOW_SIZING_TOKENS = 4096
# All-windowed layouts: full parts cost nothing, so their ids are cheap; 16 per window part let
# cached sequences average 16 windows' worth of positions before ids, not memory, run out.
IDS_PER_WINDOW_PART = 16


def default_window_fraction(layout: KVLayout, tokens: int = WINDOW_SIZING_TOKENS) -> float:
    """The share of a windowed pool's memory that goes to window parts by default: the window
    parts' share of what one cached `tokens`-token conversation holds (default
    WINDOW_SIZING_TOKENS; `layout.conversation_bytes`). gemma-3-like (W 1,024, 5:1, block 16):
    64 window blocks of 40 layers against 256 full blocks of 8, 0.556; gpt-oss-like (W 128,
    alternate): 0.030; all-windowed: 1.0. InvalidArgument without a window."""
    if not layout.is_windowed:
        raise InvalidArgument(f"{layout!r} has no sliding window: its pool has no window parts")
    if not layout.full_layers:
        return 1.0
    total = layout.conversation_bytes(tokens)
    full = layout.conversation_blocks(tokens) * layout.full_bytes_per_block
    return (total - full) / total


def check_window_fraction(layout: KVLayout, window_fraction: float) -> float:
    """`window_fraction` as a float if it can size `layout`'s pool, else InvalidArgument: a
    hybrid layout needs 0 < f < 1 (both regions get memory); an all-windowed one only 1 (its
    full parts take none)."""
    if not layout.is_windowed:
        raise InvalidArgument(f"a window fraction needs a sliding-window layout; {layout!r} "
                              "has full attention on every layer")
    try:
        f = float(window_fraction)
    except (TypeError, ValueError):
        raise InvalidArgument(f"window fraction must be a number, got {window_fraction!r}"
                              ) from None
    if not layout.full_layers:
        if f != 1.0:
            raise InvalidArgument(f"window fraction {window_fraction} for an all-windowed "
                                  "layout: its full parts take no memory, so it must be 1")
        return f
    if not 0 < f < 1:
        raise InvalidArgument(f"window fraction must be between 0 and 1 (both exclusive: full "
                              f"and window parts each need memory), got {window_fraction}")
    return f


def fit_window_blocks(layout: KVLayout, memory_bytes: int,
                      window_fraction: float | None = None) -> tuple[int, int]:
    """(full parts F, window parts W) of a sliding-window pool in `memory_bytes`:
    `window_fraction` of the memory (default `default_window_fraction(layout)`) buys window
    parts, the rest full parts. All-windowed layouts: every byte buys window parts and
    F = IDS_PER_WINDOW_PART x W ids of 0 bytes. InvalidArgument when either count is 0."""
    memory_bytes = as_index(memory_bytes, "memory_bytes")
    f = check_window_fraction(layout, default_window_fraction(layout)
                              if window_fraction is None else window_fraction)
    window_bytes, full_bytes = layout.window_bytes_per_block, layout.full_bytes_per_block
    num_window = int(memory_bytes * f) // window_bytes
    if not full_bytes:
        num_full = IDS_PER_WINDOW_PART * num_window
    else:
        num_full = (memory_bytes - num_window * window_bytes) // full_bytes
    if num_window < 1 or num_full < 1:
        raise InvalidArgument(
            f"memory_bytes {memory_bytes} at window fraction {f:.3f} holds {num_full} full "
            f"parts of {full_bytes} bytes and {num_window} window parts of {window_bytes} "
            "bytes: a windowed pool needs at least one of each")
    return num_full, num_window


def window_blocks_for(layout: KVLayout, num_full_blocks: int,
                      window_fraction: float | None = None) -> int:
    """Window parts beside `num_full_blocks` full parts: as many (None), or enough that
    `window_fraction` of the pool's bytes are window parts (at least 1; all-windowed: as
    many, since any count is all of the bytes)."""
    if window_fraction is None or not layout.full_layers:
        if window_fraction is not None:
            check_window_fraction(layout, window_fraction)
        return num_full_blocks
    f = check_window_fraction(layout, window_fraction)
    full = num_full_blocks * layout.full_bytes_per_block
    return max(1, round(f / (1 - f) * full / layout.window_bytes_per_block))


def num_blocks_for(layout: KVLayout, memory_bytes: int) -> int:
    """How many whole blocks of `layout` fit in `memory_bytes`. The backend then rounds the slab
    up to its allocation granule (a page on host, 2 MiB on cuda), at most one granule more."""
    memory_bytes = as_index(memory_bytes, "memory_bytes")
    if not layout.bytes_per_block:
        raise InvalidArgument(f"{layout!r} takes 0 bytes per block: any number fits")
    n = memory_bytes // layout.bytes_per_block
    if n < 1:
        raise InvalidArgument(
            f"memory_bytes {memory_bytes} holds no block: one block is "
            f"{layout.bytes_per_block} bytes"
        )
    return n


def check_window_region(layout: KVLayout, num_blocks: int, num_sink_blocks: int,
                        num_window_blocks: int) -> None:
    """InvalidArgument unless `num_window_blocks` window parts of `num_blocks` ids suit
    `layout`: a window region needs a window, at least one id on each side, and no sinks."""
    if not layout.is_windowed:
        raise InvalidArgument(f"num_window_blocks {num_window_blocks}: {layout!r} has no "
                              "sliding window, so its pool has no window parts")
    if layout.sink_tokens or num_sink_blocks:
        raise InvalidArgument(f"sink tokens ({layout.sink_tokens}) with a sliding window are "
                              "not supported yet: a windowed pool's quantized parts keep no "
                              "sink tokens (sink_tokens=0; radixkv serve --kv-sink-tokens 0)")
    if not 0 < num_window_blocks < num_blocks:
        raise InvalidArgument(f"num_window_blocks {num_window_blocks} is not within "
                              f"1..{num_blocks - 1}: a windowed pool of {num_blocks} ids needs "
                              "at least one full part and one window part")

