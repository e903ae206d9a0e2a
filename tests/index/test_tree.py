"""Exact-expectation tests of the radix tree on tiny trees (block_size 4)."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv.index.eviction import LFUPolicy
from radixkv.index.policies import POLICIES, make_policy
from radixkv.index.results import BlockRemoved, BlockStored, InsertResult
from radixkv.index.tree import RadixTree
from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.tokens import from_token_bytes, ids_from_bytes, ids_to_bytes, to_token_bytes

BS = 4


def make_tree(policy: str = "lru") -> RadixTree:
    return RadixTree(BS, policy)


def toks(*blocks: int, tail: int = 0) -> bytes:
    """Block v is [v, v, v, v]; `tail` adds that many tokens of a trailing partial block."""
    return to_token_bytes([v for v in blocks for _ in range(BS)] + [99] * tail)


def edges(tree: RadixTree) -> list[tuple[int | None, int, tuple[int, ...]]]:
    """(parent's first block id or None, depth in tokens, block ids) per node, pre-order."""
    first = {v.node_id: v.block_ids[0] for v in tree.nodes()}
    return [
        (None if v.parent_id is None else first[v.parent_id], v.depth_tokens, v.block_ids)
        for v in tree.nodes()
    ]


def test_match_on_empty_tree_is_empty_and_lock_is_noop():
    tree = make_tree()
    m = tree.match(toks(1, 2))
    assert (m.num_tokens, m.block_ids) == (0, ())
    tree.lock(m.handle)
    tree.unlock(m.handle)
    tree.unlock(m.handle)  # empty match: no-op both ways
    assert tree.num_locked_blocks == 0
    tree.check_integrity()


def test_partial_block_is_never_cached():
    tree = make_tree()
    res = tree.insert(toks(1, 2, tail=3), [10, 11])
    assert res == InsertResult((10, 11), (), 0)
    m = tree.match(toks(1, 2, tail=3))
    assert (m.num_tokens, m.block_ids) == (8, (10, 11))
    assert tree.match(toks(1, tail=3)).block_ids == (10,)
    assert tree.match(to_token_bytes([1, 1, 1])).num_tokens == 0
    tree.check_integrity()


def test_match_is_read_only():
    tree = make_tree()
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    before = (list(tree.nodes()), tree.stats(), tree.take_events())
    m = tree.match(toks(1, 2, 7))
    assert (m.num_tokens, m.block_ids) == (8, (10, 11))
    assert (list(tree.nodes()), tree.stats(), tree.take_events()) == (before[0], before[1], [])


def test_insert_splits_an_edge_in_the_middle():
    tree = make_tree()
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    res = tree.insert(toks(1, 2, 5, 6), [10, 11, 20, 21])
    assert res == InsertResult((20, 21), (), 8)
    assert edges(tree) == [(None, 8, (10, 11)), (10, 12, (12,)), (10, 16, (20, 21))]
    assert tree.match(toks(1, 2, 3)).block_ids == (10, 11, 12)
    assert tree.match(toks(1, 2, 5, 6, 7)).block_ids == (10, 11, 20, 21)
    assert tree.stats().num_nodes == 3
    assert tree.stats().max_depth_blocks == 4
    tree.check_integrity()


def test_insert_skips_same_ids_and_returns_duplicates():
    tree = make_tree()
    tree.insert(toks(1, 2), [10, 11])
    res = tree.insert(toks(1, 2, 3), [10, 30, 31])  # 10 is the cached id; 30 differs
    assert res == InsertResult(adopted=(31,), duplicates=(30,), num_cached_tokens=8)
    assert tree.insert(toks(1, 2, 3), [40, 41, 42]) == InsertResult((), (40, 41, 42), 12)
    assert tree.num_cached_blocks == 3
    tree.check_integrity()


def test_insert_of_a_cached_prefix_inside_an_edge_splits_and_adopts_nothing():
    tree = make_tree()
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    assert tree.insert(toks(1, 2), [10, 11]) == InsertResult((), (), 8)
    assert edges(tree) == [(None, 8, (10, 11)), (10, 12, (12,))]
    tree.check_integrity()


@pytest.mark.parametrize(
    ("tokens", "block_ids", "message"),
    [
        (toks(1, 2), [10], "got 1 block ids for 2 full blocks"),
        (toks(1, tail=2), [10, 11], "got 2 block ids for 1 full blocks"),
        (toks(1, 2), [10, 10], "block id 10 repeated"),
        (toks(1, 2), [-1, 3], "block ids must be >= 0"),
        (toks(5, 6), [12, 30], "block id 12 (block 0) is already cached elsewhere"),
        (toks(1, 2, 3, 4), [10, 12, 11, 40], "block id 12 (block 1) is already cached"),
        (b"\x00\x01\x02", [], "multiple of 4"),
        ([1, -2], [], "token 1 is -2"),
    ],
)
def test_bad_insert_raises_and_leaves_tree_unchanged(tokens, block_ids, message):
    tree = make_tree()
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    before = list(tree.nodes())
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        tree.insert(tokens, block_ids)
    assert list(tree.nodes()) == before
    tree.check_integrity()


def test_lock_pins_exactly_the_matched_blocks_even_inside_an_edge():
    tree = make_tree()
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    m = tree.match(toks(1, 2, 9))
    tree.lock(m.handle)
    assert (tree.num_locked_blocks, tree.num_evictable_blocks) == (2, 1)
    assert tree.evict(10) == [12]
    assert tree.evict(10) == []
    tree.check_integrity()
    tree.unlock(m.handle)
    assert tree.num_locked_blocks == 0
    assert tree.evict(10) == [11, 10]
    tree.check_integrity()


def test_lock_counts_hits_and_a_locked_handle_survives_later_splits():
    tree = make_tree()
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    m = tree.match(toks(1, 2, 3))
    tree.lock(m.handle)
    tree.lock(m.handle)
    tree.insert(toks(1, 5), [10, 20])  # splits the locked edge after block 0
    tree.check_integrity()
    assert [(v.block_ids, v.lock_count, v.hits) for v in tree.nodes()] == [
        ((10,), 2, 2),
        ((11, 12), 2, 2),
        ((20,), 0, 0),
    ]
    tree.unlock(m.handle)
    tree.unlock(m.handle)
    with pytest.raises(InvalidArgument, match="without a matching lock"):
        tree.unlock(m.handle)
    assert tree.num_locked_blocks == 0
    tree.check_integrity()


def test_stale_or_foreign_handles_are_rejected():
    tree = make_tree()
    tree.insert(toks(1, 2), [10, 11])
    m = tree.match(toks(1, 2))
    tree.insert(toks(3), [30])
    with pytest.raises(InvalidArgument, match="stale"):
        tree.lock(m.handle)
    with pytest.raises(InvalidArgument, match="not a match handle"):
        make_tree().lock(m.handle)
    with pytest.raises(InvalidArgument, match="not a match handle"):
        tree.unlock(object())


def test_evict_is_lru_by_leaf_and_trims_tails_first():
    tree = make_tree()
    tree.insert(toks(1, 2, 3), [10, 11, 12])  # t1
    tree.insert(toks(4, 5), [20, 21])  # t2
    tree.insert(toks(1, 2, 6), [10, 11, 30])  # t3: splits, touches 10 11, adds 30
    # leaves by age: [12] (t1), [20 21] (t2), [30] (t3); evicting 3 takes 12, then 21 20
    assert tree.evict(3) == [12, 21, 20]
    tree.check_integrity()
    m = tree.match(toks(1, 2))
    tree.lock(m.handle)  # touches 10 11; 30 is now older than them but 10 11 are locked
    tree.unlock(m.handle)
    assert tree.evict(1) == [30]  # oldest leaf
    # [10 11] became a leaf when its last child went
    assert edges(tree) == [(None, 8, (10, 11))]
    assert tree.evict(5) == [11, 10]
    assert tree.stats().num_nodes == 0
    tree.check_integrity()


def test_touch_by_insert_reorders_eviction():
    tree = make_tree()
    tree.insert(toks(1), [10])
    tree.insert(toks(2), [20])
    tree.insert(toks(1), [10])  # touches [1]: [2] is now the oldest
    assert tree.evict(1) == [20]


def test_lfu_evicts_fewest_hits_first_then_oldest():
    tree = make_tree("lfu")
    for v in (1, 2, 3):
        tree.insert(toks(v), [v * 10])
    for v in (1, 1, 3):
        m = tree.match(toks(v))
        tree.lock(m.handle)
        tree.unlock(m.handle)
    assert tree.evict(3) == [20, 30, 10]
    tree.check_integrity()


def test_events_in_order_and_drained():
    tree = make_tree()
    tree.insert(toks(1, 2), [10, 11])
    tree.insert(toks(1, 2, 3, 4), [10, 11, 12, 13])
    tree.insert(toks(1, 5), [10, 14])  # split emits nothing
    assert tree.evict(2) == [13, 12]
    assert tree.take_events() == [
        BlockStored((10, 11), None, toks(1, 2)),
        BlockStored((12, 13), 11, toks(3, 4)),
        BlockStored((14,), 10, toks(5)),
        BlockRemoved((13, 12)),
    ]
    assert tree.take_events() == []
    quiet = RadixTree(BS, record_events=False)
    quiet.insert(toks(1), [1])
    assert quiet.take_events() == []


def test_nodes_view_fields():
    tree = make_tree()
    tree.insert(toks(1, 2), [10, 11])
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    parent, child = list(tree.nodes())
    assert (parent.parent_id, parent.depth_tokens, parent.tokens) == (None, 8, toks(1, 2))
    assert (child.parent_id, child.depth_tokens, child.tokens) == (parent.node_id, 12, toks(3))
    assert child.last_access >= parent.last_access - 1


def test_stats_counts():
    tree = make_tree()
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    tree.lock(tree.match(toks(1)).handle)
    tree.evict(1)
    s = tree.stats()
    assert (s.num_nodes, s.num_cached_blocks, s.num_locked_blocks, s.num_evictable_blocks) == (
        2,
        2,
        1,
        1,
    )
    assert (s.num_evicted_blocks, s.num_inserted_blocks, s.max_depth_blocks) == (1, 3, 2)


def test_token_forms_are_equivalent():
    tree = make_tree()
    tree.insert([1] * 4 + [2] * 4, [10, 11])
    for form in (
        toks(1, 2),
        bytearray(toks(1, 2)),
        memoryview(toks(1, 2)),
        np.array([1] * 4 + [2] * 4, dtype=np.int64),
        from_token_bytes(toks(1, 2)),
        (1, 1, 1, 1, 2, 2, 2, 2),
    ):
        assert tree.match(form).block_ids == (10, 11)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([0, 2**32], "token 1 is 4294967296"),
        ([3, 1.5], "token 1 is 1.5"),
        (np.array([[1]]), "1-D"),
        (np.array([1.0]), "integer dtype"),
        (np.array([5, -1]), "token 1 is -1"),
        (b"\x00" * 5, "got 5"),
    ],
)
def test_bad_tokens(tokens, message):
    with pytest.raises(InvalidArgument, match=message):
        to_token_bytes(tokens)


def test_token_bytes_round_trip_is_little_endian():
    data = to_token_bytes([1, 2**32 - 1])
    assert data == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    assert from_token_bytes(data).tolist() == [1, 2**32 - 1]
    assert to_token_bytes(data) is data


def test_block_id_bytes_round_trip():
    ids = (0, 1, 70_000, 2**32 - 1)
    data = ids_to_bytes(ids)
    assert data == to_token_bytes(ids) and len(data) == 16
    assert ids_from_bytes(data) == ids
    assert ids_from_bytes(b"") == () == ids_from_bytes(ids_to_bytes([]))
    with pytest.raises(InvalidArgument, match="got 6"):
        ids_from_bytes(data[:6])


def test_bad_arguments():
    with pytest.raises(InvalidArgument, match="block_size"):
        RadixTree(0)
    with pytest.raises(InvalidArgument, match="unknown eviction policy 'mru'"):
        RadixTree(4, "mru")
    with pytest.raises(InvalidArgument, match="num_blocks"):
        make_tree().evict(-1)
    policy = LFUPolicy()
    assert RadixTree(4, policy).stats().num_nodes == 0
    assert set(POLICIES) >= {"lru", "lfu"}
    assert all(make_policy(p).name == p for p in POLICIES)


def test_lock_inserted_pins_the_inserted_path_without_a_walk():
    tree = make_tree()
    tree.insert(toks(1, 2), [10, 11])
    tree.insert(toks(1, 3, tail=2), [10, 12])  # shares block 1: the edge splits
    handle = tree.lock_inserted()
    assert handle is not None and tree.num_locked_blocks == 2  # blocks 10 and 12
    assert tree.evict(3) == [11]  # only the other branch can go
    tree.unlock(handle)
    assert tree.num_locked_blocks == 0 and sorted(tree.evict(2)) == [10, 12]
    tree.check_integrity()
    tree.insert(b"", [])
    assert tree.lock_inserted() is None  # nothing inserted: nothing to pin
    tree.insert(toks(5), [50])
    tree.evict(1)
    with pytest.raises(InvalidArgument, match="after another mutation"):
        tree.lock_inserted()
