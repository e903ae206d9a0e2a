"""SGLang's real HiCacheController on two radixkv members (etcd on loopback, the members on TCP
with the cluster token, `serve --peer-fetch`): worker A backs up a prompt's pages to member a,
worker B's prefetch on member b gets them through peer fetch, with no backend setting beyond
its own member's socket. The pages B loads are byte-equal to A's."""

from __future__ import annotations

import shutil

import pytest
from _server import TOKEN, tiny_flags, wait_for
from _sglang_workers import Worker, leases_back_to, no_errors, tokens

from radixkv.client import Client
from radixkv.cluster.local import free_port, local_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("etcd") is None,
                                 reason="etcd is not installed (apt-get install etcd-server; "
                                 "scripts/bootstrap --tests does it)")]


def test_a_worker_on_another_member_prefetches_the_pages_through_peer_fetch(
        workers: dict[str, Worker], tmp_path, token_file: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = workers["A"], workers["B"]
    env = {"RADIXKV_AUTH_TOKEN": TOKEN}  # the backends' clients send it
    monkeypatch.setenv("RADIXKV_AUTH_TOKEN", TOKEN)  # and so do this test's
    with local_cluster(0, *tiny_flags(str(tmp_path), num_blocks=64), router=False) as c:
        for node in ("a", "b"):
            port = free_port()
            c.start_member(node, "--tcp", f"127.0.0.1:{port}", "--advertise",
                           f"127.0.0.1:{port}", "--auth-token-file", token_file, "--peer-fetch")
        sock_a, sock_b = c.members["a"].socket, c.members["b"].socket
        ns = a("open", name="peer", socket=sock_a, env=env)["namespace"]
        assert ns == b("open", name="peer", socket=sock_b, env=env)["namespace"]
        shared = tokens(7000, 8)  # 8 pages: past --peer-fetch-min-blocks (4)
        wrote = a("write", name="peer", tokens=shared, seed=11)
        assert wrote["stored"] == len(shared)
        longer = shared + tokens(9000, 2)

        def prefetched() -> dict | None:  # b learns a's pages from a's events, then fetches
            got = b("prefetch", name="peer", tokens=longer)
            return got if got["hit"] == len(shared) else None

        got = wait_for(prefetched, timeout=30, what="B's prefetch to get A's pages from a")
        assert got["loaded"] == len(shared) and got["pages"] == wrote["pages"]
        with Client(sock_b, token=TOKEN) as kv:
            peer = {p["node_id"]: p for p in kv.stats().get("peers", [])}["a"]
        assert peer["blocks_in"] == 8 and peer["checksum_failures"] == 0
        for sock in (sock_a, sock_b):
            s = leases_back_to(sock, 0)
            assert s["integrity"] == "ok" and s["expired_leases"] == 0
    no_errors(a, b)
