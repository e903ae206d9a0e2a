"""The lookup table across processes, through a real `radixkv serve`: a reader process peeks
while this process stores, evicts and clears, and every answer is checked against the service's
own event history (each block a block that held that hash at some instant during the read, or a
miss); readers and the service killed at any point; restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _server import BLOCK_SIZE, running_server, store_many, wait_for

from radixkv.client import Client
from radixkv.protocol import errors
from radixkv.protocol.block_hashes import token_keys
from radixkv.server.launch import start_server
from radixkv.table import table_format as L

pytestmark = pytest.mark.skipif(not L.supported(), reason="the table is published on x86-64")

READER = Path(__file__).with_name("_table_reader.py")


def family(n: int = 24, seed: int = 3) -> list[list[int]]:
    """Prompts of 2-6 blocks that share stems (so evictions cut inside shared paths)."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(1, 1000, 2 * BLOCK_SIZE).tolist() for _ in range(4)]
    return [stems[i % 4] + rng.integers(1, 1000, BLOCK_SIZE * (i % 4 + 1)).tolist()
            for i in range(n)]


def history(kv: Client) -> dict[int, list[tuple[int, float, int]]]:
    """Per key, the (from, until, block id) spans it held: from its stored event's sequence up
    to (not including) the one that removed it (or cleared its namespace)."""
    spans: dict[int, list[tuple[int, float, int]]] = {}
    live: dict[str, dict[int, tuple[int, int]]] = {}
    for ev in kv.events(from_sequence=1, timeout=2.0):
        keys = live.setdefault(ev.namespace, {})
        kind = ev.WhichOneof("kind")
        assert kind != "lagged"
        if kind == "stored":
            for h, b in zip(ev.stored.block_hashes, ev.stored.block_ids, strict=True):
                keys[h] = (ev.sequence, b)
        gone = list(keys) if kind == "cleared" else list(ev.removed.block_hashes) \
            if kind == "removed" else []
        for h in gone:
            if h in keys:
                start, b = keys.pop(h)
                spans.setdefault(h, []).append((start, ev.sequence, b))
    for keys in live.values():
        for h, (start, b) in keys.items():
            spans.setdefault(h, []).append((start, float("inf"), b))
    return spans


def held(spans: list[tuple[int, float, int]], lo: int, hi: int, block: int | None) -> bool:
    """Whether some state s in [lo, hi] had the key at `block` (None: had it nowhere)."""
    if block is not None:
        return any(b == block and start <= hi and until > lo for start, until, b in spans)
    covered = sorted((max(start, lo), min(until, hi + 1)) for start, until, _ in spans
                     if start <= hi and until > lo)
    at = lo
    for start, until in covered:  # a state in [lo, hi] no span covers?
        if start > at:
            return True
        at = max(at, int(until) if until != float("inf") else hi + 1)
    return at <= hi


def test_concurrent_readers_see_only_states_the_tree_was_in(tmp_path):
    prompts = family()
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    rng = np.random.default_rng(5)
    with running_server(num_blocks=40) as srv, Client(srv.socket) as kv:
        reader = subprocess.Popen(
            [sys.executable, str(READER), srv.socket, str(tmp_path / "prompts.json"), "4",
             str(tmp_path / "reads.jsonl")], stdout=subprocess.PIPE, text=True)
        assert reader.stdout is not None and reader.stdout.readline().strip() == "reading"
        while reader.poll() is None:  # stores (evicting: 40 blocks), Clears, pressure
            op = rng.random()
            if op < 0.75:
                ns = ("a", "b")[int(rng.integers(2))]
                store_many(kv, ns, [prompts[int(i)] for i in rng.integers(0, len(prompts), 3)])
            elif op < 0.85:
                try:
                    kv.clear(("a", "b")[int(rng.integers(2))])
                except (errors.NotFound, errors.FailedPrecondition):
                    pass
            else:
                a = kv.allocate(int(rng.integers(1, 30)), namespace="scratch")
                kv.release(a.lease_id)
        stats = json.loads(reader.stdout.read().strip().splitlines()[-1])
        assert reader.returncode == 0
        spans = history(kv)
    reads = [json.loads(line) for line in (tmp_path / "reads.jsonl").read_text().splitlines()]
    assert len(reads) > 1000 and stats["reads"] == len(reads)
    hits = wrong = early = 0
    for before, after, ns, k, n, ids in reads:
        keys = token_keys(ns, np.asarray(prompts[k], np.uint32), BLOCK_SIZE).tolist()
        hits += n > 0
        for key, block in zip(keys[:n], ids, strict=True):
            wrong += not held(spans.get(key, []), before, after + 1, block)
        if n < len(keys):
            early += not held(spans.get(keys[n], []), before, after + 1, None)
    assert wrong == 0, f"{wrong} blocks no state of the tree gave ({len(reads)} reads)"
    # a miss where the tree held the block all along: only a read that gave up on a bucket
    # the writer kept changing (allowed: advisory), and rarely
    assert early <= stats["gave_up"] <= len(reads) // 1000, (early, stats)
    assert hits > len(reads) // 10, f"only {hits} of {len(reads)} reads found anything"


def test_a_killed_reader_leaves_the_table_serving(tmp_path):
    prompts = family(4)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    with running_server(num_blocks=40) as srv, Client(srv.socket) as kv:
        store_many(kv, "a", prompts)
        reader = subprocess.Popen(
            [sys.executable, str(READER), srv.socket, str(tmp_path / "prompts.json"), "60",
             str(tmp_path / "reads.jsonl")], stdout=subprocess.PIPE, text=True)
        assert reader.stdout is not None and reader.stdout.readline().strip() == "reading"
        time.sleep(0.2)
        reader.send_signal(signal.SIGKILL)  # mid-read, most likely
        reader.wait(10)
        for p in prompts:
            m = kv.match("a", p)
            assert kv.peek("a", p).block_ids == m.block_ids and m.num_tokens == len(p)
            kv.release(m.lease_id)


def test_service_killed_and_restarted_gives_a_new_table(tmp_path):
    """SIGKILL: the reader finds the writer gone (StalePool inside, Unavailable from the client
    while nothing serves), the killed service's table is reclaimed by the next start, and the
    next peek reads the new service's table."""
    p = family(1)[0]
    sock = str(tmp_path / "s.sock")
    flags = ("--model-config", _tiny(tmp_path), "--block-size", str(BLOCK_SIZE),
             "--num-blocks", "16", "--log-level", "warning")
    first = start_server(sock, *flags)
    with Client(sock) as kv:
        store_many(kv, "a", [p])
        old = kv.pool_info()
        assert kv.peek("a", p).num_tokens == len(p)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        time.sleep(0.15)  # the reader checks the writer's pid every 0.1 s
        with pytest.raises(errors.Unavailable):
            kv.peek("a", p)
        os.unlink(sock)
        second = start_server(sock, *flags)
        try:
            assert not os.path.exists(f"/dev/shm/{old.table_name}")  # reclaimed
            peek = wait_for(lambda: _peek_or_none(kv, p) is not None, what="a peek")
            assert peek and kv.peek("a", p).num_blocks == 0
            assert kv.pool_info().table_name != old.table_name
            store_many(kv, "a", [p])
            assert kv.peek("a", p).num_tokens == len(p)
        finally:
            assert second.stop() == 0


def test_no_lookup_table_flag():
    with running_server("--no-lookup-table") as srv, Client(srv.socket) as kv:
        assert kv.pool_info().table_name == ""
        with pytest.raises(errors.Unavailable, match="no lookup table"):
            kv.peek("a", [1, 2, 3, 4])


def test_sigterm_unlinks_the_table():
    with running_server() as srv, Client(srv.socket) as kv:
        name = kv.pool_info().table_name
        assert name and os.path.exists(f"/dev/shm/{name}")
    assert not os.path.exists(f"/dev/shm/{name}")


def _peek_or_none(kv: Client, p: list[int]):  # type: ignore[no-untyped-def]
    try:
        return kv.peek("a", p)
    except errors.Unavailable:
        return None


def _tiny(directory: Path) -> str:
    from _server import tiny_config_path

    return tiny_config_path(str(directory))
