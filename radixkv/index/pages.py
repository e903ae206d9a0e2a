"""A radix tree read in pages, each resuming after a cursor: DumpTree without building the
whole answer at once.

Order: depth-first pre-order with each node's children in the byte order of their edges, i.e.
nodes by the token path from the root to the end of their edge, compared as bytes (a prefix
first). The cursor is the path of the last node a page returned; the next page holds the
nodes whose path sorts after it, found again from the root, so the tree may change between
pages (splits, inserts, evictions) and no page depends on another:

    a block cached throughout the paging sits in some node whose path is >= the block's own
    path, and is returned by the page whose range holds that node's path (exactly once
    unless a node was split or merged across the cursor meanwhile: then once more)

Nodes cached or dropped meanwhile may or may not appear; a reader that replays the events
after the first page's sequence number ends with the tree's blocks as they are (see
radixkv/cluster/follower.py).

Each page walks from the root to the cursor and takes, at each node on the way and below, only
the children it can still return, from the node's child keys in byte order (`sorted_keys`: a
wide node keeps them sorted once asked): O(log fan-out + page) per node on the cursor's path,
so a small page is cheap even under a root of 100,000 children and the service can hand out a
page in slices, letting go of its lock between them (KVService.dump_page).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping

from sortedcontainers import SortedList

from radixkv.index.node import Node, sorted_keys
from radixkv.protocol.values import NodeView


def view(node: Node, root: Node, block_size: int,
         hashes: Mapping[int, int] | None = None) -> NodeView:
    """`node` as a NodeView; with `hashes` (block id -> chained hash), its blocks' hashes too
    (none if one is missing)."""
    parent_id = None if node.parent is root else node.parent.node_id
    block_hashes: tuple[int, ...] = ()
    if hashes is not None:
        try:
            block_hashes = tuple(map(hashes.__getitem__, node.block_ids))
        except KeyError:
            pass
    return NodeView(node.node_id, parent_id, node.depth * block_size, node.tokens,
                    tuple(node.block_ids), node.lock_count, node.hits, node.last_access,
                    tuple(getattr(node, "window_ids", ())), block_hashes)


def path_of(node: Node, root: Node) -> bytes:
    """The token path from the root to the end of `node`'s edge."""
    parts = []
    while node is not root:
        parts.append(node.tokens)
        node = node.parent
    return b"".join(reversed(parts))


def _after(node: Node, key: bytes | None, n: int) -> list[Node]:
    """The first `n` children of `node` whose keys sort after `key` (None: from the first)."""
    keys = sorted_keys(node)
    if key is None:
        i = 0
    elif isinstance(keys, SortedList):
        i = keys.bisect_right(key)
    else:
        i = bisect.bisect_right(keys, key)
    return [node.children[k] for k in keys[i:i + n]]


def nodes_after(root: Node, cursor: bytes, budget: int,
                max_depth: int = 0) -> Iterator[tuple[Node, int]]:
    """(node, its depth in edges) for the first `budget` nodes whose path sorts after
    `cursor`, in order (at most `max_depth` edges deep when > 0)."""
    stack: list[tuple[Node, int]] = []  # popped from the end: the next node on top
    node, at, edges = root, 0, 0
    bb = len(next(iter(root.children))) if root.children else 0  # bytes per block
    while node.children:
        rest = cursor[at:]
        key = rest[:bb]
        later = _after(node, key, budget)  # key < theirs
        into = None
        same = node.children.get(key)
        if same is not None:
            if rest.startswith(same.tokens):  # its path is a prefix of the cursor: go below
                into = same
            elif same.tokens > rest:  # the first after the cursor on this level
                later.insert(0, same)
        stack.extend((c, edges + 1) for c in reversed(later))  # shallower levels go first on
        if into is None:                                         # the stack: they come last
            break
        node, at, edges = into, at + len(into.tokens), edges + 1
    emitted = 0
    while stack and emitted < budget:
        node, depth = stack.pop()
        if max_depth and depth > max_depth:
            continue
        yield node, depth
        emitted += 1
        if node.children and (not max_depth or depth < max_depth):
            kids = _after(node, None, budget - emitted)
            stack.extend((c, depth + 1) for c in reversed(kids))


def page(root: Node, block_size: int, cursor: bytes, limit: int, max_depth: int = 0,
         hashes: Mapping[int, int] | None = None) -> tuple[list[NodeView], bytes]:
    """Up to `limit` nodes after `cursor` (at most `max_depth` edges deep when > 0), and the
    cursor of the next page (b"" when this one is the last); `hashes`: as `view` takes."""
    out: list[NodeView] = []
    last: Node | None = None
    for node, _ in nodes_after(root, cursor, limit + 1, max_depth):
        if len(out) == limit:
            assert last is not None
            return out, path_of(last, root)
        out.append(view(node, root, block_size, hashes))
        last = node
    return out, b""
