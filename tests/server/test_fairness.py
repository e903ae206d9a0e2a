"""Per-client shares against a real server: no client holds every namespace or every lease,
the per-client lease cap follows the connection (not a client id the client picks), a global
lease cap bounds the table, and the integrity check's rate limit answers at once."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from _kv import make_service, toks
from _server import TOKEN, running_server
from hypothesis import given
from hypothesis import strategies as st

from radixkv.client import Client
from radixkv.protocol import errors
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc


def tokens(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.uint32)


def test_one_client_cannot_hold_every_namespace():
    """A Match of 1,024 queries in new namespaces with an hour's TTL may not take every
    namespace slot: another client still opens a namespace of its own."""
    with running_server() as s, Client(s.socket) as hog, Client(s.socket) as other:
        with pytest.raises(errors.LimitExceeded, match="namespaces per client"):
            hog.match_many([(f"ns{i}", tokens(4)) for i in range(1024)], ttl=3600)
        held = 0
        while True:  # take every namespace the hog may hold, a batch at a time
            try:
                hog.match_many([(f"ns{held + i}", tokens(4)) for i in range(32)], ttl=3600)
            except errors.LimitExceeded:
                break
            held += 32
        assert 0 < held < 1024
        m = other.match("mine", tokens(4))
        assert m.num_tokens == 0 and m.lease_id
        assert other.stats()["live_leases"] == held + 1


def test_share_of_namespaces_is_a_flag():
    with running_server("--max-namespaces", "8", "--max-namespaces-per-client", "3") as s, \
            Client(s.socket) as a, Client(s.socket) as b:
        a.match_many([(f"a{i}", tokens(4)) for i in range(3)])
        a.match("a0", tokens(8))  # a namespace it already holds costs nothing
        with pytest.raises(errors.LimitExceeded, match=r"3 namespaces per client"):
            a.match("a3", tokens(4))
        b.match_many([(f"b{i}", tokens(4)) for i in range(3)])
        assert len(a.stats()["namespaces"]) == 6


def test_a_share_larger_than_the_whole_is_refused_at_startup(tmp_path):
    out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--socket",
                          str(tmp_path / "s.sock"), "--max-namespaces", "4",
                          "--max-namespaces-per-client", "8"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "(8, --max-namespaces-per-client) exceed the namespaces in all (4" in out.stderr
    assert not (tmp_path / "s.sock").exists()


def tcp_port(banner: str) -> str:
    match = re.search(r"127\.0\.0\.1:(\d+)", banner)
    assert match, banner
    return match.group(1)


def test_lease_cap_follows_the_connection_not_the_client_id(tmp_path):
    """Rotating client ids on one TCP connection does not get past the per-client cap; a
    second connection has a share of its own."""
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    with running_server("--tcp", "127.0.0.1:0", "--auth-token-file", str(token),
                        "--max-leases-per-client", "8") as s:
        port = tcp_port(s.banner)
        with Client(f"127.0.0.1:{port}", token=TOKEN) as kv:
            opened = 0
            with pytest.raises(errors.LimitExceeded, match="limit 8 per client"):
                for i in range(64):
                    kv.client_id = f"rotating-{i}"
                    kv.match("ns", tokens(4))
                    opened += 1
            assert opened == 8
            with Client(f"127.0.0.1:{port}", token=TOKEN) as other:
                other.match("ns", tokens(4))  # its own share


def test_global_lease_cap():
    """However many client ids ask, the table holds at most --max-leases leases."""
    with running_server("--max-leases", "40", "--max-leases-per-client", "16") as s:
        clients = [Client(s.socket, client_id=f"c{i}") for i in range(4)]
        try:
            for c in clients[:2]:
                c.match_many([("ns", tokens(4))] * 16)
            clients[2].match_many([("ns", tokens(4))] * 8)
            with pytest.raises(errors.LimitExceeded, match="limit 40 live leases"):
                clients[3].match_many([("ns", tokens(4))] * 2)
            assert clients[3].stats()["live_leases"] == 40
        finally:
            for c in clients:
                c.close()


def test_global_lease_cap_by_default():
    """The default global cap (65,536) holds against client ids made up per call."""
    with running_server() as s, Client(s.socket) as kv:
        for i in range(16):
            kv.client_id = f"id-{i}"
            kv.match_many([("ns", tokens(4))] * 4096)
        kv.client_id = "id-16"
        with pytest.raises(errors.LimitExceeded, match="live leases"):
            kv.match_many([("ns", tokens(4))] * 4096)


def test_integrity_rate_limit_answers_at_once():
    """A check asked for right after another, before its turn, gets LimitExceeded
    (RESOURCE_EXHAUSTED) with the retry time at once (no call thread sleeps); after that time
    it runs; the Client waits its turn. (Its turn comes 10x the last check's time later, about
    25 ms on 16k blocks; a few tries, in case the machine is slow enough to miss one.)"""
    with running_server(num_blocks=16384) as s, \
            grpc.insecure_channel(f"unix://{s.socket}") as channel:
        stub = radixkv_pb2_grpc.RadixKVStub(channel)
        ask = pb.StatsRequest(check_integrity=True)
        refused = None
        for _ in range(5):
            time.sleep(0.3)
            assert stub.Stats(ask, timeout=10).integrity == "ok"
            start = time.perf_counter()
            try:
                stub.Stats(ask, timeout=10)
            except grpc.RpcError as e:
                assert time.perf_counter() - start < 0.05
                refused = e
                break
        assert refused is not None, "every early check was answered (after a sleep)"
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert re.search(r"retry in \d+\.\d+ s", refused.details())
        retry = float(dict(refused.trailing_metadata())["radixkv-retry-after"])
        assert 0 < retry < 1
        time.sleep(retry + 0.01)
        assert stub.Stats(ask, timeout=10).integrity == "ok"
        with Client(s.socket) as kv:
            for _ in range(5):  # back to back: the client waits the time the server names
                assert kv.stats(check_integrity=True)["integrity"] == "ok"


# ---- the limits against a reference, in process ------------------------------------------------

opens = st.lists(st.one_of(
    st.tuples(st.just("open"), st.sampled_from("abc"),
              st.lists(st.sampled_from([f"ns{i}" for i in range(6)]), min_size=1, max_size=4)),
    st.tuples(st.just("release"), st.integers(0, 30), st.just([]))), max_size=40)


@given(opens)
def test_limits_match_a_reference(ops):
    """Leases opened by three clients in six namespaces: a Match is refused (LimitExceeded,
    nothing opened) exactly when it would pass one of the limits, counted as a plain
    reference counts them."""
    limits = dict(max_namespaces=5, max_namespaces_per_client=3, max_leases=10,
                  max_leases_per_client=6)
    svc = make_service(num_blocks=8, lease_ttl_s=60, **limits)
    live: dict[int, tuple[str, str]] = {}  # lease id -> (client, namespace)
    try:
        for op, who, names in ops:
            if op == "release":
                if live:
                    lid = sorted(live)[who % len(live)]
                    svc.release("e", [lid])
                    del live[lid]
                continue
            mine = [ns for c, ns in live.values() if c == who]
            spaces = {ns for _, ns in live.values()} | set(names)
            refuse = (len(spaces) > limits["max_namespaces"]
                      or len(live) + len(names) > limits["max_leases"]
                      or len(mine) + len(names) > limits["max_leases_per_client"]
                      or len(set(mine) | set(names)) > limits["max_namespaces_per_client"])
            try:
                got = svc.match_many("e", [(ns, toks(1, 2, 3, 4)) for ns in names],
                                     client=who)
            except errors.LimitExceeded:
                assert refuse
            else:
                assert not refuse
                live.update({m.lease_id: (who, ns) for m, ns in zip(got, names, strict=True)})
            assert svc.stats().live_leases == len(live)
            assert sorted(svc.namespaces()) == sorted({ns for _, ns in live.values()})
            svc.check_integrity()
    finally:
        svc.pool.close()
