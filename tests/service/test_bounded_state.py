"""State that must not grow with use: a lease pins each path once however often it inserts
(against a real server, and as an invariant over random request sequences), and the event
log keeps no block hashes, salts or names for namespaces that are gone."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
from _kv import BS, fill, make_service, toks
from _server import running_server
from hypothesis import given
from hypothesis import strategies as st

from radixkv.client import Client


def test_repeated_inserts_do_not_grow_pins():
    """50 Inserts of one cached prompt on one lease leave it pinned once, not 51 times."""
    prompt = np.arange(16, dtype=np.uint32)
    with running_server(num_blocks=16) as s, Client(s.socket) as kv:
        with kv.lease("ns", prompt) as first:
            first.insert(prompt, first.block_ids + first.allocate(4 - len(first.block_ids)))
        m = kv.match("ns", prompt)
        assert m.num_tokens == 16
        for _ in range(50):
            kv.insert("ns", prompt, m.block_ids, m.lease_id)
        nodes, _ = kv.dump_tree("ns")
        assert max(n.lock_count for n in nodes) == 1
        assert kv.stats()["pinned_blocks"] == 4
        kv.release(m.lease_id)
        nodes, _ = kv.dump_tree("ns")
        assert max(n.lock_count for n in nodes) == 0
        assert kv.stats(check_integrity=True)["integrity"] == "ok"


# one lease's steps: ("insert", k) inserts the first k blocks of a fixed sequence it holds
# blocks for; ("match", k) is a new lease matching the first k blocks; ("release", i)
steps = st.lists(st.tuples(st.sampled_from(["insert", "match", "release"]),
                           st.integers(1, 6)), max_size=40)


@given(steps)
def test_pins_stay_one_per_lease_and_path(ops):
    """Whatever leases insert along one sequence (prefixes, extensions, the same prompt
    again), a lease pins its deepest path once: no node is pinned more often than there are
    live leases, and releasing every lease unpins all."""
    svc = make_service(num_blocks=256, lease_ttl_s=60)  # room for 40 leases of 6 blocks
    try:
        seq = toks(*range(6 * BS))
        fill(svc, "ns", seq[:2 * BS * 4])  # two blocks cached
        leases: list[tuple[int, list[int]]] = []  # (lease id, its blocks for the 6-block seq)
        for op, k in ops:
            if op == "match" or not leases:
                m = svc.match("e", "ns", seq[:k * BS * 4])
                need = 6 - len(m.block_ids)
                rest = svc.allocate("e", m.lease_id, "ns", need).block_ids if need else ()
                leases.append((m.lease_id, list(m.block_ids + rest)))
            elif op == "insert":
                lid, ids = leases[k % len(leases)]
                probe = svc.match("x", "ns", seq)
                svc.release("x", [probe.lease_id])
                cached = probe.block_ids
                ids[:len(cached)] = cached  # a block cached meanwhile is named by its id
                for _ in range(2):
                    svc.insert("e", lid, "ns", seq[:k * BS * 4], ids[:k])
            else:
                lid, _ = leases.pop(k % len(leases))
                svc.release("e", [lid])
            nodes, _ = svc.dump_tree("ns")
            assert max((n.lock_count for n in nodes), default=0) <= len(leases)
            svc.check_integrity()
        svc.release("e", [lid for lid, _ in leases])
        nodes, _ = svc.dump_tree("ns")
        assert all(n.lock_count == 0 for n in nodes)
        svc.check_integrity()
    finally:
        svc.pool.close()


def test_event_log_forgets_dropped_namespaces():
    """3,000 short-lived namespaces on a small pool: the log keeps block hashes only for the
    namespaces still alive."""
    svc = make_service(num_blocks=64, lease_ttl_s=60)
    try:
        for i in range(3000):
            fill(svc, f"ns{i}", toks(*range(2 * BS)))  # each evicts older namespaces' blocks
        svc.events.read(0)  # hash whatever is queued
        live = set(svc.namespaces())
        assert len(live) <= 64
        assert set(svc.events.namespaces()) <= live
    finally:
        svc.pool.close()


def test_dropped_namespaces_leave_nothing_behind():
    """3,000 namespaces of 250-character names, each stored once and left to eviction (clients
    with short-lived namespaces): the second 1,500 leave the heap where the first left it, and
    only live namespaces have per-namespace state (the log once kept each name it hashed)."""
    svc = make_service(num_blocks=64, lease_ttl_s=60, event_buffer=64, recent_window=16)

    def churn(start: int, stop: int) -> int:
        for i in range(start, stop):
            fill(svc, f"{i:06d}".ljust(250, "n"), toks(*range(2 * BS)))
        svc.events.read(0)  # hash whatever is queued
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        grown = -churn(0, 1500) + churn(1500, 3000)
        live = set(svc.namespaces())
        assert len(live) <= 32 and set(svc.events.namespaces()) <= live
        assert len({e.namespace for e in svc.events.read(0)[0]}) <= 64  # the buffer's events
        svc.check_integrity()  # per-client lease counts included
        assert svc.stats().live_leases == 0
        assert grown < 32_000, f"the heap grew {grown} B over 1,500 dropped namespaces"
    finally:
        tracemalloc.stop()
        svc.pool.close()
