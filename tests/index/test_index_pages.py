"""Reading a radix tree in pages (radixkv/index/pages.py), against a simple reference: the
tree's own node list, sorted by path. Pure: no server."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.index import node
from radixkv.index.pages import page
from radixkv.index.tree import RadixTree
from radixkv.protocol.tokens import to_token_bytes

BS = 2
BB = 4 * BS  # bytes per block

prompts = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1,
                   max_size=25)


@pytest.fixture(scope="module", autouse=True, params=["narrow", "wide"])
def child_order(request):
    """Each test twice: as nodes of a few children are read (sorted when asked), and as wide
    ones are (child keys kept in a sorted list from the first dump, through every change)."""
    wide = node.WIDE
    node.WIDE = wide if request.param == "narrow" else 0
    yield
    node.WIDE = wide


def block_paths(tree: RadixTree) -> dict[int, list[bytes]]:
    """node id -> the path from the root to the end of each of its blocks (a block's
    identity: its whole prefix)."""
    path: dict[int | None, bytes] = {None: b""}
    out = {}
    for n in tree.nodes():
        start = path[n.parent_id]
        path[n.node_id] = start + n.tokens
        out[n.node_id] = [start + n.tokens[:(i + 1) * BB] for i in range(len(n.block_ids))]
    return out


def insert(tree: RadixTree, blocks: list[int], next_id: int) -> int:
    tokens = to_token_bytes([b for b in blocks for _ in range(BS)])
    m = tree.match(tokens)
    new = len(blocks) - len(m.block_ids)
    tree.insert(tokens, list(m.block_ids) + list(range(next_id, next_id + new)))
    return next_id + new


@settings(max_examples=80, deadline=None)
@given(prompts, st.integers(1, 6), st.integers(0, 4))
def test_pages_of_a_still_tree_are_its_nodes_in_path_order(ps, size, max_depth):
    tree, next_id = RadixTree(BS), 0
    for p in ps:
        next_id = insert(tree, p, next_id)
    paths = {i: bp[-1] for i, bp in block_paths(tree).items()}
    depth: dict[int | None, int] = {None: 0}
    for n in tree.nodes():
        depth[n.node_id] = depth[n.parent_id] + 1
    want = sorted((i for i in paths if not max_depth or depth[i] <= max_depth),
                  key=paths.__getitem__)
    got, cursor = [], b""
    while True:
        views, cursor = page(tree.root, BS, cursor, size, max_depth)
        assert len(views) <= size
        got += [v.node_id for v in views]
        if not cursor:
            break
        assert len(views) == size
    assert got == want


@settings(max_examples=80, deadline=None)
@given(prompts, st.lists(st.tuples(prompts, st.integers(0, 6)), max_size=12),
       st.integers(1, 4))
def test_a_block_cached_throughout_the_paging_is_in_some_page(first, changes, size):
    """Inserts (splits, new branches) and evictions between pages: every block cached from
    the first page to the last is in some page; nothing in a page was never cached."""
    tree, next_id = RadixTree(BS), 0
    for p in first:
        next_id = insert(tree, p, next_id)
    always = {b for bs in block_paths(tree).values() for b in bs}
    ever = set(always)
    seen: set[bytes] = set()
    cursor, step = b"", 0
    while True:
        now = block_paths(tree)
        views, cursor = page(tree.root, BS, cursor, size)
        for v in views:
            assert len(now[v.node_id]) == len(v.block_ids)
            seen.update(now[v.node_id])
        if not cursor:
            break
        if step < len(changes):  # change the tree between two pages
            more, evict = changes[step]
            for p in more:
                next_id = insert(tree, p, next_id)
            tree.evict(evict)
            tree.check_integrity()  # a wide node's sorted keys still match its children
            step += 1
            now = {b for bs in block_paths(tree).values() for b in bs}
            always &= now
            ever |= now
    assert always <= seen <= ever
