"""Leases of an in-process KVService (and one over gRPC): what a lease holds is freed when it
ends, expires after its TTL (lazily on use, or by the sweeper), renews on use and on keep_alive,
and a failed call opens none."""

from __future__ import annotations

import time

import pytest
from _kv import fill, toks
from _server import running_server

from radixkv.client import Client
from radixkv.protocol import errors


def test_release_frees_uninserted_blocks(svc):
    r = svc.allocate("e", None, "ns", 3)
    assert svc.stats().leased_blocks == 3
    assert svc.release("e", [r.lease_id]) == 3
    assert svc.stats().free_blocks == 8

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


def test_failed_allocate_leaves_no_lease(svc):
    held = svc.match("e", "ns", toks(*range(32)))  # nothing cached; now fill the pool
    svc.allocate("e", held.lease_id, "ns", 8)
    before = svc.stats().live_leases
    with pytest.raises(errors.OutOfBlocks):
        svc.allocate("other", None, "ns2", 1)
    assert svc.stats().live_leases == before
    assert "ns2" not in svc.namespaces()

def test_keep_alive_and_per_call_ttl(svc, clock):
    m = svc.match("e", "ns", toks(*range(8)), ttl_s=100)
    clock.now += 50  # past the default 10 s, within the asked 100 s
    svc.expire_leases()
    ids = svc.allocate("e", m.lease_id, "ns", 2).block_ids
    for _ in range(5):  # an engine renewing during a long forward pass
        clock.now += 90
        assert svc.keep_alive("e", [m.lease_id]) == 100
        svc.expire_leases()
    svc.insert("e", m.lease_id, "ns", toks(*range(8)), ids)
    with pytest.raises(errors.InvalidArgument, match="cap"):
        svc.match("e", "ns", toks(1), ttl_s=10**9)
    with pytest.raises(errors.InvalidArgument, match="cap"):
        svc.keep_alive("e", [m.lease_id], ttl_s=-1)
    svc.release("e", [m.lease_id])

def test_keep_alive_over_grpc():
    with running_server(lease_ttl=0.5) as s, Client(s.socket) as kv:
        assert kv.pool_info().lease_ttl_s == 0.5
        with kv.lease("ns", list(range(8))) as lease:
            for _ in range(6):
                time.sleep(0.2)
                assert lease.keep_alive() == pytest.approx(0.5)
            assert lease.allocate(2)  # still alive after 1.2 s
        long = kv.match("ns", [1, 2, 3, 4], ttl=5)
        time.sleep(1.0)
        kv.release(long.lease_id)  # alive: its own TTL was 5 s
