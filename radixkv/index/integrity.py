"""The radix tree's invariants, recomputed from scratch (radixkv.index.tree's check_integrity):
what tests call after every step and the service's integrity check runs; and the checks of the
block ids an insert is given."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.index.eviction import EvictionPolicy
from radixkv.index.node import Node
from radixkv.protocol.errors import IntegrityError, InvalidArgument
from radixkv.protocol.tokens import TOKEN_BYTES


@dataclass(frozen=True, slots=True)
class Counters:
    """What a tree keeps count of incrementally, to be checked against its nodes."""

    num_nodes: int
    num_locked: int  # blocks of nodes with a lock count > 0
    num_cached: int
    depth_counts: list[int]  # [d] = nodes whose edge ends d blocks deep; no trailing zeros


def check_tree(root: Node, block_bytes: int, held: bytearray, policy: EvictionPolicy[Any],
               counters: Counters) -> None:
    """IntegrityError naming the first invariant that fails: parent links and child keys, edge
    sizes and depths, ticks never newer than the parent's, each block cached once and marked in
    `held`, lock counts >= 0 and covering the children's, the policy holding exactly the
    unlocked leaves, and `counters` (real checks: they hold under `python -O` too)."""

    def fail(msg: str) -> None:
        raise IntegrityError(msg)

    bb = block_bytes
    if root.tokens or root.block_ids or root.parent is not root or root.lock_count:
        fail("root must hold no tokens, blocks or locks")
    seen: dict[int, Node] = {}
    num_nodes = num_locked = 0
    depth_counts = [0]
    evictable: list[Node] = []
    stack = [root]
    while stack:
        parent = stack.pop()
        child_locks = 0
        if parent.order is not None and list(parent.order) != sorted(parent.children):
            fail(f"node {parent.node_id}: sorted child keys out of step with its children")
        for key, n in parent.children.items():
            num_nodes += 1
            nid = n.node_id
            if n.parent is not parent or key != n.tokens[:bb]:
                fail(f"node {nid}: wrong parent link or child key")
            if not n.block_ids or len(n.tokens) != len(n.block_ids) * bb:
                fail(f"node {nid}: {len(n.tokens)} token bytes for {len(n.block_ids)} blocks")
            if n.depth != parent.depth + len(n.block_ids):
                fail(f"node {nid}: depth {n.depth} != parent's + {len(n.block_ids)}")
            if parent is not root and n.tick > parent.tick:
                fail(f"node {nid}: touched after its parent")
            for b in n.block_ids:
                if b in seen or not held[b]:
                    fail(f"block {b}: cached twice or missing from the block index")
                seen[b] = n
            if n.lock_count < 0:
                fail(f"node {nid}: lock count {n.lock_count} < 0")
            child_locks += n.lock_count
            num_locked += len(n.block_ids) if n.lock_count else 0
            while len(depth_counts) <= n.depth:
                depth_counts.append(0)
            depth_counts[n.depth] += 1
            if not n.children and not n.lock_count:
                evictable.append(n)
            if (n in policy) != (not n.children and not n.lock_count):
                fail(f"node {nid}: evictable-leaf index out of step")
            stack.append(n)
        if parent is not root and child_locks > parent.lock_count:
            fail(f"node {parent.node_id}: lock count {parent.lock_count} < children's sum")
    if len(seen) != counters.num_cached or held.count(1) != counters.num_cached:
        fail(f"block index has {held.count(1)} ids (counted {counters.num_cached}), "
             f"tree holds {len(seen)}")
    if len(evictable) != len(policy):
        fail(f"policy holds {len(policy)} items, {len(evictable)} evictable leaves")
    if (num_nodes, num_locked) != (counters.num_nodes, counters.num_locked):
        fail(
            f"counters (nodes, locked) {(counters.num_nodes, counters.num_locked)} "
            f"!= recomputed {(num_nodes, num_locked)}"
        )
    if depth_counts != counters.depth_counts:
        fail(f"depth counts {counters.depth_counts} != recomputed {depth_counts}")


def check_block_ids(given: Sequence[int], num_blocks: int, key_bytes: int, block_size: int) -> int:
    """InvalidArgument unless `given` holds one distinct id in [0, 2**32) per full block of a
    `key_bytes`-long token key; returns the largest (-1 for none)."""
    if len(given) != num_blocks:
        raise InvalidArgument(f"got {len(given)} block ids for {num_blocks} full blocks "
                              f"({key_bytes // TOKEN_BYTES} tokens, block_size {block_size})")
    if not given:
        return -1
    if len(set(given)) != num_blocks:
        i = next(i for i, b in enumerate(given) if b in given[:i])
        raise InvalidArgument(
            f"block id {given[i]} repeated (blocks {given.index(given[i])} and {i})")
    if min(given) < 0:
        raise InvalidArgument(f"block ids must be >= 0, got {min(given)}")
    top = max(given)
    if top >= 2**32:
        raise InvalidArgument(f"block ids must be < 2**32, got {top}")
    return top
