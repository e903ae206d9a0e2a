"""Making room across namespaces (radixkv/service/allocator.py), in-process: leaf tails in the
policy's order across every namespace, exact ids evicted, one event per run, and OutOfBlocks with
the numbers when nothing can go."""

from __future__ import annotations

import pytest
from _kv import fill, toks

from radixkv.protocol import errors


@pytest.mark.parametrize("svc", [{"policy": "lru"}], indirect=True)
def test_allocation_evicts_lru_leaf_tail_first(svc, clock):
    fill(svc, "ns", toks(*range(12)))  # blocks 0 1 2
    fill(svc, "ns", toks(*range(100, 112)))  # blocks 3 4 5
    fill(svc, "ns", toks(*range(12)))  # touch the first prompt again
    r = svc.allocate("e", None, "ns", 4)  # 2 free: evict 2 blocks from the LRU leaf's tail
    assert r.num_evicted == 2
    assert svc.match("e", "ns", toks(*range(100, 112))).num_tokens == 4
    assert svc.match("e", "ns", toks(*range(12))).num_tokens == 12
    svc.release("e", [r.lease_id])
    clock.now += 11  # the matches' leases expire: their pins go
    assert svc.expire_leases() == 2

def test_out_of_blocks_reports_numbers(svc):
    m = svc.match("e", "ns", toks(*range(16)))
    ids = svc.allocate("e", m.lease_id, "ns", 4).block_ids
    svc.insert("e", m.lease_id, "ns", toks(*range(16)), ids)  # pinned by m
    other = svc.allocate("e", None, "ns", 3)
    with pytest.raises(errors.OutOfBlocks,
                       match=r"asked 2 blocks: 1 free, 0 evictable, 3 leased, 4 pinned"):
        svc.allocate("e", None, "ns", 2)
    svc.release("e", [m.lease_id, other.lease_id])

def test_namespaces_are_isolated_and_evicted_lru_first(svc, clock):
    fill(svc, "old", toks(*range(16)))  # 4 blocks
    fill(svc, "new", toks(*range(16)))  # 4 blocks: same tokens, other blocks
    assert svc.stats().free_blocks == 0
    r = svc.allocate("e", None, "new", 2)  # evicts from the least recently used namespace
    assert r.num_evicted == 2
    assert svc.match("e", "old", toks(*range(16))).num_tokens == 8
    assert svc.match("e", "new", toks(*range(16))).num_tokens == 16
    clock.now += 11  # the leases left open expire: their pins go
    assert svc.expire_leases() == 3

def test_eviction_is_lru_across_namespaces_not_per_namespace(svc, clock):
    fill(svc, "a", toks(*range(12)))  # a1: blocks 0 1 2, the oldest
    fill(svc, "b", toks(*range(8)))  # b1: blocks 3 4
    fill(svc, "a", toks(*range(100, 112)))  # a2: blocks 5 6 7; "a" is the newer namespace
    r = svc.allocate("e", None, "b", 3)  # evicts a1's 3 blocks, not b1's older namespace
    assert r.num_evicted == 3 and r.block_ids == (2, 1, 0)
    hits = [svc.match("e", ns, toks(*t)).num_tokens
            for ns, t in (("a", range(12)), ("b", range(8)), ("a", range(100, 112)))]
    assert hits == [0, 8, 12]
    clock.now += 11  # the leases left open expire: their pins go
    assert svc.expire_leases() == 4

def test_eviction_across_namespaces_publishes_one_event_per_run(svc):
    fill(svc, "a", toks(*range(12)))  # blocks 0 1 2
    fill(svc, "b", toks(*range(8)))  # blocks 3 4
    fill(svc, "a", toks(*range(100, 112)))  # 5 6 7
    r = svc.allocate("e", None, "b", 4)  # a1's 3 blocks, then b1's tail block
    events, _ = svc.events.read(3)
    assert [(e.namespace, e.kind, e.block_ids) for e in events] == [
        ("a", "removed", (2, 1, 0)), ("b", "removed", (4,))]
    svc.release("e", [r.lease_id])
