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

Each page walks from the root to the cursor, sorting the children of the nodes on that path:
O(page + depth + fan-out x log fan-out along the path).
"""

from __future__ import annotations

from collections.abc import Iterator

from radixkv.index.node import Node
from radixkv.types import NodeView


def view(node: Node, root: Node, block_size: int) -> NodeView:
    parent_id = None if node.parent is root else node.parent.node_id
    return NodeView(node.node_id, parent_id, node.depth * block_size, node.tokens,
                    tuple(node.block_ids), node.lock_count, node.hits, node.last_access,
                    tuple(getattr(node, "window_ids", ())))


def path_of(node: Node, root: Node) -> bytes:
    """The token path from the root to the end of `node`'s edge."""
    parts = []
    while node is not root:
        parts.append(node.tokens)
        node = node.parent
    return b"".join(reversed(parts))


def _sorted_children(node: Node) -> list[Node]:
    return [node.children[k] for k in sorted(node.children)]


def nodes_after(root: Node, cursor: bytes, max_depth: int = 0) -> Iterator[tuple[Node, int]]:
    """(node, its depth in edges) for every node whose path sorts after `cursor`, in order
    (at most `max_depth` edges deep when > 0)."""
    stack: list[tuple[Node, int]] = []  # popped from the end: the next node on top
    node, at, edges = root, 0, 0
    while True:
        rest = cursor[at:]
        into: Node | None = None
        later: list[Node] = []
        for child in _sorted_children(node):
            edge = child.tokens
            if rest.startswith(edge):  # its path is a prefix of the cursor: look below it
                into = child
            elif edge > rest:
                later.append(child)
        stack.extend((c, edges + 1) for c in reversed(later))  # shallower levels go first on
        if into is None:                                         # the stack: they come last
            break
        node, at, edges = into, at + len(into.tokens), edges + 1
    while stack:
        node, depth = stack.pop()
        if max_depth and depth > max_depth:
            continue
        yield node, depth
        if not max_depth or depth < max_depth:
            stack.extend((c, depth + 1) for c in reversed(_sorted_children(node)))


def page(root: Node, block_size: int, cursor: bytes, limit: int,
         max_depth: int = 0) -> tuple[list[NodeView], bytes]:
    """Up to `limit` nodes after `cursor` (at most `max_depth` edges deep when > 0), and the
    cursor of the next page (b"" when this one is the last)."""
    out: list[NodeView] = []
    last: Node | None = None
    for node, _ in nodes_after(root, cursor, max_depth):
        if len(out) == limit:
            assert last is not None
            return out, path_of(last, root)
        out.append(view(node, root, block_size))
        last = node
    return out, b""
