"""The vLLM connector's fast path against a real radixkv: the scheduler side reads cached
prefixes from the lookup table (no call: the service counts no request, nothing is pinned), the
worker side pins them with one Match before its copy; a block evicted between the two is a
failed load (vLLM recomputes it), never a copy of other KV; saves are planned from the table and
allocated by the worker. vLLM itself is not needed (as test_vllm_epoch.py: vLLM-shaped requests
and KV tensors); test_vllm.py runs the same sides inside real vLLM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvpool.layout import KVLayout  # noqa: E402
from radixkv.client.client import STORE_ALL, Client  # noqa: E402
from radixkv.integrations.link import Link  # noqa: E402
from radixkv.integrations.vllm.scheduler import SchedulerSide, check_layout  # noqa: E402
from radixkv.integrations.vllm.stats import Stats  # noqa: E402
from radixkv.integrations.vllm.worker import WorkerSide  # noqa: E402
from radixkv.server.launch import start_server  # noqa: E402
from radixkv.table import table_format  # noqa: E402

pytestmark = pytest.mark.skipif(not table_format.supported(),
                                reason="the lookup table is published on x86-64")

HEADS, DIM, BLOCK, PAGES = 2, 16, 16, 8
ENGINE = KVLayout(2, HEADS, DIM, "bf16", BLOCK)
TOKENS = list(range(700, 700 + 3 * BLOCK + 1))  # 3 whole blocks, the last token to compute
NS = "vllm-table"


def request(req_id: str, tokens: list[int] = TOKENS) -> Any:
    return SimpleNamespace(request_id=req_id, all_token_ids=tokens, status="FINISHED_STOPPED",
                           num_computed_tokens=len(tokens))


class Setup:
    def __init__(self, sock: str, lookup_table: bool = True) -> None:
        def link() -> Link:
            return Link(sock, "vllm-table", check=lambda c: check_layout(c, ENGINE, "--x"),
                        retry_s=0.0)

        self.sock = sock
        self.scheduler = SchedulerSide(link(), NS, BLOCK, 60.0, Stats(None), lookup_table)
        self.worker = WorkerSide(link(), None, HEADS, DIM, BLOCK, Stats(None), layerwise=False)
        assert self.scheduler.link.start() and self.worker.link.start()
        self.kv = {f"model.layers.{i}.self_attn.attn":
                   torch.full((2, PAGES, BLOCK, HEADS, DIM), 1.0, dtype=torch.bfloat16)
                   for i in range(ENGINE.num_layers)}
        self.worker.register(self.kv)
        self.client = Client(sock, client_id="other")

    def store(self, tokens: list[int], value: float) -> tuple[int, ...]:
        """Cache `tokens`' whole blocks (every element `value`) as another engine would."""
        n = len(tokens) // BLOCK * BLOCK
        m = self.client.match(NS, tokens[:n], 60.0, STORE_ALL)
        self.client.pool_of(m.epoch).view()[list(m.new_block_ids)] = value
        self.client.insert(NS, tokens[:n], m.block_ids + m.new_block_ids, m.lease_id,
                           release=True)
        return m.block_ids + m.new_block_ids

    def counters(self) -> tuple[int, int]:
        """(Match queries the service answered, blocks pinned now)."""
        s = self.client.stats()
        return int(s.get("requests", 0)), int(s.get("pinned_blocks", 0))

    def pages_equal(self, pages: list[int], value: float) -> bool:
        return all(bool((kv[:, pages] == value).all()) for kv in self.kv.values())

    def close(self) -> None:
        self.client.close()
        self.worker.close()
        self.scheduler.link.close()
        self.worker.link.close()


def _serve(tmp_path: Path, *flags: str) -> tuple[str, Any]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": HEADS, "head_dim": DIM,
                                  "hidden_size": 4 * DIM}))
    sock = str(tmp_path / "s.sock")
    return sock, start_server(sock, "--model-config", str(config), "--dtype", "bf16",
                              "--block-size", str(BLOCK), "--num-blocks", "16", *flags)


@pytest.fixture()
def setup(tmp_path: Path) -> Iterator[Setup]:
    sock, server = _serve(tmp_path)
    s = Setup(sock)
    try:
        yield s
    finally:
        s.close()
        assert server.stop() == 0


def test_the_scheduler_reads_the_table_and_the_worker_pins_and_loads(setup: Setup) -> None:
    setup.store(TOKENS, 9.0)
    before = setup.counters()
    assert setup.scheduler.matched(request("r"), 0) == 3 * BLOCK
    assert setup.counters() == before  # no Match, nothing pinned on the scheduler's behalf
    setup.scheduler.after_alloc(request("r"), [4, 5, 6], 3 * BLOCK)
    loads, saves = setup.scheduler.take()
    assert [(ld.lease_id, ld.pages, ld.first_block) for ld in loads] == [(0, (4, 5, 6), 0)]
    setup.worker.start_loads(loads)
    assert setup.worker.take_failed() == set()
    assert setup.pages_equal([4, 5, 6], 9.0) and setup.pages_equal([0, 1, 2, 3, 7], 1.0)
    assert setup.counters()[1] == 0  # the worker's lease ended after the copy


def test_a_block_evicted_between_lookup_and_pin_is_a_failed_load(setup: Setup) -> None:
    """The table said 3 blocks; the last one is evicted before the worker's Match: that page is
    reported failed (vLLM recomputes it), the two still cached are loaded, nothing else."""
    setup.store(TOKENS, 9.0)
    assert setup.scheduler.matched(request("r"), 0) == 3 * BLOCK
    setup.scheduler.after_alloc(request("r"), [4, 5, 6], 3 * BLOCK)
    loads, _ = setup.scheduler.take()
    setup.client.clear(NS)  # every block gone, then the first two back with other KV
    setup.store(TOKENS[:2 * BLOCK], 5.0)
    setup.worker.start_loads(loads)
    assert setup.worker.take_failed() == {6}
    assert setup.pages_equal([4, 5], 5.0)  # what the pool holds for these tokens now
    assert setup.pages_equal([6], 1.0)  # untouched: vLLM recomputes it


def test_all_evicted_between_lookup_and_pin_fails_every_page(setup: Setup) -> None:
    setup.store(TOKENS, 9.0)
    assert setup.scheduler.matched(request("r"), BLOCK) == 2 * BLOCK  # 1 block vLLM has
    setup.scheduler.after_alloc(request("r"), [3, 4, 5], 2 * BLOCK)
    loads, _ = setup.scheduler.take()
    assert loads[0].pages == (4, 5) and loads[0].first_block == 1
    setup.client.clear(NS)
    setup.worker.start_loads(loads)
    assert setup.worker.take_failed() == {4, 5}
    assert setup.pages_equal([3, 4, 5], 1.0)
    assert setup.counters()[1] == 0


def test_saves_are_planned_from_the_table_and_allocated_by_the_worker(setup: Setup) -> None:
    setup.store(TOKENS[:BLOCK], 9.0)  # the first block is cached, two are not
    before = setup.counters()
    assert setup.scheduler.finished(request("s"), [0, 1, 2, 3]) is True
    assert setup.counters() == before
    _, saves = setup.scheduler.take()
    assert [(sv.lease_id, sv.pages) for sv in saves] == [(0, (0, 1, 2))]
    for i, kv in enumerate(setup.kv.values()):
        kv[:, 1:3] = 3.0 + i
    setup.worker.save(saves)
    assert setup.worker.take_sent() == {"s"}
    m = setup.client.match(NS, TOKENS[:3 * BLOCK])
    assert m.num_tokens == 3 * BLOCK
    view = setup.client.pool_of(m.epoch).view()
    assert bool((view[m.block_ids[0]] == 9.0).all())  # the cached block was not copied again
    assert bool((view[m.block_ids[1]][0] == 3.0).all())  # layer 0 of page 1
    setup.client.release(m.lease_id)
    assert setup.scheduler.finished(request("t"), [0, 1, 2, 3]) is False  # all cached now


def test_lookup_match_asks_the_service(tmp_path: Path) -> None:
    sock, server = _serve(tmp_path)
    s = Setup(sock, lookup_table=False)
    try:
        s.store(TOKENS, 9.0)
        before = s.counters()[0]
        assert s.scheduler.matched(request("r"), 0) == 3 * BLOCK
        assert s.counters() == (before + 1, 3)  # a Match, and its lease pins the blocks
        s.scheduler.finished(request("r"), [0, 1, 2, 3])
    finally:
        s.close()
        assert server.stop() == 0


def test_without_a_table_the_scheduler_matches(tmp_path: Path) -> None:
    sock, server = _serve(tmp_path, "--no-lookup-table")
    s = Setup(sock)
    try:
        s.store(TOKENS, 9.0)
        before = s.counters()[0]
        assert s.scheduler.matched(request("r"), 0) == 3 * BLOCK
        assert s.counters()[0] == before + 1
        s.scheduler.after_alloc(request("r"), [4, 5, 6], 3 * BLOCK)
        s.worker.start_loads(s.scheduler.take()[0])
        assert s.worker.take_failed() == set() and s.pages_equal([4, 5, 6], 9.0)
    finally:
        s.close()
        assert server.stop() == 0
