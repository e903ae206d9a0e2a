"""The radix tree's nodes, match handles and depth counts: internal to radixkv.index (the tree
and its windowed subclass build and walk them); nothing outside the index holds one."""

from __future__ import annotations

from collections.abc import Sequence

from sortedcontainers import SortedList

from radixkv.index.hints import NO_HINT

WIDE = 32  # children past which a node, once a tree dump asks, keeps its child keys sorted


class Node:
    __slots__ = (
        "node_id",
        "parent",
        "children",
        "tokens",
        "block_ids",
        "depth",
        "lock_count",
        "hits",
        "tick",
        "last_access",
        "hint",
        "promoted",
        "ends",
        "order",
    )

    def __init__(
        self,
        node_id: int,
        parent: Node | None,
        tokens: bytes,
        block_ids: tuple[int, ...],
        depth: int,
        tick: int,
        now: float,
    ) -> None:
        self.node_id = node_id
        self.parent: Node = parent if parent is not None else self  # the root is its own parent
        self.children: dict[bytes, Node] = {}
        self.tokens = tokens
        self.block_ids = block_ids
        self.depth = depth  # blocks from the root to the end of this edge
        self.lock_count = 0
        self.hits = 0
        self.tick = tick
        self.last_access = now
        self.hint = NO_HINT  # the client's retention hint, until the next hit
        self.promoted = False  # the policy's own mark
        self.ends = 0  # requests whose prompt ended exactly here
        self.order: SortedList | None = None  # the child keys in byte order (sorted_keys)


def add_child(node: Node, key: bytes, child: Node) -> None:
    node.children[key] = child
    if node.order is not None:
        node.order.add(key)


def drop_child(node: Node, key: bytes) -> None:
    del node.children[key]
    if node.order is not None:
        node.order.remove(key)


def sorted_keys(node: Node) -> Sequence[bytes]:
    """`node`'s child keys in byte order. A wide node keeps them sorted from the first time this
    is asked (add_child and drop_child keep the order), so a tree dump finds its place among
    100,000 children in O(log n), not by scanning them all."""
    if node.order is None and len(node.children) > WIDE:
        node.order = SortedList(node.children)
    keys: Sequence[bytes] = node.order if node.order is not None else sorted(node.children)
    return keys


class Handle:
    """Behind MatchResult.handle: the deepest matched node and how many of its blocks matched.
    lock() splits that node if needed and re-points `node` at the exact end of the match; a split
    keeps the deeper half in the old node object, so a locked handle stays exact."""

    __slots__ = ("tree", "node", "num_blocks", "version", "num_locks")

    def __init__(self, tree: object, node: Node, num_blocks: int, version: int) -> None:
        self.tree, self.node, self.num_blocks, self.version = tree, node, num_blocks, version
        self.num_locks = 0


class DepthCounts:
    """How many nodes end at each depth (in blocks), kept incrementally: the tree's max depth."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts = [0]  # [d] = nodes whose edge ends d blocks deep; no trailing zeros

    @property
    def max_depth(self) -> int:
        return len(self.counts) - 1

    def add(self, depth: int) -> None:
        counts = self.counts
        if depth >= len(counts):
            counts.extend([0] * (depth + 1 - len(counts)))
        counts[depth] += 1

    def drop(self, depth: int) -> None:
        counts = self.counts
        counts[depth] -= 1
        while len(counts) > 1 and counts[-1] == 0:
            counts.pop()
