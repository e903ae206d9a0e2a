"""Sliding-window KV between radixkv's pool and a transformers cache.

A windowed layer (window W; Hugging Face convention: a query attends to itself and the W - 1
tokens before it) needs, to resume a prompt at position p, only the KV of positions
[max(0, p - W + 1), p); a full-attention layer needs [0, p). The pool keeps a cached block's
window part (the windowed layers' KV) only for the last `window_blocks` = ceil((W - 1) / B)
blocks of a match (the engine stores them for a sequence's last ceil(W / B) blocks:
`stored_window_blocks`), so the cache the engine resumes from is:

    positions   0                    p-W+1           p             n
    full        |=============== pool ===============|-- forward --|
    windowed    |0000000000000000000|===== pool =====|-- forward --|
                 zeros, never read   window parts of the last min(d, wb) matched blocks

Why this is exact: the cache is a plain DynamicCache (every layer a DynamicLayer holding
positions [0, n) from index 0), so the model's sliding mask (transformers' sdpa / eager: key
position > query position - W, key offset 0) or radixkv's attention band gives a query at
t >= p weight exactly 0 on every position before t - W + 1 >= p - W + 1. Zeros are finite, so
they add exactly 0 (finite garbage would too; NaN would not: 0 * NaN). Every attended key is
the value the model computed and the tensors have the shapes of the model's own run over
[0, n) (keys from position 0, queries a suffix), so what remains is the rounding any resumed
forward has against a whole one (fewer rows through the same matmuls): on CPU, fp32, the
logits are identical or within 3e-7 of a no-cache run.

Not DynamicCache(config=...): its DynamicSlidingWindowLayer keeps only the last W - 1
positions after a forward, and storing needs the windowed KV of whole blocks, up to
ceil((W - 1) / B) * B positions ending at a block boundary; its shorter keys also change the
attention kernels' shapes (never identical with sdpa). The price: windowed layers hold p zeros
during a request, as much memory as a full-attention model's KV; the pool, not the engine, is
where the window saves memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvpool.layout import KVLayout
from radixkv.protocol.errors import FailedPrecondition, OutOfBlocks
from radixkv.protocol.limits import HOLE

log = logging.getLogger("radixkv.engines.window_cache")


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a transformers DynamicCache, each [batch, kv_heads, seq,
    head_dim]; no copy."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # transformers < 4.56


def new_cache() -> Any:
    """An empty cache whose every layer keeps all positions (see the module doc); for windowed
    models, resumed or not, so that the no-cache baseline runs the same kernels."""
    from transformers import DynamicCache

    return DynamicCache()


def window_start(layout: KVLayout, p: int) -> int:
    """The first position a windowed layer reads to resume at p (0 without a window)."""
    if layout.sliding_window is None:
        return 0
    return max(0, p - layout.sliding_window + 1)


def _short_tail(layout: KVLayout) -> bool:
    """W - 1 is a multiple of the block size: the window parts of the last window_blocks
    blocks before p cover [p - W + 1, p) exactly, not position p - W."""
    return (layout.sliding_window is not None
            and layout.window_blocks * layout.block_size < layout.sliding_window)


def stored_window_blocks(layout: KVLayout) -> int:
    """How many of a stored sequence's last blocks get window parts: ceil(W / B). That is
    `window_blocks` (ceil((W - 1) / B), what a resume at the block boundary reads), plus one
    when W - 1 is a multiple of B, for the resume one block back that `match_length` asks of a
    fully cached block-aligned prompt. 0 without a window."""
    return layout.window_blocks + 1 if _short_tail(layout) else layout.window_blocks


def match_length(layout: KVLayout, num_tokens: int) -> int:
    """How many leading tokens of a `num_tokens` prompt to Match. The last token is always
    computed (p <= n - 1): resuming a fully cached block-aligned prompt at n - 1 reads window
    positions from n - W, one more than the window parts of its last window_blocks blocks hold
    when W - 1 is a multiple of B. Such a prompt is matched without its last token (resumed a
    block back, from the extra window part `stored_window_blocks` keeps); any other, whole."""
    if _short_tail(layout) and num_tokens % layout.block_size == 0:
        return num_tokens - 1
    return num_tokens


def resume_point(matched_tokens: int, num_tokens: int) -> int:
    """The position to resume a `num_tokens` prompt at when the first `matched_tokens` have
    cached KV: all of them, but at least one token is computed (there must be logits)."""
    return min(matched_tokens, num_tokens - 1)


def _to_cache_layout(x: torch.Tensor) -> torch.Tensor:
    """Pool layout [tokens, kv_heads, head_dim] -> cache layout [1, kv_heads, tokens,
    head_dim]."""
    return x.transpose(0, 1).unsqueeze(0)


def build_cache(layout: KVLayout, p: int, full_k: torch.Tensor, full_v: torch.Tensor,
                window_k: torch.Tensor, window_v: torch.Tensor, window_first: int,
                device: torch.device | str | None = None) -> Any:
    """A cache holding positions [0, p) from which the model continues at p.

    `full_k`/`full_v`: the full-attention layers' KV (`layout.full_layers`, in order),
    [L_full, >= p, kv_heads, head_dim] from position 0. `window_k`/`window_v`: the windowed
    layers' KV ([L_win, T, kv_heads, head_dim]) of positions window_first .. window_first + T;
    they must cover [window_start(p), p). Positions before `window_first` are zeros in the
    windowed layers (never attended: the module doc); those from `window_first` are kept.
    Reads the inputs, copies them to `device`."""
    full, windowed = layout.full_layers, layout.window_layers
    if full_k.shape[0] != len(full) or window_k.shape[0] != len(windowed):
        raise ValueError(f"KV of {full_k.shape[0]} full and {window_k.shape[0]} windowed layers "
                         f"for a layout of {len(full)} full and {len(windowed)} windowed layers")
    if p and full and full_k.shape[1] < p:
        raise ValueError(f"full-attention KV of {full_k.shape[1]} positions; resuming at {p} "
                         f"needs {p}")
    need = window_start(layout, p)
    if p and windowed and not window_first <= need <= p <= window_first + window_k.shape[1]:
        raise ValueError(f"windowed KV of positions {window_first}-"
                         f"{window_first + window_k.shape[1] - 1}; resuming at {p} needs "
                         f"{need}-{p - 1} (window {layout.sliding_window})")
    cache = new_cache()
    if not p:
        return cache
    parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, layer in enumerate(full):
        parts[layer] = full_k[i, :p].to(device), full_v[i, :p].to(device)
    kept = p - window_first  # tail positions window_first .. p - 1
    for i, layer in enumerate(windowed):
        k = window_k.new_zeros((p, *window_k.shape[2:]), device=device)
        v = window_v.new_zeros((p, *window_v.shape[2:]), device=device)
        k[window_first:], v[window_first:] = window_k[i, :kept], window_v[i, :kept]
        parts[layer] = k, v
    for layer in range(layout.num_layers):
        k, v = parts[layer]
        cache.update(_to_cache_layout(k), _to_cache_layout(v), layer)
    return cache


@dataclass(frozen=True, slots=True)
class BlockKV:
    """KV of blocks to store, in the pool's [layers, tokens, kv_heads, head_dim] layout: the
    full-attention layers' for blocks [first_block, end_block), the windowed layers' for blocks
    [window_first_block, end_block) only (empty tensors where a part has no layers)."""

    full_k: torch.Tensor
    full_v: torch.Tensor
    window_k: torch.Tensor
    window_v: torch.Tensor
    first_block: int
    window_first_block: int
    end_block: int


def extract(layout: KVLayout, cache: Any, first_block: int, end_block: int,
            window_first: int | None = None) -> BlockKV:
    """The KV a windowed pool takes for new blocks [first_block, end_block) from `cache` (one
    built by `build_cache` or `new_cache` and run forward past end_block * block_size): full
    parts of all of them, window parts of the last `stored_window_blocks` of them. The
    windowed layers' positions read are all past the resume point, so none is a zero of
    `build_cache`. `window_first` (>= first_block): window parts from that block on instead.
    Copies."""
    block = layout.block_size
    layers = cache_layers(cache)
    if len(layers) != layout.num_layers:
        raise ValueError(f"a cache of {len(layers)} layers for a layout of {layout.num_layers}")
    length = layers[0][0].shape[-2]
    if not 0 <= first_block <= end_block or end_block * block > length:
        raise ValueError(f"blocks {first_block}-{end_block - 1} of block size {block} from a "
                         f"cache of {length} positions")
    if window_first is None:
        window_first = max(first_block, end_block - stored_window_blocks(layout))
    elif not first_block <= window_first <= end_block:
        raise ValueError(f"window parts from block {window_first}, outside the new blocks "
                         f"{first_block}-{end_block - 1}")

    def stack(which: tuple[int, ...], first: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = first * block, end_block * block
        if not which:
            key = layers[0][0]
            empty = key.new_empty((0, end - start, key.shape[1], key.shape[3]))
            return empty, empty.clone()
        # cache layers are [batch 1, kv_heads, seq, head_dim]
        k = torch.stack([layers[i][0][0, :, start:end].transpose(0, 1) for i in which])
        v = torch.stack([layers[i][1][0, :, start:end].transpose(0, 1) for i in which])
        return k, v

    full_k, full_v = stack(layout.full_layers, first_block)
    window_k, window_v = stack(layout.window_layers, window_first)
    return BlockKV(full_k, full_v, window_k, window_v, first_block, window_first, end_block)


# ---- a lease on a sliding-window pool ---------------------------------------------------------

class WindowPool(Protocol):
    """What the engine uses of a sliding-window pool mapping: both parts in the engine layout
    [layers, tokens, kv_heads, head_dim], full parts of `KVLayout.full_layers`, window parts of
    `window_layers`."""

    def read(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]: ...
    def read_window(self, window_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]: ...
    def write(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None: ...
    def write_window(self, window_ids: Sequence[int], k: torch.Tensor,
                     v: torch.Tensor) -> None: ...


class WindowLease(Protocol):
    """What the engine uses of a lease on a sliding-window pool: `block_ids` are the full parts
    of the matched blocks [0, d), `window_ids` the window parts of the last min(d,
    window_blocks) of them; `allocate` gives full parts, `allocate_window` window parts, and
    `insert`'s `window_ids` belong to the last len(window_ids) blocks inserted."""

    num_tokens: int
    block_ids: tuple[int, ...]
    window_ids: tuple[int, ...]
    new_window_ids: tuple[int, ...]  # window parts the Match allocated, ending at window_end
    window_end: int

    def pool(self) -> WindowPool: ...
    def allocate(self, num_blocks: int) -> tuple[int, ...]: ...
    def allocate_window(self, num_blocks: int) -> tuple[int, ...]: ...
    def insert(self, tokens: Any, block_ids: Sequence[int], release: bool = False,
               hint: str | None = None, *, window_ids: Sequence[int] = ()) -> Any: ...


def read_cache(layout: KVLayout, lease: Any, use: int,
               device: torch.device | str | None = None) -> Any:
    """`build_cache` at `use` from a lease on a sliding-window pool (a `WindowLease`): the full
    parts of its first ceil(use / B) matched blocks, the window parts it holds (those of the
    last matched blocks). FailedPrecondition for a client that reads no window parts."""
    if not use:
        return new_cache()
    window_ids: tuple[int, ...] | None = getattr(lease, "window_ids", None)
    if window_ids is None:
        raise FailedPrecondition("the radixkv service holds a sliding-window pool but this "
                                 "client reads no window parts (lease.window_ids)")
    pool: WindowPool = lease.pool()
    block = layout.block_size
    if layout.full_layers:
        k, v = pool.read(lease.block_ids[:-(-use // block)])
    else:  # all-windowed: full parts hold no layer
        k = v = torch.empty(0, use, layout.num_kv_heads, layout.head_dim)
    window_k, window_v = pool.read_window(window_ids)
    window_first = (len(lease.block_ids) - len(window_ids)) * block
    return build_cache(layout, use, k, v, window_k, window_v, window_first, device)


def write_blocks(layout: KVLayout, pool: WindowPool, block_ids: Sequence[int],
                 window_ids: Sequence[int], blocks: BlockKV) -> None:
    """Write `blocks` (from `extract`) into a sliding-window pool: full parts into `block_ids`,
    window parts into `window_ids` (HOLE: that block's is not stored; on cuda queued:
    synchronize before Insert)."""
    if len(block_ids) != blocks.end_block - blocks.first_block or \
            len(window_ids) != blocks.end_block - blocks.window_first_block:
        raise ValueError(f"{len(block_ids)} full and {len(window_ids)} window parts for blocks "
                         f"{blocks.first_block}-{blocks.end_block - 1} (window parts from "
                         f"{blocks.window_first_block})")
    if layout.full_layers:
        pool.write(block_ids, blocks.full_k, blocks.full_v)
    at = [i for i, w in enumerate(window_ids) if w != HOLE]
    if len(at) < len(window_ids):  # only the blocks that get a part: their token rows
        block = layout.block_size
        rows = torch.tensor([i * block + t for i in at for t in range(block)],
                            device=blocks.window_k.device)
        pool.write_window([window_ids[i] for i in at], blocks.window_k.index_select(1, rows),
                          blocks.window_v.index_select(1, rows))
    elif at:
        pool.write_window(window_ids, blocks.window_k, blocks.window_v)


def store(layout: KVLayout, lease: WindowLease, tokens: list[int], cache: Any,
          sync: Callable[[], None]) -> int:
    """The engine's store on a sliding-window pool: full parts of every new block; window parts
    of the last `stored_window_blocks` (what a resume at the end reads) and of the blocks the
    Match asked for (a branch point's, so that it resumes next time); Insert ends the lease.
    `sync` completes queued copies before Insert publishes them. Returns blocks written (0:
    nothing to store, or no room: the lease is still open)."""
    have = len(lease.block_ids)
    num_full = len(tokens) // layout.block_size
    if num_full <= have:
        return 0
    given, lease.new_window_ids = lease.new_window_ids, ()  # aligned to the Match's end
    first_given = lease.window_end - len(given)
    slots = {first_given + i: w for i, w in enumerate(given)
             if w != HOLE and have <= first_given + i < num_full}
    tail = range(max(have, num_full - stored_window_blocks(layout)), num_full)
    missing = [i for i in tail if i not in slots]
    try:
        new = lease.allocate(num_full - have)
        if missing:
            slots.update(zip(missing, lease.allocate_window(len(missing)), strict=True))
    except OutOfBlocks as e:  # every block pinned by other requests: serve uncached
        log.warning("not caching %d blocks: %s", num_full - have, e)
        return 0
    first = min(slots)
    window_ids = [slots.get(i, HOLE) for i in range(first, num_full)]
    blocks = extract(layout, cache, have, num_full, window_first=first)
    write_blocks(layout, lease.pool(), new, window_ids, blocks)
    sync()
    lease.insert(tokens[:num_full * layout.block_size], lease.block_ids + new, release=True,
                 window_ids=window_ids)
    return len(new)
