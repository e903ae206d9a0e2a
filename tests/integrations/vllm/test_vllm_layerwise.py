"""The vLLM connector's layer-wise loads (radixkv.integrations.vllm.loader) through a real radixkv
server: a writer stores its pages (copy into the pool, Insert), a reader loads them on its
loader thread layer by layer while its own thread waits for each layer in turn, as vLLM's
attention does (`wait_for_layer_load`). vLLM itself is not needed: WorkerSide gets vLLM-shaped
KV tensors (its GPU page layout, on CPU tensors) as `register_kv_caches` would hand them over;
tests/integrations/vllm/test_vllm.py runs the same path inside real vLLM engines.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("grpc", reason="radixkv's server needs grpcio")

from radixkv.client.client import STORE_ALL  # noqa: E402
from radixkv.integrations.link import Link  # noqa: E402
from radixkv.integrations.vllm.loader import parse_cpus  # noqa: E402
from radixkv.integrations.vllm.messages import Load, Save  # noqa: E402
from radixkv.integrations.vllm.stats import Stats  # noqa: E402
from radixkv.integrations.vllm.worker import WorkerSide  # noqa: E402
from radixkv.protocol.errors import LeaseExpired, NotFound  # noqa: E402
from radixkv.server.launch import ServerProcess, start_server  # noqa: E402

LAYERS, HEADS, DIM, BLOCK, PAGES = 6, 2, 16, 16, 12
TOKENS = list(range(1000, 1000 + 4 * BLOCK + 5))  # 4 whole blocks
WRITER_PAGES = [7, 2, 9, 4]
READER_PAGES = [0, 11, 5, 3]


def caches(seed: int | None) -> dict[str, Any]:
    """vLLM-shaped KV caches (names as vLLM gives them): seeded, or zeros (seed None)."""
    g = torch.Generator().manual_seed(seed or 0)
    return {f"model.layers.{i}.self_attn.attn":
            (torch.randn(2, PAGES, BLOCK, HEADS, DIM, generator=g) if seed is not None
             else torch.zeros(2, PAGES, BLOCK, HEADS, DIM)).to(torch.bfloat16)
            for i in range(LAYERS)}


def worker(sock: str, name: str, kv: dict[str, Any], stats: Path | None = None) -> WorkerSide:
    link = Link(sock, f"vllm-{name}", check=lambda c: None)
    assert link.start()
    w = WorkerSide(link, None, HEADS, DIM, BLOCK, Stats(str(stats) if stats else None))
    w.register(kv)
    return w


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    """A radixkv server holding TOKENS' 4 blocks, stored from a writer's WRITER_PAGES."""
    tmp = tmp_path_factory.mktemp("layerwise")
    config = tmp / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": LAYERS, "num_attention_heads": 4,
                                  "num_key_value_heads": HEADS, "head_dim": DIM,
                                  "hidden_size": 4 * DIM}))
    sock = str(tmp / "s.sock")
    server: ServerProcess = start_server(sock, "--model-config", str(config), "--dtype", "bf16",
                                         "--block-size", str(BLOCK), "--num-blocks", "16")
    try:
        kv = caches(1)
        w = worker(sock, "writer", kv)
        m = w.link.client.match("ns", TOKENS, 60.0, STORE_ALL)
        w.save([Save("w", m.lease_id, m.epoch, "ns", tuple(TOKENS),
                     m.block_ids + m.new_block_ids, m.new_block_ids, tuple(WRITER_PAGES))])
        assert w.take_sent() == {"w"} and len(m.new_block_ids) == 4
        w.close()
        w.link.close()
        yield sock, kv
    finally:
        server.stop()


def arrived(reader: WorkerSide, written: dict[str, Any], name: str) -> bool:
    kv = dict(zip(reader.names, reader.layers, strict=True))[name]
    return all(torch.equal(kv[:, p], written[name][:, w])
               for w, p in zip(WRITER_PAGES, READER_PAGES, strict=True))


def test_layers_arrive_in_order_and_the_lease_is_released(
        stored: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    sock, written = stored
    reader = worker(sock, "reader", caches(None), tmp_path / "stats.jsonl")
    try:
        assert reader.loader is not None  # CPU pages: layer-wise by default
        m = reader.link.client.match("ns", TOKENS, 60.0)
        assert m.num_tokens == 4 * BLOCK
        reader.start_loads([Load("r", m.lease_id, m.epoch, tuple(m.block_ids),
                                 tuple(READER_PAGES))])
        for name in reader.names:  # vLLM's forward: each layer's attention waits for its own
            reader.wait_layer(name)
            assert arrived(reader, written, name), name
        assert reader.take_failed() == set()  # finishes the step: copies and Release
        with pytest.raises((LeaseExpired, NotFound)):  # the loader thread ended the lease
            reader.link.client.keep_alive(m.lease_id)
        untouched = [p for p in range(PAGES) if p not in READER_PAGES]
        assert not any(kv[:, untouched].any() for kv in reader.layers)
        line = json.loads((tmp_path / "stats.jsonl").read_text().splitlines()[-1])
        assert line["op"] == "load" and line["ok"] and line["layerwise"]
        assert line["waited_layers"] == LAYERS
        assert line["cpu_s"] > 0 and line["copy_s"] >= line["cpu_s"] * 0.5
        engine = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - engine
        # the loader runs beside the engine's thread: on the CPUs it is not bound to
        assert line["loader_cpus"] == sorted(others or engine)
    finally:
        reader.close()
        reader.link.close()


def test_a_lease_ended_before_the_copy_finished_is_reported_failed(
        stored: tuple[str, dict[str, Any]]) -> None:
    """The lease ends while the load is scheduled (another holder of the client id ends it,
    as an expiry would): the pages are copied but reported failed, so vLLM recomputes them."""
    sock, _ = stored
    reader = worker(sock, "reader2", caches(None))
    try:
        m = reader.link.client.match("ns", TOKENS, 60.0)
        reader.link.client.release(m.lease_id)
        reader.start_loads([Load("r", m.lease_id, m.epoch, tuple(m.block_ids),
                                 tuple(READER_PAGES))])
        for name in reader.names:
            reader.wait_layer(name)
        assert reader.take_failed() == set(READER_PAGES)
        assert reader.take_failed() == set()  # reported once
    finally:
        reader.close()
        reader.link.close()


def test_a_load_from_a_gone_pool_fails_before_any_copy(stored: tuple[str, dict[str, Any]]) -> None:
    """A lease of another pool epoch (radixkv restarted since the Match): nothing is copied, the
    pages are failed, and the forward never waits."""
    sock, _ = stored
    reader = worker(sock, "reader3", caches(None))
    try:
        reader.start_loads([Load("r", 1, "no-such-epoch", (0, 1), (0, 1))])
        assert reader.loader is not None and not reader.loader.pending
        reader.wait_layer(reader.names[0])
        assert reader.take_failed() == {0, 1}
        assert not any(kv.any() for kv in reader.layers)
    finally:
        reader.close()
        reader.link.close()


def test_a_copy_that_fails_fails_its_load_only(stored: tuple[str, dict[str, Any]]) -> None:
    """Two loads in one step, the first into pages vLLM does not have: it fails (its lease
    ended all the same), the second arrives whole, and no wait hangs."""
    sock, written = stored
    reader = worker(sock, "reader5", caches(None))
    try:
        client = reader.link.client
        bad, good = client.match("ns", TOKENS, 60.0), client.match("ns", TOKENS, 60.0)
        reader.start_loads([
            Load("bad", bad.lease_id, bad.epoch, tuple(bad.block_ids), (PAGES + 5,) * 4),
            Load("good", good.lease_id, good.epoch, tuple(good.block_ids), tuple(READER_PAGES))])
        for name in reader.names:
            reader.wait_layer(name)
            assert arrived(reader, written, name), name
        assert reader.take_failed() == {PAGES + 5}
        for lease in (bad, good):
            with pytest.raises((LeaseExpired, NotFound)):
                client.keep_alive(lease.lease_id)
    finally:
        reader.close()
        reader.link.close()


def test_the_forward_waits_only_for_its_layer(stored: tuple[str, dict[str, Any]]) -> None:
    """Two steps in a row, each waited on from another thread than the one that started it
    (the loader thread is shared, one job at a time): every wait returns with its layer there."""
    sock, written = stored
    reader = worker(sock, "reader4", caches(None))
    try:
        for _ in range(2):
            for kv in reader.layers:
                kv.zero_()
            m = reader.link.client.match("ns", TOKENS, 60.0)
            reader.start_loads([Load("r", m.lease_id, m.epoch, tuple(m.block_ids),
                                     tuple(READER_PAGES))])
            seen: list[bool] = []

            def forward(seen: list[bool] = seen) -> None:
                for n in reader.names:
                    reader.wait_layer(n)
                    seen.append(arrived(reader, written, n))

            t = threading.Thread(target=forward)
            t.start()
            t.join(30)
            assert seen == [True] * LAYERS
            assert reader.take_failed() == set()
    finally:
        reader.close()
        reader.link.close()


def test_load_cpus_setting() -> None:
    n = os.cpu_count() or 1
    assert parse_cpus("engine", {0}) is None
    assert parse_cpus("auto", set(range(n))) is None  # the engine has them all: share
    assert parse_cpus("auto", {0}) == (set(range(1, n)) or None)
    assert parse_cpus("1,3-4", {0}) == {1, 3, 4}
    with pytest.raises(ValueError, match="load_cpus 'x'"):
        parse_cpus("x", {0})
