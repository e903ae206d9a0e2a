"""Key-keyed namespaces over the real gRPC server: Match / Insert / Allocate with block keys,
leading runs, eviction, events, DumpTree and the inspector, and precise errors."""

from __future__ import annotations

import hashlib
import itertools

import pytest
from _server import BLOCK_SIZE, running_server

from radixkv.cli.commands.inspect import tree_view
from radixkv.client import Client
from radixkv.protocol.errors import FailedPrecondition, InvalidArgument
from radixkv.v1 import radixkv_pb2 as pb


def chain(*symbols: int, start: bytes = b"") -> list[bytes]:
    """SHA-256 chain keys, one per page, as SGLang's HiCache makes them."""
    out, prev = [], start
    for s in symbols:
        prev = hashlib.sha256(prev + s.to_bytes(4, "little")).digest()
        out.append(prev)
    return out


def store(kv: Client, ns: str, keys: list[bytes]) -> tuple[int, ...]:
    m = kv.match_keys(ns, keys, store=True)
    assert not m.alloc_error
    ids = m.block_ids + m.new_block_ids
    kv.insert_keys(ns, keys, ids, m.lease_id, epoch=m.epoch, release=True)
    return ids


def test_match_insert_leading_run_events_and_tree() -> None:
    with running_server(num_blocks=16) as server, Client(server.socket) as kv:
        a = chain(1, 2, 3)
        miss = kv.match_keys("m", a)
        assert miss.block_ids == () and miss.num_tokens == 0
        kv.release(miss.lease_id)
        ids = store(kv, "m", a)
        b = a[:2] + chain(9, start=a[1])  # shares two pages
        m = kv.match_keys("m", b)
        assert m.block_ids == ids[:2] and m.num_tokens == 2 * BLOCK_SIZE
        kv.release(m.lease_id)
        gap = kv.match_keys("m", [a[0], a[2]])
        assert gap.block_ids == ids[:1]  # a gap ends the run
        kv.release(gap.lease_id)

        # the same through Allocate on a new lease, then Insert with the cached prefix
        alloc = kv.allocate(1, namespace="m", key_size=32)
        r = kv.insert_keys("m", b, ids[:2] + alloc.block_ids, alloc.lease_id, epoch=alloc.epoch,
                           release=True)
        assert r.adopted == alloc.block_ids and r.num_cached_tokens == 2 * BLOCK_SIZE

        stats = kv.stats(check_integrity=True)
        assert stats["integrity"] == "ok" and stats["live_leases"] == 0
        (ns,) = stats["namespaces"]
        assert ns["key_size"] == 32 and ns["cached_blocks"] == 4

        events = list(itertools.islice(kv.events(from_sequence=1, timeout=2), 2))
        stored = events[0].stored
        assert stored.keys == b"".join(a) and stored.key_size == 32 and not stored.tokens
        assert list(stored.block_ids) == list(ids) and len(stored.block_hashes) == 3

        nodes, _ = kv.dump_tree("m")
        edges = [[n.keys[i:i + 32] for i in range(0, len(n.keys), 32)] for n in nodes]
        assert sorted(k for e in edges for k in e) == sorted([*a, b[2]])
        for n, e in zip(nodes, edges, strict=True):
            assert not n.tokens and len(e) == len(n.block_ids)
        (root,) = tree_view(kv, "m")["children"]
        assert root["first_keys"][0] == a[0].hex() and root["blocks"] == len(root["first_keys"])


def test_eviction_under_a_small_pool_keeps_integrity() -> None:
    with running_server(num_blocks=6) as server, Client(server.socket) as kv:
        for i in range(8):
            ids = store(kv, "m", chain(i, i + 1, i + 2))
            assert len(ids) == 3
        stats = kv.stats(check_integrity=True)
        assert stats["integrity"] == "ok" and stats["evicted_blocks"] >= 18
        latest = chain(7, 8, 9)
        m = kv.match_keys("m", latest)
        assert len(m.block_ids) == 3  # the newest survived
        kv.release(m.lease_id)


def test_bad_input_gets_precise_errors() -> None:
    with running_server() as server, Client(server.socket) as kv:
        with pytest.raises(InvalidArgument, match="multiple of 4 in 8..64 bytes, got 6"):
            kv.match_keys("m", [b"x" * 6])
        with pytest.raises(InvalidArgument, match="key 1 is 31 bytes, key 0 is 32"):
            kv.match_keys("m", [b"x" * 32, b"y" * 31])
        too_many = kv.pool_info().max_tokens // BLOCK_SIZE + 1
        with pytest.raises(InvalidArgument, match=f"{too_many} keys, limit {too_many - 1}"):
            kv.match_keys("m", [b"x" * 8] * too_many)
        req = pb.MatchRequest(client_id="c", queries=[pb.MatchQuery(namespace="m", keys=b"k" * 8)])
        with pytest.raises(InvalidArgument, match="keys need key_size"):
            kv._call("Match", req)
        req = pb.MatchRequest(client_id="c", queries=[
            pb.MatchQuery(namespace="m", keys=b"k" * 8, key_size=8, tokens=b"\0" * 4)])
        with pytest.raises(InvalidArgument, match="not both"):
            kv._call("Match", req)
        store(kv, "m", chain(1, 2))
        with pytest.raises(FailedPrecondition, match=r"'m' is key-keyed \(32-byte keys\)"):
            kv.match("m", [1, 2, 3, 4])
        with pytest.raises(FailedPrecondition, match="this call gives key-keyed .16-byte"):
            kv.match_keys("m", [b"k" * 16])
        m = kv.match_keys("n", chain(1, 2), store=True)
        with pytest.raises(InvalidArgument, match="1 block ids for 2 keys"):
            kv.insert_keys("n", chain(1, 2), m.new_block_ids[:1], m.lease_id)
        kv.release(m.lease_id)
        assert kv.stats(check_integrity=True)["integrity"] == "ok"
