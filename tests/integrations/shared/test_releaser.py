"""radixkv.integrations.releaser: Releases and Inserts sent from a background thread, against a
real server: every queued lease ends (by its Release, not its TTL), one already ended does not
keep the others of its batch alive, close() sends what is still queued, Inserts go in order."""

from __future__ import annotations

from _server import running_server

from radixkv.client import Client
from radixkv.integrations.releaser import Releaser


def test_queued_leases_end_by_their_release() -> None:
    with running_server(num_blocks=16) as server, Client(server.socket) as kv:
        errors: list[tuple[BaseException, int]] = []
        rel = Releaser(lambda e, n: errors.append((e, n)))
        ids = [kv.match("ns", list(range(8))).lease_id for _ in range(20)]
        for lease_id in ids:
            rel.release(kv, [lease_id])
        assert rel.flush()
        s = kv.stats()
        assert s["live_leases"] == 0 and s["expired_leases"] == 0 and errors == []
        assert 1 <= rel.sent <= 20  # what was queued together went as one call
        # a batch with a lease that already ended: the others end all the same
        ids = [kv.match("ns", list(range(8))).lease_id for _ in range(3)]
        kv.release(ids[1])
        rel.release(kv, ids)
        assert rel.flush()
        assert kv.stats()["live_leases"] == 0
        ((error, n),) = errors
        assert n == 1 and f"unknown lease {ids[1]}" in str(error)
        # close() sends what is queued
        ids = [kv.match("ns", list(range(8))).lease_id for _ in range(3)]
        rel.release(kv, ids)
        rel.close()
        assert kv.stats()["live_leases"] == 0 and len(errors) == 1


def test_inserts_go_in_order_and_report_their_failure() -> None:
    """Inserts queued between Releases: sent in order, each ending its lease; wait_inserts
    returns once they were answered (the keys are then matchable); an Insert refused (its lease
    already released) goes to its on_error, and the others are sent all the same."""
    keys = [bytes([i]) * 8 for i in range(1, 4)]
    with running_server(num_blocks=16) as server, Client(server.socket) as kv:
        errors: list[BaseException] = []
        rel = Releaser(lambda e, n: errors.append(e))
        assert rel.wait_inserts() and not rel.inserting  # none queued: no wait
        stale = kv.match_keys("k", [b"\xee" * 8], store=True)
        kv.release(stale.lease_id)
        rel.insert(lambda: kv.insert_keys("k", [b"\xee" * 8], stale.new_block_ids,
                                          stale.lease_id, release=True), errors.append)
        for i in range(1, 4):
            m = kv.match_keys("k", keys[:i], store=True)
            rel.release(kv, [kv.match("ns", list(range(8))).lease_id])
            rel.insert(lambda m=m, i=i: kv.insert_keys(  # type: ignore[misc]
                "k", keys[:i], m.block_ids + m.new_block_ids, m.lease_id, release=True),
                errors.append)
            assert rel.wait_inserts()
            assert len(kv.match_keys("k", keys, ttl=1).block_ids) == i  # (read-your-writes)
        assert rel.inserts == 4 and not rel.inserting
        ((error,),) = [errors]
        assert f"unknown lease {stale.lease_id}" in str(error)
        rel.close()
        s = kv.stats()
        assert s["expired_leases"] == 0
