"""The two-round-trip request path: Match also allocates (store_tokens), Insert also releases.
Exact block ids on a tiny pool, per-query allocation errors, and equality with the four-call
path's outcome."""

from __future__ import annotations

import pytest
from _kv import BS, make_service, toks
from _server import running_server

from radixkv.client import STORE_ALL, Client
from radixkv.protocol import errors
from radixkv.protocol.values import InsertItem


@pytest.fixture
def svc():
    service = make_service()
    yield service
    service.check_integrity()
    service.pool.close()


def test_match_allocates_the_uncached_rest(svc):
    a = toks(*range(10))  # 2 full blocks + 2 tokens
    (m,) = svc.match_many("e", [("ns", a)], store_tokens=[10])
    assert (m.num_tokens, m.block_ids, m.new_block_ids, m.alloc_error) == (0, (), (0, 1), "")
    results, freed = svc.insert_many("e", [InsertItem(m.lease_id, "ns", a, m.new_block_ids)],
                                     release=[m.lease_id])
    assert results[0].adopted == (0, 1) and freed == {m.lease_id: 0}
    assert svc.stats().live_leases == 0
    b = a + toks(50, 51, 52, 53, 54, 55)  # 4 full blocks: 2 cached, 2 new
    (m,) = svc.match_many("e", [("ns", b)], store_tokens=[4])  # only the first block: cached
    assert (m.block_ids, m.new_block_ids) == ((0, 1), ())
    svc.release("e", [m.lease_id])
    (m,) = svc.match_many("e", [("ns", b)], store_tokens=[STORE_ALL])
    assert (m.block_ids, m.new_block_ids) == ((0, 1), (2, 3))
    # insert only one of the two: the other goes back to the free list with the release
    results, freed = svc.insert_many("e", [InsertItem(m.lease_id, "ns", b[:12 * 4], (0, 1, 2))],
                                     release=[m.lease_id])
    assert results[0].adopted == (2,) and freed == {m.lease_id: 1}
    assert svc.pool.num_free == 5


def test_no_room_is_a_per_query_status(svc):
    held = svc.match_many("e", [("ns", toks(*range(24)))], store_tokens=[24])[0]  # 6 blocks
    ms = svc.match_many("e", [("ns", toks(*range(100, 112))), ("ns", toks(*range(200, 204)))],
                        store_tokens=[12, 4])
    assert ms[0].new_block_ids == () and "asked 3 blocks: 2 free" in ms[0].alloc_error
    assert ms[1].new_block_ids == (6,) and ms[1].alloc_error == ""
    assert svc.stats().live_leases == 3  # the batch did not fail: every query has its lease
    svc.release("e", [held.lease_id, ms[0].lease_id, ms[1].lease_id])


def test_insert_can_release_only_its_own_leases(svc):
    m1, m2 = svc.match_many("e", [("ns", toks(*range(4))), ("ns", toks(*range(9, 13)))],
                            store_tokens=[4, 4])
    with pytest.raises(errors.InvalidArgument, match="only release the leases of its items"):
        svc.insert_many("e", [InsertItem(m1.lease_id, "ns", toks(*range(4)), m1.new_block_ids)],
                        release=[m2.lease_id])
    assert svc.stats().cached_blocks == 0 and svc.stats().live_leases == 2
    svc.release("e", [m1.lease_id, m2.lease_id])


def test_two_trips_over_grpc_match_the_four_call_path():
    prompts = [list(range(i, i + 18)) for i in (0, 0, 100, 0)]  # 4 full blocks each
    outcomes = {}
    for trips in (2, 4):
        with running_server(num_blocks=16) as s, Client(s.socket) as kv:
            seen = []
            for p in prompts:
                with kv.lease("ns", p, store_tokens=STORE_ALL if trips == 2 else 0) as lease:
                    new = lease.allocate(len(p) // BS - len(lease.block_ids)) \
                        if len(p) // BS > len(lease.block_ids) else ()
                    view = lease.view()
                    for b in new:
                        view[b] = float(p[0] + 1)
                    lease.insert(p, lease.block_ids + new, release=trips == 2)
                    seen.append((lease.block_ids, new))
            calls = kv.stats()
            assert calls["live_leases"] == 0 and calls["leased_blocks"] == 0
            outcomes[trips] = (seen, calls["cached_blocks"], calls["hit_tokens"])
            assert kv.stats(check_integrity=True)["integrity"] == "ok"
    assert outcomes[2] == outcomes[4]
    assert outcomes[2][1:] == (8, 32)


@pytest.mark.parametrize(("policy", "kept"), [("adaptive", "b"), ("lru", "c")])
def test_retention_hints_over_grpc(policy, kept):
    """Insert's hint (two trips) and Release's hint (four calls) reach the policy: `adaptive`
    evicts both hinted sessions first; LRU ignores hints and evicts the oldest."""
    def prompt(base):
        return list(range(base, base + 16))  # 4 full blocks

    with running_server("--policy", policy, num_blocks=16) as s, Client(s.socket) as kv:
        with kv.lease("b", prompt(0), store_tokens=STORE_ALL) as lease:  # oldest, no hint
            lease.insert(prompt(0), lease.new_block_ids, release=True)
        with kv.lease("a", prompt(100), store_tokens=STORE_ALL) as lease:
            lease.insert(prompt(100), lease.new_block_ids, release=True, hint="session_end")
        lease = kv.lease("c", prompt(200))
        lease.insert(prompt(200), lease.allocate(4))
        with pytest.raises(errors.InvalidArgument, match="unknown retention hint"):
            lease.client.release(lease.lease_id, hint="later")
        lease.release(hint="session_end" if policy == "adaptive" else None)
        new = kv.allocate(12, namespace="d")  # 4 free: 8 evicted
        assert new.num_evicted == 8
        cached = {ns: kv.match(ns, prompt(base)).num_tokens
                  for ns, base in (("a", 100), ("b", 0), ("c", 200))}
        assert cached == {"a": 0, "b": 0, "c": 0, kept: 16}
        assert kv.stats(check_integrity=True)["integrity"] == "ok"
