"""DumpTree in pages, against a real server: every node once in path order, each page small,
each block's chained hash the one its events carried, and a tree changing between pages read
right when the events after the first page are replayed on top (what a router's follower
does)."""

from __future__ import annotations

import random

import pytest
from _server import BLOCK_SIZE, running_server, store_many

from radixkv.client import Client
from radixkv.cluster.follower import snapshot_hashes
from radixkv.protocol import errors
from radixkv.protocol.block_hashes import chain_hashes
from radixkv.service.inspection import DUMP_SLICE

NS = "chat@rev1"
B = BLOCK_SIZE


def prompt(head: int, tail: int, blocks: int = 2) -> list[int]:
    """`blocks` blocks: the first shared by every prompt of `head`, the rest `tail`'s own."""
    first = [head * 100 + i for i in range(B)]
    rest = [head * 100_000 + tail * 100 + i for i in range((blocks - 1) * B)]
    return first + rest


def paths(nodes) -> list[bytes]:
    """Each node's token path from the root (nodes: parents before children)."""
    path: dict[int | None, bytes] = {None: b""}
    out = []
    for n in nodes:
        path[n.node_id] = path[n.parent_id] + n.tokens
        out.append(path[n.node_id])
    return out


def all_pages(kv: Client, page_size: int, namespace: str = NS, max_depth: int = 0):
    pages, cursor = [], b""
    while True:
        page = kv.dump_page(namespace, cursor, page_size, max_depth)
        pages.append(page)
        if not page.next_cursor:
            return pages
        cursor = page.next_cursor


def page_hashes(pages) -> set[int]:
    return {h for p in pages for n in p.nodes for h in n.block_hashes}


def test_pages_cover_the_tree_in_path_order_with_event_hashes():
    with running_server(num_blocks=512) as s, Client(s.socket) as kv:
        rng = random.Random(1)
        store_many(kv, NS, [prompt(h, t, rng.randint(1, 4)) for h in range(12) for t in range(8)])
        whole, _ = kv.dump_tree(NS)
        pages = all_pages(kv, 7)
        assert all(len(p.nodes) <= 7 for p in pages) and len(pages) > 5
        assert all(p.next_cursor for p in pages[:-1]) and pages[-1].next_cursor == b""
        paged = [n for p in pages for n in p.nodes]
        # every node once, in path order (a prefix first)
        want = dict(zip(paths(whole), whole, strict=True))
        got_paths = [b"".join(_path_of(n, paged)) for n in paged]
        assert got_paths == sorted(want)
        assert {n.node_id for n in paged} == {n.node_id for n in whole}
        # each block's hash is the chained hash of its prefix (what events carry)
        for path_, n in zip(got_paths, paged, strict=True):
            start = len(path_) - len(n.tokens)
            parent = chain_hashes(NS, path_[:start], B)[-1] if start else None
            assert list(n.block_hashes) == chain_hashes(NS, n.tokens, B, parent)
        assert page_hashes(pages) == snapshot_hashes(NS, whole, B)
        # max_depth: only the first edges, paged as well
        shallow = [n for p in all_pages(kv, 5, max_depth=1) for n in p.nodes]
        assert [n.node_id for n in shallow] == [n.node_id for n in paged if n.parent_id is None]


def test_a_page_read_in_several_slices_of_the_lock_is_the_whole_tree_in_order():
    """A page larger than the service's lock slice (DUMP_SLICE nodes) is put together from
    several holds of the lock: on a still tree, it is exactly the tree in path order."""
    with running_server(num_blocks=1024) as s, Client(s.socket) as kv:
        store_many(kv, NS, [prompt(h, t) for h in range(4) for t in range(DUMP_SLICE)])
        whole, at = kv.dump_tree(NS)
        assert len(whole) > 3 * DUMP_SLICE
        [one] = all_pages(kv, len(whole))
        assert one.last_sequence == at and one.next_cursor == b""
        assert paths(one.nodes) == sorted(paths(whole))
        two = all_pages(kv, 2 * DUMP_SLICE + 5)
        assert [len(p.nodes) for p in two] == [2 * DUMP_SLICE + 5, len(whole) - 2 * DUMP_SLICE - 5]
        assert [n.node_id for p in two for n in p.nodes] == [n.node_id for n in one.nodes]


def _path_of(n, nodes) -> list[bytes]:
    by_id = {m.node_id: m for m in nodes}
    parts = []
    while n is not None:
        parts.append(n.tokens)
        n = by_id.get(n.parent_id) if n.parent_id is not None else None
    return parts[::-1]


def test_a_tree_changing_between_pages_is_read_right_with_the_events_after_the_first():
    with running_server(num_blocks=160) as s, Client(s.socket) as kv, \
            Client(s.socket) as writer:
        rng = random.Random(2)
        store_many(kv, NS, [prompt(h, t, rng.randint(1, 3)) for h in range(10) for t in range(5)])
        for trial in range(3):
            first = kv.dump_page(NS, b"", 6)
            pages, cursor = [first], first.next_cursor
            while cursor:
                # between pages: new prompts (splits, new branches) and, the pool being
                # small, evictions of old ones
                store_many(writer, NS, [prompt(rng.randrange(14), rng.randrange(1000),
                                               rng.randint(1, 4)) for _ in range(3)])
                pages.append(kv.dump_page(NS, cursor, 6))
                cursor = pages[-1].next_cursor
            held = page_hashes(pages)
            last = kv.stats()["event_sequence"]
            for ev in kv.events(from_sequence=first.last_sequence + 1, timeout=5):
                kind = ev.WhichOneof("kind")
                if kind == "stored":
                    held.update(ev.stored.block_hashes)
                elif kind == "removed":
                    held.difference_update(ev.removed.block_hashes)
                if ev.sequence >= last:
                    break
            whole, at = kv.dump_tree(NS)
            assert at == last, "the tree changed after the events were read"
            assert held == snapshot_hashes(NS, whole, B), f"trial {trial}"
        assert kv.stats()["evicted_blocks"] > 0, "no eviction between pages: a weaker test"


def test_bad_pages_get_precise_statuses():
    with running_server() as s, Client(s.socket) as kv:
        store_many(kv, NS, [prompt(1, 1)])
        with pytest.raises(errors.InvalidArgument, match="whole 4-token blocks"):
            kv.dump_page(NS, b"\x01\x02\x03", 10)
        with pytest.raises(errors.InvalidArgument, match="1 to 65536"):
            kv.dump_page(NS, b"", 65537)
        with pytest.raises(errors.NotFound, match="does not exist"):
            kv.dump_page("nope", b"", 10)
        # a cursor past everything: an empty last page; one before everything: all of it
        assert kv.dump_page(NS, b"\xff" * 16, 10).nodes == ()
        assert len(kv.dump_page(NS, b"\x00" * 16, 10).nodes) == 1
