"""KVService in-process (no gRPC) on a tiny host pool: the request path with exact block ids,
batches that fail whole, namespaces, and the integrity check. Leases: test_leases.py; eviction:
test_reclaim.py; windows: test_window_service.py; the two-trip path: test_two_trips.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from _kv import fill, make_service, toks

from radixkv.protocol import errors
from radixkv.protocol.values import InsertItem


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


# ---- batches fail whole ----------------------------------------------------------------------


def test_failed_match_batch_changes_nothing(clock):
    svc = make_service(clock, max_namespaces=2)
    fill(svc, "a", toks(*range(8)))
    with pytest.raises(errors.LimitExceeded, match="namespaces"):
        svc.match_many("e", [("a", toks(*range(8))), ("b", toks(1)), ("c", toks(2))])
    s = svc.stats()
    assert (s.live_leases, s.pinned_blocks, s.requests) == (0, 0, 1)
    assert svc.namespaces() == ["a"]
    svc.check_integrity()

def test_insert_batch_is_all_or_nothing(svc):
    m1, m2 = svc.match_many("e", [("ns", toks(*range(8))), ("ns", toks(*range(100, 108)))])
    ids1 = svc.allocate("e", m1.lease_id, "ns", 2).block_ids
    ids2 = svc.allocate("e", m2.lease_id, "ns", 2).block_ids
    bad = (ids2[0], 7)  # block 7 was never allocated to m2
    with pytest.raises(errors.PermissionDenied, match="block 7 is not allocated"):
        svc.insert_many("e", [InsertItem(m1.lease_id, "ns", toks(*range(8)), ids1),
                              InsertItem(m2.lease_id, "ns", toks(*range(100, 108)), bad)])
    assert svc.stats().cached_blocks == 0  # item 1 was not committed either
    with pytest.raises(errors.InvalidArgument, match="claimed by two items"):
        svc.insert_many("e", [InsertItem(m1.lease_id, "ns", toks(*range(8)), ids1),
                              InsertItem(m1.lease_id, "ns", toks(*range(200, 208)), ids1)])
    assert svc.stats().cached_blocks == 0
    out, _ = svc.insert_many("e", [InsertItem(m1.lease_id, "ns", toks(*range(8)), ids1),
                                   InsertItem(m2.lease_id, "ns", toks(*range(100, 108)), ids2)])
    assert [r.adopted for r in out] == [ids1, ids2]


# ---- namespaces ------------------------------------------------------------------------------


def test_empty_namespaces_are_reclaimed(clock):
    svc = make_service(clock, max_namespaces=4, max_namespaces_per_client=4)
    for i in range(50):  # far more distinct names than the limit: each one goes when idle
        m = svc.match("e", f"ns{i}", toks(1, 2, 3, 4))
        svc.release("e", [m.lease_id])
    assert svc.namespaces() == []
    held = [svc.match("e", f"x{i}", toks(1)).lease_id for i in range(4)]
    with pytest.raises(errors.LimitExceeded, match="4 namespaces hold blocks or leases"):
        svc.match("e", "one-too-many", toks(1))
    svc.release("e", held)
    svc.check_integrity()

def test_clear_keeps_lifetime_counters(svc):
    fill(svc, "ns", toks(*range(8)))
    fill(svc, "ns", toks(*range(8)))  # a hit of 8 tokens
    before = svc.stats()
    assert svc.clear("ns") == 2
    after = svc.stats()
    assert (after.requests, after.query_tokens, after.hit_tokens) == (
        before.requests, before.query_tokens, before.hit_tokens) == (2, 16, 8)


# ---- integrity -------------------------------------------------------------------------------


def test_integrity_checks_hold_under_python_O():
    code = """
from kvpool import create_pool
from kvpool.layout import KVLayout
from radixkv.protocol.errors import IntegrityError
from radixkv.service import KVService
import numpy as np
svc = KVService(create_pool(KVLayout(1, 1, 4, "fp32", 4), num_blocks=8))
m = svc.match("e", "ns", np.arange(8, dtype="<u4").tobytes())
ids = svc.allocate("e", m.lease_id, "ns", 2).block_ids
svc.pool.free([ids[0]])  # corrupt: a leased block back on the free list
try:
    svc.check_integrity()
    print("missed")
except IntegrityError as e:
    print("caught", e)
svc.pool.close()
"""
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("caught free 7 + leased 2"), out.stdout

def test_stats_reports_a_failed_invariant(clock):
    from radixkv.server.servicer import Servicer
    from radixkv.v1 import radixkv_pb2 as pb

    svc = make_service(clock)
    servicer = Servicer(svc, 1 << 20)
    m = svc.match("e", "ns", toks(*range(8)))
    svc.pool.free([svc.allocate("e", m.lease_id, "ns", 1).block_ids[0]])  # corrupt the service
    resp = servicer.Stats(pb.StatsRequest(check_integrity=True), None)
    assert resp.integrity.startswith("FAILED: free 8 + leased 1")
    time.sleep(0.1)  # the next check is allowed after 10x the last one's time
    svc.pool._free.append(svc.pool._free[0])  # corrupt the pool's own free list
    resp = servicer.Stats(pb.StatsRequest(check_integrity=True), None)
    assert resp.integrity == "FAILED: free list holds 1 duplicate ids"
    svc.pool.close()
