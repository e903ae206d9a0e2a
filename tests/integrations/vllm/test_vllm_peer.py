"""Real vLLM (CPU) on two radixkv members: engine B on member b gets the prefix engine A stored
on member a through peer fetch (etcd on loopback, the members on TCP with the cluster token,
`serve --peer-fetch`), with no connector setting beyond its own member's socket.

A keeps vLLM's own prefix cache; its answer from there is the reference for B's answer (B has
no prefix cache: its hit is the fetched one), as in test_vllm.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _server import wait_for
from test_vllm import BLOCK, Engine, model_dir, prompt  # noqa: F401 (model_dir: a fixture)

from radixkv.client import Client
from radixkv.cluster.local import free_port, local_cluster
from radixkv.integrations.vllm.driver import Driver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "vllm-peer-test-token-0123456789"
SYSTEM = prompt(21, 4 * BLOCK)  # a shared system prompt: 4 blocks


def connector(socket: str, stats: Path) -> dict[str, Any]:
    return {"kv_connector": "RadixKVConnector",
            "kv_connector_module_path": "radixkv.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": socket, "stats_file": str(stats)}}


def peers_of(socket: str) -> dict[str, dict[str, Any]]:
    with Client(socket, token=TOKEN) as kv:
        return {p["node_id"]: p for p in kv.stats().get("peers", [])}


def sentinel_fetched(a: str, b: str) -> None:
    """A prompt stored on a after everything before it, fetched by b: b's index has caught up
    with a's events."""
    tokens = prompt(99, 5 * BLOCK)
    rng = np.random.default_rng(0)
    with Client(a, token=TOKEN) as kv, kv.lease("sentinel", tokens) as lease:
        pool = lease.pool()
        for i in lease.new_block_ids:
            pool.block_bytes(i)[:] = rng.integers(0, 256, pool.block_bytes(i).shape,
                                                  dtype=np.uint8)
        lease.insert(tokens, lease.new_block_ids, release=True)

    def fetched() -> bool:
        with Client(b, token=TOKEN) as kv:
            m = kv.match("sentinel", tokens)
            kv.release(m.lease_id)
            return len(m.block_ids) == 5
    wait_for(fetched, timeout=60, what="b to learn what a holds")


@pytest.fixture(scope="module")
def members(model_dir: str, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
            ) -> Iterator[tuple[Any, Driver, Driver, Path]]:
    work = tmp_path_factory.mktemp("vllm-peer")
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    flags = ("--model-config", str(Path(model_dir) / "config.json"), "--dtype", "bf16",
             "--block-size", str(BLOCK), "--num-blocks", "96")
    with local_cluster(0, *flags, router=False) as c, \
            pytest.MonkeyPatch.context() as mp:
        for node in ("a", "b"):
            port = free_port()
            c.start_member(node, "--tcp", f"127.0.0.1:{port}", "--advertise",
                           f"127.0.0.1:{port}", "--auth-token-file", str(token_file),
                           "--peer-fetch")
        mp.setenv("RADIXKV_AUTH_TOKEN", TOKEN)  # the engines' connectors send it
        with ThreadPoolExecutor(2) as ex:  # each engine loads on its own CPU
            fa = ex.submit(Engine, model_dir, connector(c.members["a"].socket, work / "a.jsonl"),
                           "0", work / "a.log", prefix_cache=True)
            fb = ex.submit(Engine, model_dir, connector(c.members["b"].socket, work / "b.jsonl"),
                           "1", work / "b.log")
            engines = [f.result() for f in (fa, fb)]
        try:
            yield c, engines[0], engines[1], work
        finally:
            for e in engines:
                with contextlib.suppress(BaseException):
                    e.quit()
            for e in engines:
                e.close()


def test_an_engine_on_another_member_gets_the_prefix_through_peer_fetch(members) -> None:
    c, a, b, work = members
    sock_a, sock_b = c.members["a"].socket, c.members["b"].socket
    first = SYSTEM + prompt(22, 60)
    assert a.generate(first)["cached"] == [0]
    with Client(sock_a, token=TOKEN) as kv:
        wait_for(lambda: sum(ns["cached_blocks"] for ns in kv.stats()["namespaces"]) >= 4,
                 what="A's store on a")
    sentinel_fetched(sock_a, sock_b)
    before = peers_of(sock_b).get("a", {}).get("blocks_in", 0)
    rb = b.generate(first)  # b's connector: "ask again" while b fetches, then the 4 blocks
    assert rb["cached"] == [4 * BLOCK]
    again = a.generate(first)  # from A's own prefix cache
    assert again["cached"] == [4 * BLOCK] and rb["outputs"] == again["outputs"]
    assert peers_of(sock_b)["a"]["blocks_in"] - before == 4
    assert peers_of(sock_a)["b"]["blocks_out"] >= 4
    for sock in (sock_a, sock_b):
        with Client(sock, token=TOKEN) as kv:
            wait_for(lambda kv=kv: kv.stats()["live_leases"] == 0, what="leases released")
            assert kv.stats(check_integrity=True)["integrity"] == "ok"
