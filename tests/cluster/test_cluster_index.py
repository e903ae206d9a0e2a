"""The cluster-wide prefix index (radixkv/cluster/index.py) and the hashes it is keyed by: pure,
no etcd or servers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cluster.follower import snapshot_hashes
from radixkv.cluster.index import ClusterIndex
from radixkv.index.tree import RadixTree
from radixkv.index.window_tree import WindowedRadixTree
from radixkv.protocol.block_hashes import chain_hashes
from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.tokens import to_token_bytes
from radixkv.rpc.etcd import EtcdTarget, prefix_end
from radixkv.rpc.membership import MemberInfo, check_node_id
from radixkv.service.events import EventLog

BS = 4


def toks(*ids: int) -> bytes:
    return to_token_bytes(list(ids))


def make_tree(*prompts: bytes) -> tuple[RadixTree, EventLog]:
    tree, log = RadixTree(BS), EventLog(BS)
    next_id = 0
    for p in prompts:
        n = len(p) // (4 * BS)
        ids = tuple(range(next_id, next_id + n))
        next_id += n
        tree.insert(p, ids)
        log.publish("ns", tree.take_events())
    return tree, log


def test_chain_hashes_are_the_events_hashes():
    a = toks(*range(12))
    b = toks(*range(8), 50, 51, 52, 53)
    tree, log = make_tree(a, b)
    events, _ = log.read(0)
    stored = [h for ev in events for h in ev.block_hashes]
    assert chain_hashes("ns", a, BS) + chain_hashes("ns", b, BS)[2:] == stored
    assert chain_hashes("ns", b, BS)[:2] == chain_hashes("ns", a, BS)[:2]
    assert chain_hashes("other", a, BS) != chain_hashes("ns", a, BS)  # namespaces never share
    assert chain_hashes("ns", toks(1, 2, 3), BS) == []  # no whole block
    # a DumpTree snapshot hashes to the same set
    assert snapshot_hashes("ns", list(tree.nodes()), BS) == set(stored)


def test_cached_blocks_walks_the_prefix():
    idx = ClusterIndex()
    h = [11, 12, 13, 14]
    idx.stored("a", "ns", h[:3])
    idx.stored("b", "ns", h[:2])
    idx.stored("c", "ns", h[:1])
    assert idx.cached_blocks("ns", h, ["a", "b", "c", "d"]) == {"a": 3, "b": 2, "c": 1, "d": 0}
    assert idx.cached_blocks("other", h, ["a"]) == {"a": 0}
    assert idx.cached_blocks("ns", [99] + h, ["a"]) == {"a": 0}
    idx.removed("a", "ns", [13])
    assert idx.cached_blocks("ns", h, ["a"]) == {"a": 2}
    assert idx.size("a") == (2, 1)


def test_replace_drop_and_clear_leave_nothing_behind():
    idx = ClusterIndex()
    idx.stored("a", "ns", [1, 2])
    idx.stored("b", "ns", [1])
    idx.replace("a", {"ns": {1}, "x": {7}})
    assert idx.cached_blocks("ns", [1, 2], ["a", "b"]) == {"a": 1, "b": 1}
    assert idx.member_blocks("a") == {"ns": {1}, "x": {7}}
    idx.cleared("a", "x")
    assert not idx.knows("x")
    idx.drop("a")
    idx.drop("b")
    assert not idx.knows("ns") and idx.size("a") == (0, 0)
    idx.removed("a", "ns", [1])  # unknown member or block: nothing to do


@pytest.mark.parametrize("url, host, port, cluster", [
    ("etcd://127.0.0.1:2379", "127.0.0.1", 2379, "default"),
    ("127.0.0.1:2379/prod-a", "127.0.0.1", 2379, "prod-a"),
    ("http://localhost:1234/", "localhost", 1234, "default"),
])
def test_etcd_target(url, host, port, cluster):
    t = EtcdTarget.parse(url)
    assert (t.host, t.port, t.cluster) == (host, port, cluster)
    assert t.members_prefix == f"/radixkv/{cluster}/members/".encode()


@pytest.mark.parametrize("url", ["etcd://127.0.0.1", "ftp://h:1", "etcd://h:1/a b"])
def test_etcd_target_rejects(url):
    with pytest.raises(InvalidArgument):
        EtcdTarget.parse(url)


def test_prefix_end_and_records():
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"
    info = MemberInfo("n0", "unix:///s", "e", 16, 64, 1024, "l", 1, 2.0)
    assert MemberInfo.from_json(info.to_json()) == info
    with pytest.raises(InvalidArgument, match="not a radixkv member record"):
        MemberInfo.from_json(b'{"node_id": "x"}')
    for bad in ("", "a b", "x" * 129, "a/b"):
        with pytest.raises(InvalidArgument):
            check_node_id(bad)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["a", "b"]),
                                st.lists(st.integers(0, 2), min_size=1, max_size=5),
                                st.integers(0, 3), st.booleans()), min_size=1, max_size=30),
       batch=st.integers(1, 5), reads=st.lists(st.integers(0, 30), max_size=4))
def test_batched_event_hashes_equal_chain_hashes(steps, batch, reads):
    """The log hashes queued events in batches (every `batch` queued, and on each read); the
    hashes are still each stored prompt's chain_hashes from its parent, and a removed block
    carries the hash it was stored with, across namespaces, evictions and clears."""
    trees = {ns: RadixTree(BS) for ns in "ab"}
    log, next_id, got = EventLog(BS), 0, []
    log.HASH_BATCH = batch
    expect_stored: dict[tuple[str, int], int] = {}  # (ns, block) -> hash, from chain_hashes
    for i, (ns, blocks, evict, clear) in enumerate(steps):
        tokens = toks(*[t for b in blocks for t in (b, b, b, b)])
        m = trees[ns].match(tokens)
        ids = list(m.block_ids) + list(range(next_id, next_id + len(blocks) - len(m.block_ids)))
        next_id += len(blocks)
        trees[ns].insert(tokens, ids)
        hashes = chain_hashes(ns, tokens, BS)
        for b, h in zip(ids, hashes, strict=True):
            expect_stored.setdefault((ns, b), h)
        trees[ns].evict(evict)
        log.publish(ns, trees[ns].take_events())
        if clear and trees[ns].num_cached_blocks == 0:
            log.publish_cleared(ns)
        if i in reads:  # a reader in between hashes what is queued so far
            events, _ = log.read(len(got))
            got += events
    events, lagged = log.read(len(got), limit=1 << 20)
    got += events
    assert not lagged and [ev.sequence for ev in got] == list(range(1, log.last_sequence + 1))
    for ev in got:
        if ev.kind in ("stored", "removed"):
            assert ev.block_hashes == tuple(expect_stored[ev.namespace, b] for b in ev.block_ids)


@settings(max_examples=80, deadline=None)
@given(wb=st.integers(1, 3),
       steps=st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=6),
                                st.integers(0, 6), st.integers(0, 3), st.integers(0, 3)),
                      min_size=1, max_size=20))
def test_a_window_members_index_answers_what_its_tree_resumes(wb, steps):
    """A sliding-window tree under inserts (window parts on a random tail), evictions of
    leaves and of window parts alone; the index fed by its events answers, for every prefix
    asked, the depth the tree's own match resumes at."""
    tree, log, index = WindowedRadixTree(BS, wb), EventLog(BS), ClusterIndex()
    index.replace("m", {}, {}, window_blocks=wb)
    next_id, next_win, read, asked = 0, 1 << 20, 0, []
    for blocks, tail, evict, evict_windows in steps:
        tokens = toks(*[t for b in blocks for t in (b, b, b, b)])
        asked.append(tokens)
        ids = list(range(next_id, next_id + len(blocks)))
        next_id += len(blocks)
        k = min(tail, len(blocks))
        wins = list(range(next_win, next_win + k))
        next_win += k
        tree.insert(tokens, ids, window_ids=wins)
        tree.evict(evict)
        tree.evict_windows(evict_windows)
        log.publish("ns", tree.take_events())
        events, _ = log.read(read, limit=1 << 20)
        for ev in events:
            read = ev.sequence
            if ev.kind == "stored":
                index.stored("m", "ns", ev.block_hashes)
            elif ev.kind == "removed":
                index.removed("m", "ns", ev.block_hashes)
            elif ev.kind == "window_stored":
                index.window_stored("m", "ns", ev.block_hashes)
            elif ev.kind == "window_removed":
                index.window_removed("m", "ns", ev.block_hashes)
        for t in asked:
            for cut in range(BS * 4, len(t) + 1, BS * 4):
                want = tree.match(t[:cut]).num_tokens // BS
                got = index.cached_blocks("ns", chain_hashes("ns", t[:cut], BS), ["m"])["m"]
                assert got == want, (t[:cut], got, want)
