"""KVService in-process (no gRPC) on a tiny host pool: exact block ids, leases, eviction."""

from __future__ import annotations

import pytest
from _kv import fill, toks

from radixkv import errors


def test_request_path_exact_ids(svc):
    a = toks(*range(10))  # 2 full blocks + 2 tokens
    assert fill(svc, "ns", a) == (0, 1)
    m = svc.match("e", "ns", a + toks(50, 51))
    assert (m.num_tokens, m.block_ids) == (8, (0, 1))
    r = svc.allocate("e", m.lease_id, "ns", 1)
    assert r.block_ids == (2,) and r.num_evicted == 0
    out = svc.insert("e", m.lease_id, "ns", a + toks(50, 51), (0, 1, 2))
    assert out.adopted == (2,) and out.duplicates == () and out.num_cached_tokens == 8
    assert svc.stats().pinned_blocks == 3
    assert svc.release("e", [m.lease_id]) == 0
    s = svc.stats()
    assert (s.free_blocks, s.cached_blocks, s.pinned_blocks, s.leased_blocks) == (5, 3, 0, 0)
    assert (s.requests, s.query_tokens, s.hit_tokens) == (2, 22, 8)


def test_release_frees_uninserted_blocks(svc):
    r = svc.allocate("e", None, "ns", 3)
    assert svc.stats().leased_blocks == 3
    assert svc.release("e", [r.lease_id]) == 3
    assert svc.stats().free_blocks == 8


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


def test_lease_ttl_expiry_and_renewal(svc, clock):
    fill(svc, "ns", toks(*range(8)))
    m = svc.match("e", "ns", toks(*range(8)))
    svc.allocate("e", m.lease_id, "ns", 2)
    clock.now += 9
    svc.allocate("e", m.lease_id, "ns", 1)  # use renews the TTL
    clock.now += 9
    assert svc.expire_leases() == 0
    clock.now += 2
    assert svc.expire_leases() == 1
    s = svc.stats()
    assert (s.pinned_blocks, s.leased_blocks, s.free_blocks, s.expired_leases) == (0, 0, 6, 1)
    with pytest.raises(errors.LeaseExpired):
        svc.release("e", [m.lease_id])
    with pytest.raises(errors.NotFound, match="unknown lease 42"):
        svc.release("e", [42])


def test_lazy_expiry_on_use(svc, clock):
    r = svc.allocate("e", None, "ns", 2)
    clock.now += 11
    with pytest.raises(errors.LeaseExpired):
        svc.allocate("e", r.lease_id, "ns", 1)
    assert svc.stats().free_blocks == 8


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


def test_events_follow_inserts_and_evictions(svc, clock):
    fill(svc, "ns", toks(*range(8)))
    svc.allocate("e", None, "ns", 7)  # forces eviction of one block
    events, lagged = svc.events.read(0)
    assert not lagged
    assert [(e.sequence, e.kind, e.block_ids) for e in events] == [
        (1, "stored", (0, 1)), (2, "removed", (1,))]
    assert events[0].block_hashes[1] == events[1].block_hashes[0]
    clock.now += 11  # the leases left open expire: their pins go
    assert svc.expire_leases() == 1


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


def test_clear_namespace(svc):
    fill(svc, "a", toks(*range(8)))
    fill(svc, "b", toks(*range(8)))
    m = svc.match("e", "a", toks(*range(8)))
    with pytest.raises(errors.FailedPrecondition, match="1 live lease"):
        svc.clear("a")
    svc.release("e", [m.lease_id])
    assert svc.clear("a") == 2
    assert svc.namespaces() == ["b"]
    with pytest.raises(errors.NotFound):
        svc.clear("a")
    events, _ = svc.events.read(0)
    assert [e.kind for e in events] == ["stored", "stored", "cleared"]
    assert events[-1].namespace == "a"
    assert svc.stats().free_blocks == 6


def test_eviction_across_namespaces_publishes_one_event_per_run(svc):
    fill(svc, "a", toks(*range(12)))  # blocks 0 1 2
    fill(svc, "b", toks(*range(8)))  # blocks 3 4
    fill(svc, "a", toks(*range(100, 112)))  # 5 6 7
    r = svc.allocate("e", None, "b", 4)  # a1's 3 blocks, then b1's tail block
    events, _ = svc.events.read(3)
    assert [(e.namespace, e.kind, e.block_ids) for e in events] == [
        ("a", "removed", (2, 1, 0)), ("b", "removed", (4,))]
    svc.release("e", [r.lease_id])
