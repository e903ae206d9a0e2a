"""KV events on vLLM's wire (radixkv/server/vllm_events.py) from a real server in a subprocess:
decoded by vLLM's own structs in both encodings (.venv-vllm), replayed from any buffered
sequence, followed live, and an index rebuilt from them equals the member's DumpTree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
import zmq
from _server import BLOCK_SIZE, running_server

from radixkv.client import Client

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
READER = Path(__file__).with_name("_vllm_event_reader.py")
GOLDEN = Path(__file__).with_name("golden")  # kv_events_<encoding>.json: wire payloads, hex
NS = "chat@rev1"
TOPIC = "kv@rkv-0@smol"


@contextmanager
def publishing(encoding: str = "map", num_blocks: int = 16) -> Iterator[tuple[str, str, str]]:
    """A server publishing on ipc endpoints; yields (socket, endpoint, replay endpoint) and
    checks the endpoints' files are gone after its SIGTERM."""
    with tempfile.TemporaryDirectory(prefix="rkv-ev-") as d:
        ev, replay = f"ipc://{d}/ev", f"ipc://{d}/replay"
        with running_server("--kv-events-endpoint", ev, "--kv-events-replay-endpoint", replay,
                            "--kv-events-topic", TOPIC, "--kv-events-encoding", encoding,
                            num_blocks=num_blocks) as server:
            yield server.socket, ev, replay
        assert not os.path.exists(f"{d}/ev") and not os.path.exists(f"{d}/replay")


def prompt(head: int, blocks: int) -> list[int]:
    return [head * 1000 + i for i in range(blocks * BLOCK_SIZE)]


def store(socket: str, tokens: list[int], namespace: str = NS) -> None:
    with Client(socket) as kv, kv.lease(namespace, tokens) as lease:
        lease.insert(tokens, lease.block_ids + lease.new_block_ids, release=True)


def replay(endpoint: str, start: int = 0, timeout: float = 10) -> list[tuple[int, dict]]:
    """Every batch the replay socket resends from `start`: (sequence, the batch as builtins)."""
    return [(seq, msgspec.msgpack.decode(payload))
            for seq, payload in replay_raw(endpoint, start, timeout)]


def replay_raw(endpoint: str, start: int = 0, timeout: float = 10) -> list[tuple[int, bytes]]:
    """Every batch the replay socket resends from `start`: (sequence, its payload)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.RCVTIMEO = int(timeout * 1000)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            _, topic, seq, payload = sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return out
            assert topic == TOPIC.encode()
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)
        ctx.term()


def replay_until(endpoint: str, check, timeout: float = 10) -> list[tuple[int, dict]]:
    """Replays until `check(batches)` holds (the publisher reads the log every 50 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        got = replay(endpoint)
        if check(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def events_of(batches: list[tuple[int, dict]]) -> list[dict]:
    return [ev for _, batch in batches for ev in batch[1]]


def kind(event: dict | list) -> str:
    """An event's type, in either encoding (a map's `type`, or an array's first item)."""
    return str(event["type"] if isinstance(event, dict) else event[0])


def rebuild(events: list[dict]) -> dict[int, tuple[int | None, list[int]]]:
    """A consumer's index: block hash -> (parent hash, token ids)."""
    index: dict[int, tuple[int | None, list[int]]] = {}
    for ev in events:
        if ev["type"] == "BlockStored":
            parent = ev["parent_block_hash"]
            for i, h in enumerate(ev["block_hashes"]):
                index[h] = (parent, ev["token_ids"][i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
                parent = h
        elif ev["type"] == "BlockRemoved":
            for h in ev["block_hashes"]:
                index.pop(h)
        else:
            index.clear()
    return index


def dumped(socket: str) -> dict[int, tuple[int | None, list[int]]]:
    """The same index from the member's DumpTree pages."""
    import numpy as np

    with Client(socket) as kv:
        page = kv.dump_page(NS, page_size=1 << 16)
    parent_of = {n.node_id: n for n in page.nodes}
    out: dict[int, tuple[int | None, list[int]]] = {}
    for n in page.nodes:
        parent = parent_of[n.parent_id].block_hashes[-1] if n.parent_id else None
        tokens = np.frombuffer(n.tokens, "<u4").tolist()
        for i, h in enumerate(n.block_hashes):
            out[h] = (parent, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            parent = h
    return out


def test_an_index_rebuilt_from_the_events_equals_dumptree_through_eviction_and_clear():
    with publishing(num_blocks=16) as (sock, _, rp):
        for head in range(8):  # 8 prompts of 3 blocks sharing none: 24 blocks through 16
            store(sock, prompt(head, 3))
        store(sock, prompt(7, 3) + prompt(50, 2))  # extends a cached prompt: a child event
        want = dumped(sock)
        got = replay_until(rp, lambda b: rebuild(events_of(b)) == want)
        events = events_of(got)
        assert rebuild(events) == want and len(want) >= 5
        assert [s for s, _ in got] == list(range(len(got)))  # from 0, no gap
        kinds = {e["type"] for e in events}
        assert kinds == {"BlockStored", "BlockRemoved"}  # 24 blocks went through 16
        assert all(e["medium"] == "CPU" for e in events)
        child = [e for e in events if e["type"] == "BlockStored"
                 and e["token_ids"][:BLOCK_SIZE] == prompt(50, 1)]
        assert child and child[0]["parent_block_hash"] is not None
        assert all(e["block_size"] == BLOCK_SIZE for e in events if e["type"] == "BlockStored")
        with Client(sock) as kv:
            kv.clear(NS)
        got = replay_until(rp, lambda b: events_of(b)[-1]["type"] == "AllBlocksCleared")
        assert events_of(got)[-1] == {"type": "AllBlocksCleared"}
        assert rebuild(events_of(got)) == {}  # the namespace is gone with its tree


def by_medium(events: list[dict]) -> dict[int, tuple[str, int | None, list[int]]]:
    """A consumer's index with media: block hash -> (medium, parent hash, token ids)."""
    index: dict[int, tuple[str, int | None, list[int]]] = {}
    for ev in events:
        if ev["type"] == "BlockStored":
            parent = ev["parent_block_hash"]
            for i, h in enumerate(ev["block_hashes"]):
                index[h] = (ev["medium"], parent,
                            ev["token_ids"][i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
                parent = h
        elif ev["type"] == "BlockRemoved":
            for h in ev["block_hashes"]:
                assert index.pop(h)[0] == ev["medium"], ev  # removed from where it was
        else:
            index.clear()
    return index


def test_the_disk_tiers_blocks_are_storage_events_demoted_promoted_and_dropped(tmp_path):
    """A member with a disk tier: blocks the pool evicts to disk become STORAGE (BlockRemoved
    CPU, BlockStored STORAGE with their tokens and parent), a Match that promotes them moves
    them back to CPU, and the disk tier's own drops leave STORAGE: the consumer's index holds
    every block in the medium the member holds it, CPU equal to DumpTree, STORAGE as many as
    the tier holds, with the tokens each was stored with."""
    with tempfile.TemporaryDirectory(prefix="rkv-ev-") as d:
        ev, rp = f"ipc://{d}/ev", f"ipc://{d}/replay"
        with running_server("--kv-events-endpoint", ev, "--kv-events-replay-endpoint", rp,
                            "--kv-events-topic", TOPIC, "--disk-dir", str(tmp_path),
                            "--disk-capacity-blocks", "12", num_blocks=16) as server:
            sock = server.socket
            stored = {}
            for head in range(10):  # 30 blocks through a pool of 16 and a disk of 12
                tokens = prompt(head, 3)
                store(sock, tokens)
                stored[head] = tokens

            def settled(events: list[dict]) -> bool:
                index = by_medium(events)
                with Client(sock) as kv:
                    on_disk = kv.stats()["disk"]["blocks"]
                cpu = {h: v[1:] for h, v in index.items() if v[0] == "CPU"}
                return cpu == dumped(sock) and on_disk == sum(
                    v[0] == "STORAGE" for v in index.values())

            got = replay_until(rp, lambda b: settled(events_of(b)))
            events = events_of(got)
            assert settled(events)
            index = by_medium(events)
            disk = {h: v for h, v in index.items() if v[0] == "STORAGE"}
            assert len(disk) >= 6, index  # demoted, and some dropped (30 > 16 + 12)
            all_tokens = {tuple(t[i:i + BLOCK_SIZE]) for t in stored.values()
                          for i in range(0, len(t), BLOCK_SIZE)}
            assert all(tuple(v[2]) in all_tokens for v in disk.values())
            assert any(e["type"] == "BlockRemoved" and e["medium"] == "STORAGE"
                       for e in events)  # the disk tier dropped some
            head = next(h for h in range(10) if tuple(stored[h][:BLOCK_SIZE]) in
                        {tuple(v[2]) for v in disk.values()})
            with Client(sock) as kv, kv.lease(NS, stored[head]) as lease:
                assert lease.num_tokens > 0  # promoted from disk
            got = replay_until(rp, lambda b: settled(events_of(b)) and len(events_of(b)) >
                               len(events))
            after = by_medium(events_of(got))
            assert settled(events_of(got))
            first = [h for h, v in after.items() if v[2] == stored[head][:BLOCK_SIZE]]
            assert first and after[first[0]][0] == "CPU"


def test_a_subscriber_that_reconnects_inside_the_replay_window_loses_nothing():
    with publishing() as (sock, ev, rp):
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.RCVTIMEO = 10_000
        sub.connect(ev)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
        store(sock, prompt(1, 2))
        topic, seq, _ = sub.recv_multipart()
        assert topic == TOPIC.encode() and int.from_bytes(seq, "big") == 0
        sub.close(linger=0)  # away while two more batches go out
        store(sock, prompt(2, 2))
        store(sock, prompt(3, 2))
        missed = replay_until(rp, lambda b: len(b) >= 3)
        assert [s for s, _ in replay(rp, start=1)] == [1, 2]  # all after what it saw
        tokens = [e["token_ids"] for e in events_of(missed)[1:]]
        assert tokens == [prompt(2, 2), prompt(3, 2)]
        ctx.term()


def test_bad_endpoints_and_encodings_are_refused_at_start(tmp_path):
    for flags, says in (
            (("--kv-events-endpoint", "nonsense://x"), "KV events endpoint"),
            (("--kv-events-endpoint", f"ipc://{tmp_path}/e", "--kv-events-encoding", "json"),
             "invalid choice")):
        out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--socket",
                              f"{tmp_path}/s.sock", *flags], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode != 0 and says in out.stderr, out.stderr[-2000:]
        assert not os.path.exists(f"{tmp_path}/s.sock")


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["map", "array"])
def test_vllms_own_structs_decode_what_a_member_publishes(encoding):
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `bash scripts/bootstrap --tests`")
    with publishing(encoding) as (sock, ev, rp):
        live = subprocess.Popen([str(VLLM_PYTHON), str(READER), encoding, "live", ev, "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert json.loads(live.stdout.readline()) == {"subscribed": True}
        time.sleep(0.5)  # the subscription reaches the publisher
        store(sock, prompt(1, 3))
        store(sock, prompt(1, 3) + prompt(2, 1))
        with Client(sock) as kv:
            kv.clear(NS)
        out, err = live.communicate(timeout=60)
        assert live.returncode == 0, err[-2000:]
        (first,) = [json.loads(x) for x in out.splitlines()]
        replay_until(rp, lambda b: kind(events_of(b)[-1]) == "AllBlocksCleared")
        lines = subprocess.run([str(VLLM_PYTHON), str(READER), encoding, "replay", rp, "0"],
                               capture_output=True, text=True, timeout=60)
        assert lines.returncode == 0, lines.stderr[-2000:]
        batches = [json.loads(x) for x in lines.stdout.splitlines()]
    assert batches[-1] == {"end": True} and batches[0] == first
    batches = batches[:-1]
    assert [b["seq"] for b in batches] == list(range(len(batches)))
    assert all(b["topic"] == TOPIC and b["rank"] == 0 for b in batches)
    events = [e for b in batches for e in b["events"]]
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert [e["token_ids"] for e in stored] == [prompt(1, 3), prompt(2, 1)]
    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][-1]
    assert all(e["block_size"] == BLOCK_SIZE and e["medium"] == "CPU" and
               e["lora_id"] is None and len(e["block_hashes"]) * BLOCK_SIZE ==
               len(e["token_ids"]) for e in stored)
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for e in stored
               for h in e["block_hashes"])
    assert events[-1]["type"] == "AllBlocksCleared"


def golden_steps(sock: str, rp: str) -> list[bytes]:
    """A 3-block prompt stored, then a block after it, then a Clear: one batch each (each
    step waits for its batch), their payloads with the timestamp zeroed (msgpack: a 3-array,
    then ts as a float64, 8 bytes)."""
    def clear() -> None:
        with Client(sock) as kv:
            kv.clear(NS)

    steps = [lambda: store(sock, prompt(1, 3)), lambda: store(sock, prompt(1, 3) + prompt(2, 1)),
             clear]
    for n, step in enumerate(steps, 1):
        step()
        deadline = time.monotonic() + 10
        while len(batches := replay_raw(rp)) < n:
            assert time.monotonic() < deadline, "no batch for the step"
            time.sleep(0.05)
    assert len(batches) == len(steps), batches
    assert all(p[:2] == b"\x93\xcb" for _, p in batches)
    return [p[:2] + bytes(8) + p[10:] for _, p in batches]


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_the_wire_bytes_equal_the_golden_fixtures(encoding):
    """Byte for byte (but the timestamps) what tests/server/golden/ keeps, which vLLM's own
    structs decode (next test). RADIXKV_WRITE_GOLDEN=1 writes them anew (a deliberate change
    of the wire only)."""
    with publishing(encoding) as (sock, _, rp):
        got = [p.hex() for p in golden_steps(sock, rp)]
    path = GOLDEN / f"kv_events_{encoding}.json"
    if os.environ.get("RADIXKV_WRITE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
    assert got == json.loads(path.read_text())


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_vllms_own_structs_decode_the_golden_fixtures(encoding):
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `bash scripts/bootstrap --tests`")
    out = subprocess.run([str(VLLM_PYTHON), str(READER), encoding, "file",
                          str(GOLDEN / f"kv_events_{encoding}.json"), "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    batches = [json.loads(x) for x in out.stdout.splitlines()]
    assert [b["rank"] for b in batches] == [0, 0, 0]
    (first,), (second,), (cleared,) = (b["events"] for b in batches)
    assert first["type"] == second["type"] == "BlockStored"
    assert first["token_ids"] == prompt(1, 3) and second["token_ids"] == prompt(2, 1)
    assert second["parent_block_hash"] == first["block_hashes"][-1]
    assert first["parent_block_hash"] is None and len(first["block_hashes"]) == 3
    assert first["medium"] == "CPU" and first["block_size"] == BLOCK_SIZE
    assert cleared == {"type": "AllBlocksCleared"}
