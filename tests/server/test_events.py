"""The KV event stream against a real server: exact events for a scripted sequence on a 4-block
pool, resume, lag, and DumpTree resync."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time

import pytest
from _server import REPO, running_server, tiny_config_path

from radixkv.client import Client
from radixkv.protocol import errors

A1 = list(range(1, 9))  # 2 blocks
A2 = A1 + [9, 10, 11, 12]  # 3 blocks, sharing A1


def request(kv: Client, ns: str, tokens: list[int]) -> tuple[int, ...]:
    """Match -> allocate the rest -> insert -> release; returns the prompt's block ids."""
    with kv.lease(ns, tokens) as lease:
        new = lease.allocate(len(tokens) // 4 - lease.num_tokens // 4)
        lease.insert(tokens, lease.block_ids + new)
        return lease.block_ids + new


def script(kv: Client) -> None:
    """Five events on a 4-block pool (ids come out of the free list in order; eviction trims
    the LRU unpinned leaf tail-first). Each eviction has one candidate tree, so the events do
    not depend on how the service ranks leaves of different namespaces."""
    assert request(kv, "a", A1) == (0, 1)  # 1: a stored [0 1]
    assert request(kv, "a", A2) == (0, 1, 2)  # 2: a stored [2] after 1
    assert request(kv, "b", A1) == (3, 2)  # 3: a removed [2]   4: b stored [3 2]
    held = kv.match("b", A1)  # pins b's blocks: only a's leaf is evictable
    r = kv.allocate(2, namespace="b")  # 5: a removed [1 0]
    assert r.block_ids == (1, 0) and r.num_evicted == 2
    kv.release(held.lease_id, r.lease_id)


def take(kv: Client, n: int, **kw: object) -> list:
    return list(itertools.islice(kv.events(timeout=10, **kw), n))  # type: ignore[arg-type]


def shape(ev) -> tuple:
    kind = ev.WhichOneof("kind")
    if kind == "stored":
        parent = ev.stored.parent_block_id if ev.stored.HasField("parent_block_id") else None
        tokens = list(memoryview(ev.stored.tokens).cast("I"))
        return ev.sequence, ev.namespace, kind, list(ev.stored.block_ids), parent, tokens
    if kind == "removed":
        return ev.sequence, ev.namespace, kind, list(ev.removed.block_ids)
    return ev.sequence, kind


EXPECTED = [
    (1, "a", "stored", [0, 1], None, A1),
    (2, "a", "stored", [2], 1, [9, 10, 11, 12]),
    (3, "a", "removed", [2]),
    (4, "b", "stored", [3, 2], None, A1),
    (5, "a", "removed", [1, 0]),
]


def test_scripted_traffic_gives_exact_events_and_chained_hashes():
    with running_server(num_blocks=4) as s, Client(s.socket) as kv:
        script(kv)
        events = take(kv, 5, from_sequence=1)
        assert [shape(e) for e in events] == EXPECTED
        a1, a2, a_rm2, b1, a_rm10 = events
        # vLLM-shaped hashes: one per block, chained through the parent; namespaces salt them
        assert len(a1.stored.block_hashes) == 2 and not a1.stored.HasField("parent_block_hash")
        assert a2.stored.parent_block_hash == a1.stored.block_hashes[1]
        assert list(a_rm2.removed.block_hashes) == list(a2.stored.block_hashes)
        assert list(a_rm10.removed.block_hashes) == list(reversed(a1.stored.block_hashes))
        assert set(b1.stored.block_hashes).isdisjoint(a1.stored.block_hashes)
        assert all(e.timestamp > 0 for e in events)
        # resume: exactly what came after
        assert [shape(e) for e in take(kv, 3, from_sequence=3)] == EXPECTED[2:]
        # a namespace filter skips the others (numbers keep their gaps)
        assert [shape(e) for e in take(kv, 1, from_sequence=1, namespace="b")] == [EXPECTED[3]]
        # live: a subscriber from now on sees only new events
        stream = kv.events(timeout=10)
        got: list = []
        reader = threading.Thread(target=lambda: got.extend(itertools.islice(stream, 1)))
        reader.start()
        time.sleep(0.3)  # the call is open and waiting
        assert request(kv, "a", A1[:4]) == (1,)
        reader.join(10)
        assert [shape(e) for e in got] == [(6, "a", "stored", [1], None, A1[:4])]
        assert kv.stats(check_integrity=True)["integrity"] == "ok"


def test_lagging_subscriber_resyncs_from_dump_tree():
    with running_server("--event-buffer", "2", num_blocks=4) as s, Client(s.socket) as kv:
        script(kv)  # 5 events; the buffer keeps 4 and 5
        lagged = take(kv, 5, from_sequence=2)
        assert len(lagged) == 1 and lagged[0].lagged and lagged[0].sequence == 2  # then ends
        assert [shape(e) for e in take(kv, 2, from_sequence=4)] == EXPECTED[3:]
        # rebuild: the snapshot reflects events up to last_sequence, then resume after it
        nodes, last = kv.dump_tree("b")
        assert last == 5
        assert [(n.block_ids, n.depth_tokens) for n in nodes] == [((3, 2), 8)]
        with pytest.raises(errors.NotFound):  # emptied by eviction, no lease: dropped
            kv.dump_tree("a")
        request(kv, "b", A2)  # free list: [1 0] -> block 1
        assert [shape(e) for e in take(kv, 1, from_sequence=last + 1)] == [
            (6, "b", "stored", [1], 2, [9, 10, 11, 12])]
        # a number ahead of the log (a subscriber resuming across a restart) is refused
        with pytest.raises(errors.InvalidArgument, match="from_sequence 99 is ahead of the last"
                           " event 6"):
            take(kv, 1, from_sequence=99)


def test_open_stream_does_not_delay_shutdown():
    with running_server(num_blocks=4) as s:
        kv = Client(s.socket)
        stream = kv.events(timeout=30)
        reader = threading.Thread(target=lambda: list(stream), daemon=True)
        reader.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert s.stop() == 0
        assert time.monotonic() - start < 1.5  # the grace period is 2 s
        reader.join(5)
        kv.close()


def test_event_buffer_must_hold_an_event(tmp_path):
    out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--socket",
                          str(tmp_path / "s.sock"), "--model-config",
                          tiny_config_path(str(tmp_path)), "--event-buffer", "0"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2
    assert "the event buffer must hold at least 1 event, got 0" in out.stderr
