"""radixkv.integrations.releaser: Releases sent from a background thread, against a real server:
every queued lease ends (by its Release, not its TTL), one already ended does not keep the
others of its batch alive, and close() sends what is still queued."""

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
