"""What the radix tree (radixkv.index.tree) hands out: match and insert results, the events
its mutations queue, its counters and node snapshots. Frozen; no reference into the tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixkv.protocol.values import InsertResult, NodeView

__all__ = ["BlockRemoved", "BlockStored", "InsertResult", "MatchResult", "NodeView", "TreeEvent",
           "TreeStats", "WindowRemoved", "WindowStored", "new_match_result"]


@dataclass(frozen=True, slots=True)
class MatchResult:
    num_tokens: int  # a multiple of block_size
    block_ids: tuple[int, ...]  # the blocks holding those tokens, in order
    handle: object  # opaque; pass to lock() before the next mutating call


_new_object = object.__new__
_slots: dict[str, Any] = dict(MatchResult.__dict__)
_set_num_tokens, _set_block_ids, _set_handle = (
    _slots[name].__set__ for name in ("num_tokens", "block_ids", "handle"))


def new_match_result(num_tokens: int, block_ids: tuple[int, ...], handle: object) -> MatchResult:
    """MatchResult(num_tokens, block_ids, handle), built through its slots' descriptors: the
    same frozen object in half the time of the generated __init__ (three object.__setattr__
    calls by name), which is a tenth of a whole match."""
    result: MatchResult = _new_object(MatchResult)
    _set_num_tokens(result, num_tokens)
    _set_block_ids(result, block_ids)
    _set_handle(result, handle)
    return result


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_ids: tuple[int, ...]
    parent_block_id: int | None  # block just before block_ids[0]; None at the root
    tokens: bytes  # exactly the tokens of block_ids


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WindowStored:
    """Windowed trees (radixkv.index.window_tree): positions that gained a window part."""

    block_ids: tuple[int, ...]  # the positions' full parts
    window_ids: tuple[int, ...]  # their window parts, in the same order


@dataclass(frozen=True, slots=True)
class WindowRemoved:
    """Windowed trees: positions whose window part was freed (their full part stays unless a
    BlockRemoved names it)."""

    block_ids: tuple[int, ...]
    window_ids: tuple[int, ...]


TreeEvent = BlockStored | BlockRemoved | WindowStored | WindowRemoved


@dataclass(frozen=True, slots=True)
class TreeStats:
    num_nodes: int
    num_cached_blocks: int
    num_locked_blocks: int
    num_evictable_blocks: int
    num_evicted_blocks: int  # since creation
    num_inserted_blocks: int  # since creation
    max_depth_blocks: int
