"""The vLLM connector across a radixkv restart with another layout on the same socket: the first
Match of the new pool epoch is checked against the engine's KV layout before any load or save
(a mismatch is a logged miss, the link then refuses); the connector's `stats_file` never raises.
vLLM itself is not needed: SchedulerSide and WorkerSide get vLLM-shaped requests and KV tensors,
as the connector would hand them over (test_vllm.py runs them inside real vLLM).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("grpc", reason="radixkv's server needs grpcio")

from kvpool.layout import KVLayout  # noqa: E402
from radixkv.client.client import STORE_ALL, Client  # noqa: E402
from radixkv.integrations.link import Link  # noqa: E402
from radixkv.integrations.vllm.messages import Load, Save  # noqa: E402
from radixkv.integrations.vllm.scheduler import SchedulerSide, check_layout  # noqa: E402
from radixkv.integrations.vllm.stats import Stats  # noqa: E402
from radixkv.integrations.vllm.worker import WorkerSide  # noqa: E402
from radixkv.server.launch import ServerProcess, start_server  # noqa: E402

HEADS, DIM, BLOCK, PAGES = 2, 16, 16, 8
ENGINE = KVLayout(2, HEADS, DIM, "bf16", BLOCK)  # the engine's KV: 2 layers
TOKENS = list(range(500, 500 + 3 * BLOCK + 1))  # 3 whole blocks, the last token left to compute
NS = "vllm-test"
ID = "vllm-epoch"  # the engine's client id (its scheduler and worker share it)


def serve(directory: Path, sock: str, layers: int) -> ServerProcess:
    config = directory / f"config{layers}.json"
    config.write_text(json.dumps({"num_hidden_layers": layers, "num_attention_heads": 4,
                                  "num_key_value_heads": HEADS, "head_dim": DIM,
                                  "hidden_size": 4 * DIM}))
    return start_server(sock, "--model-config", str(config), "--dtype", "bf16",
                        "--block-size", str(BLOCK), "--num-blocks", "16")


def caches(value: float) -> dict[str, Any]:
    """vLLM-shaped KV caches of ENGINE's layers, every element `value`."""
    return {f"model.layers.{i}.self_attn.attn":
            torch.full((2, PAGES, BLOCK, HEADS, DIM), value, dtype=torch.bfloat16)
            for i in range(ENGINE.num_layers)}


def request(req_id: str) -> Any:
    return SimpleNamespace(request_id=req_id, all_token_ids=TOKENS, status="FINISHED_STOPPED",
                           num_computed_tokens=len(TOKENS))


class Engine:
    """A scheduler side and a worker side, each on its own link (as vLLM's processes are)."""

    def __init__(self, sock: str) -> None:
        def link() -> Link:
            return Link(sock, ID, check=lambda c: check_layout(c, ENGINE, "--fitting-flags"),
                        retry_s=0.0)

        self.scheduler = SchedulerSide(link(), NS, BLOCK, 60.0, Stats(None))
        self.worker = WorkerSide(link(), None, HEADS, DIM, BLOCK, Stats(None), layerwise=False)
        assert self.scheduler.link.start() and self.worker.link.start()
        self.kv = caches(1.0)
        self.worker.register(self.kv)

    def close(self) -> None:
        self.worker.close()
        self.scheduler.link.close()
        self.worker.link.close()


@pytest.fixture()
def restarted(tmp_path: Path) -> Iterator[tuple[str, Engine, ServerProcess]]:
    """An engine that used a fitting radixkv (one miss), then radixkv restarted on the same
    socket with 4 layers, holding TOKENS' 3 blocks (every element 9.0)."""
    sock = str(tmp_path / "s.sock")
    server = serve(tmp_path, sock, 2)
    engine = Engine(sock)
    try:
        assert engine.scheduler.matched(request("warm"), 0) == 0
        server.stop()
        server = serve(tmp_path, sock, 4)
        with Client(sock, client_id="other") as c:
            m = c.match(NS, TOKENS[:3 * BLOCK], 60.0, STORE_ALL)
            c.pool_of(m.epoch).view()[list(m.new_block_ids)] = 9.0
            c.insert(NS, TOKENS[:3 * BLOCK], m.new_block_ids, m.lease_id, release=True)
        yield sock, engine, server
    finally:
        engine.close()
        server.stop()


def cached_blocks(sock: str) -> int:
    with Client(sock) as c:
        return int(sum(ns["cached_blocks"] for ns in c.stats()["namespaces"]))


def test_first_match_of_a_new_epoch_with_another_layout_is_a_miss(
        restarted: tuple[str, Engine, ServerProcess], caplog: pytest.LogCaptureFixture) -> None:
    _, engine, _ = restarted
    with caplog.at_level(logging.ERROR, "radixkv.integrations"):
        assert engine.scheduler.matched(request("r"), 0) == 0
    assert "does not fit this vLLM model's KV" in caplog.text
    assert "4 layers" in caplog.text and "2 layers" in caplog.text
    engine.scheduler.after_alloc(request("r"), list(range(3)), 3 * BLOCK)
    assert engine.scheduler.take() == ([], [])  # no load planned
    assert engine.scheduler.matched(request("r2"), 0) == 0  # the link refuses from now on


def test_first_store_of_a_new_epoch_with_another_layout_stores_nothing(
        restarted: tuple[str, Engine, ServerProcess]) -> None:
    sock, engine, _ = restarted
    other = TOKENS[::-1]
    req = SimpleNamespace(request_id="s", all_token_ids=other, status="FINISHED_STOPPED",
                          num_computed_tokens=len(other))
    assert engine.scheduler.finished(req, [0, 1, 2]) is False
    assert engine.scheduler.take() == ([], [])
    assert cached_blocks(sock) == 3  # only the 4-layer pool's own prompt


def test_worker_checks_the_layout_of_a_new_epoch_before_a_load(
        restarted: tuple[str, Engine, ServerProcess]) -> None:
    """A Load of the new epoch reaches the worker (its scheduler saw that epoch first): no
    copy, the pages are failed, and vLLM's KV is untouched."""
    sock, engine, _ = restarted
    with Client(sock, client_id=ID) as c:
        m = c.match(NS, TOKENS[:3 * BLOCK], 60.0)
    assert m.num_tokens == 3 * BLOCK
    engine.worker.load([Load("r", m.lease_id, m.epoch, tuple(m.block_ids), (0, 1, 2))])
    assert engine.worker.take_failed() == {0, 1, 2}
    assert all(bool((kv == 1.0).all()) for kv in engine.kv.values())


def test_worker_checks_the_layout_of_a_new_epoch_before_a_save(
        restarted: tuple[str, Engine, ServerProcess]) -> None:
    sock, engine, _ = restarted
    other = TOKENS[::-1][:3 * BLOCK]
    with Client(sock, client_id=ID) as c:
        m = c.match(NS, other, 60.0, STORE_ALL)
        engine.worker.save([Save("s", m.lease_id, m.epoch, NS, tuple(other), m.new_block_ids,
                                 m.new_block_ids, (0, 1, 2))])
        assert engine.worker.take_sent() == {"s"}
        assert c.match(NS, other).num_tokens == 0  # nothing inserted
        assert not (c.pool_of(m.epoch).view()[list(m.new_block_ids)] == 1.0).any()


# ---- stats_file ------------------------------------------------------------------------------

def test_stats_file_in_a_missing_directory_warns_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stats = Stats(str(tmp_path / "no-such-dir" / "stats.jsonl"))
    with caplog.at_level(logging.WARNING, "radixkv.integrations"):
        stats.record(op="match")
        stats.record(op="match")
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "stats.jsonl" in caplog.text


def test_stats_file_symlink_is_not_followed(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    target = tmp_path / "victim"
    target.write_text("")
    (tmp_path / "stats.jsonl").symlink_to(target)
    stats = Stats(str(tmp_path / "stats.jsonl"))
    with caplog.at_level(logging.WARNING, "radixkv.integrations"):
        stats.record(op="match")
    assert target.read_text() == ""
    assert len(caplog.records) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root")
def test_stats_file_of_another_user_is_not_written(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    planted = tmp_path / "stats.jsonl"
    planted.write_text("")
    os.chown(planted, 4321, 4321)
    with caplog.at_level(logging.WARNING, "radixkv.integrations"):
        Stats(str(planted)).record(op="match")
    assert planted.read_text() == "" and "not a regular file of uid 0's own" in caplog.text


def test_stats_file_is_created_0600_and_appended(tmp_path: Path) -> None:
    path = tmp_path / "stats.jsonl"
    old = os.umask(0o022)
    try:
        stats = Stats(str(path))
        stats.record(op="a", n=1)
        Stats(str(path)).record(op="b")  # another process's connector: appends
        stats.record(op="c")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600
    assert [json.loads(line)["op"] for line in path.read_text().splitlines()] == ["a", "b", "c"]


def test_scheduler_with_an_unwritable_stats_file_keeps_matching(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SchedulerSide.matched with a stats_file whose directory is missing: the match is
    answered (here a miss), never an exception in vLLM's scheduler."""
    sock = str(tmp_path / "s.sock")
    server = serve(tmp_path, sock, 2)
    link = Link(sock, ID, check=lambda c: check_layout(c, ENGINE, "--fitting-flags"))
    try:
        assert link.start()
        side = SchedulerSide(link, NS, BLOCK, 60.0, Stats(str(tmp_path / "gone" / "s.jsonl")))
        with caplog.at_level(logging.WARNING, "radixkv.integrations"):
            assert side.matched(request("a"), 0) == 0
            assert side.matched(request("b"), 0) == 0
        assert sum("s.jsonl" in r.getMessage() for r in caplog.records) == 1
    finally:
        link.close()
        server.stop()
