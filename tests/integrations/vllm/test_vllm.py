"""The vLLM connector with real vLLM (CPU), a real radixkv server and the real model (SmolLM2).

Two vLLM engines run in their own processes (radixkv.integrations.vllm.driver, with the vLLM
venv's python, .venv-vllm from scripts/bootstrap_vllm), each loaded once for the module; the
tests run in file order on one radixkv socket: B starts while radixkv is absent (A loads beside
it, each engine on its own CPU), A writes prefixes that B reuses, radixkv is SIGKILLed and
restarted under them.

B has no prefix cache of its own: its every hit is radixkv's. A keeps vLLM's own prefix cache,
and A's answer from it is the reference for B's answer from radixkv: the same blocks cached,
the same rest computed, so the same tokens on any CPU. (A prefill that starts after cached
blocks need not round like a full prefill of the same prompt: on CPUs without native bf16
arithmetic vLLM's own prefix cache answers some prompts differently from a full prefill.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from radixkv.client import STORE_ALL, Client
from radixkv.integrations.vllm.driver import Driver
from radixkv.server.launch import ServerProcess, start_server

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
BLOCK = 128  # vLLM's CPU block size; radixkv serves the same

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def vllm_python() -> str:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `bash scripts/bootstrap_vllm` (`bash "
                    "scripts/bootstrap --tests` runs it)")
    return str(VLLM_PYTHON)


@pytest.fixture(scope="module")
def model_dir() -> str:
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from radixkv.engines import models

    entry, _ = models.ensure_converted(models.get_spec(models.REAL_MODEL))
    return str(entry)


def Engine(model: str, connector: dict[str, Any] | None, cpu: str, log: Path,
           prefix_cache: bool = False) -> Driver:
    """A vLLM driver process, without vLLM's own prefix cache unless asked."""
    return Driver(vllm_python(), model, log, connector, cpu,
                  () if prefix_cache else ("--no-prefix-cache",))


class World:
    """The socket, the radixkv server on it (or none), engines A and B."""

    def __init__(self, model: str, directory: str) -> None:
        self.model = model
        self.dir = Path(directory)
        self.socket = str(self.dir / "rkv.sock")
        self.server: ServerProcess | None = None
        self.a: Driver | None = None
        self.b: Driver | None = None
        self._starting_a: Future[Driver] | None = None
        self.config = {"kv_connector": "RadixKVConnector",
                       "kv_connector_module_path": "radixkv.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"socket": self.socket, "retry_s": 0.5}}

    def serve(self, *flags: str, config: str | None = None) -> ServerProcess:
        config = config or str(Path(self.model) / "config.json")
        self.server = start_server(self.socket, "--model-config", config, "--dtype", "bf16",
                                   "--block-size", str(BLOCK), "--num-blocks", "96", *flags)
        return self.server

    def start_a(self) -> None:
        """Start engine A (vLLM's own prefix cache on, CPU 0) in the background: it loads while
        B does, each on its own CPU."""
        if self.a is None and self._starting_a is None:
            self._starting_a = ThreadPoolExecutor(1).submit(
                Engine, self.model, self.config, "0", self.dir / "a.log", prefix_cache=True)

    def engine_a(self) -> Driver:
        """Engine A, once it has started."""
        self.start_a()
        if self.a is None:
            assert self._starting_a is not None
            self.a = self._starting_a.result()
        return self.a

    def client(self) -> Client:
        return Client(self.socket)

    def stats(self) -> dict[str, Any]:
        with self.client() as c:
            return c.stats()

    def cached_blocks(self) -> int:
        return int(sum(ns["cached_blocks"] for ns in self.stats()["namespaces"]))

    def hit_tokens(self) -> int:
        return int(sum(ns["hit_tokens"] for ns in self.stats()["namespaces"]))

    def wait_stored(self, blocks: int, timeout: float = 30.0) -> None:
        """Until radixkv holds at least `blocks` blocks (saves run a step after the end)."""
        deadline = time.monotonic() + timeout
        while self.cached_blocks() < blocks:
            assert time.monotonic() < deadline, f"radixkv holds {self.cached_blocks()} blocks"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def world(model_dir: str) -> Iterator[World]:
    with tempfile.TemporaryDirectory(prefix="rkv-vllm-") as directory:
        w = World(model_dir, directory)
        try:
            yield w
        finally:
            if w._starting_a is not None and w.a is None:  # a test failed while A started
                with contextlib.suppress(BaseException):
                    w.a = w._starting_a.result()
            engines = [e for e in (w.a, w.b) if e is not None]
            for engine in engines:
                engine.quit()
            for engine in engines:
                engine.close()
            if w.server is not None:
                w.server.stop()


def prompt(seed: int, n: int) -> list[int]:
    """`n` token ids of plain English-like ids, distinct per seed."""
    return [100 + (seed * 7919 + i * 104729) % 40000 for i in range(n)]


SYSTEM = prompt(1, 4 * BLOCK)  # a long shared system prompt: 4 blocks


def test_layout_probe_matches_vllm_cache_write() -> None:
    """vLLM's CPU cache write (its real kernel: AMX bf16, fp16 and fp32 here) lands token-major
    in radixkv's canonical block layout after ProbedPages.to_pool, and every copy path (the
    native kernel, vLLM's cache write, strided views, the index gather and scatter) is bit-exact
    both ways, with random page and block ids."""
    code = r"""
from dataclasses import replace
import torch
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from vllm import _custom_ops as ops
from radixkv.integrations import pages_kernel
from radixkv.integrations.layout import ProbedPages
assert pages_kernel.ops() is not None, "the paged-KV copy kernel did not build"
g = torch.Generator().manual_seed(0)
for dt in (torch.bfloat16, torch.float16, torch.float32):
    H, B, D = 3, 128, 64
    isa = _get_attn_isa(dt, B, D)
    def write(k, v, page, slots):
        kc, vc = page.view(page.shape[0], H, 2 * B, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
    pages = ProbedPages.probe(write, H, B, D, dt)
    assert pages.strided is not None  # vLLM's pages are strided views of canonical blocks
    store = torch.zeros(2, 5, H, B, 2 * D, dtype=dt)  # vLLM: the layers in one storage
    cache = list(store.unbind(0))
    key, val = torch.randn(2, 3 * B, H, D).to(dt), torch.randn(2, 3 * B, H, D).to(dt)
    at = torch.randperm(5, generator=g)[:3].tolist()
    blocks = torch.randperm(6, generator=g)[:3].tolist()
    slots = torch.cat([torch.arange(B) + p * B for p in at])
    for l in range(2):
        write(key[l], val[l], cache[l], slots)
    k, v = key.view(2, 3, B, H, D), val.view(2, 3, B, H, D)
    # saves: the kernel (checked taken), strided views, the index gather
    kernel = torch.zeros(6, 2, 2, B, H, D, dtype=dt)
    assert pages._copy_kernel(cache, at, kernel, blocks, to_pool=True)
    for way in (pages, replace(pages, kernel=False), replace(pages, kernel=False, strided=None)):
        pool = torch.zeros(6, 2, 2, B, H, D, dtype=dt)
        way.to_pool(cache, at, pool, blocks)
        for j, blk in enumerate(blocks):
            assert torch.equal(pool[blk, :, 0], k[:, j]) and torch.equal(pool[blk, :, 1], v[:, j])
        assert torch.equal(pool.view(torch.uint8), kernel.view(torch.uint8))
    # loads: the kernel, one layer at a time as the loader calls it, vLLM's cache write,
    # strided views, the index scatter
    back = [torch.zeros_like(c) for c in cache]
    assert pages._copy_kernel(back, at, pool, blocks, to_pool=False)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cache, back))
    for l in range(2):
        back = torch.zeros_like(cache[l])
        pages.from_pool([back], at, pool[:, l:l + 1], blocks)
        assert torch.equal(back.view(torch.uint8), cache[l].view(torch.uint8))
    for way in (replace(pages, kernel=False), replace(pages, kernel=False, write=None),
                replace(pages, kernel=False, write=None, strided=None)):
        back = [torch.zeros_like(c) for c in cache]
        way.from_pool(back, at, pool, blocks)
        assert all(torch.equal(a, b) for a, b in zip(cache, back))
    print(dt, isa, "ok")
"""
    out = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True,
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(" ok") == 3, out.stdout


def test_radixkv_absent_at_start_is_a_logged_fallback(world: World) -> None:
    """B starts with no radixkv on its socket: it serves (misses) and says why."""
    config = json.loads(json.dumps(world.config))  # B's own stats file
    config["kv_connector_extra_config"]["stats_file"] = str(world.dir / "b.jsonl")
    world.start_a()  # (A is used from the next test on)
    world.b = Engine(world.model, config, "1", world.dir / "b.log")
    r = world.b.generate(SYSTEM + prompt(2, 50))
    assert r["cached"] == [0] and len(r["outputs"][0]) == 8
    assert "radixkv at" in world.b.stderr() and "unavailable" in world.b.stderr()


def test_cross_instance_reuse(world: World) -> None:
    """A (its own process) stores a long system prompt; B loads it from radixkv: radixkv's hit
    counter and vLLM's external-hit count say so, and B's greedy tokens equal A's answer from
    vLLM's own prefix cache holding the same blocks (no connector involved)."""
    world.serve()
    world.engine_a()
    assert world.a is not None
    first = SYSTEM + prompt(3, 60)
    time.sleep(0.6)  # A started while radixkv was absent too: its link retries after retry_s
    ra = world.a.generate(first)
    assert ra["cached"] == [0]
    world.wait_stored(4)  # the 4 system blocks (+ none of the 60-token tail)
    time.sleep(0.6)  # B's link retries after retry_s
    hits0, ext0 = world.hit_tokens(), world.b.external_hits()  # type: ignore[union-attr]
    assert world.b is not None
    rb = world.b.generate(first)
    assert rb["cached"] == [4 * BLOCK]
    again = world.a.generate(first)  # from A's own prefix cache: the 4 blocks, nothing external
    assert again["cached"] == [4 * BLOCK]
    assert rb["outputs"] == again["outputs"]
    # B's load Match hit the 4 blocks (its end-of-request store Match, which finds them
    # cached and stores nothing new, counts them again)
    assert world.hit_tokens() - hits0 >= 4 * BLOCK
    assert world.b.external_hits() - ext0 == 4 * BLOCK
    # B's worker copied the 4 blocks layer by layer on its loader thread, on the CPUs B's
    # engine is not pinned to (B: CPU 1; OpenMP moves it onto CPU 1 at its first cache write,
    # the loader moves back), and vLLM's attention waited for each of the 30 layers
    loads = [json.loads(x) for x in (world.dir / "b.jsonl").read_text().splitlines()]
    loads = [x for x in loads if x["op"] == "load"]
    assert [(x["ok"], x["blocks"], x["layerwise"], x["waited_layers"]) for x in loads] == [
        (True, 4, True, 30)]
    others = sorted(set(range(os.cpu_count() or 1)) - {1})
    assert loads[0]["loader_cpus"] == (others or [1])
    # another user message after the same system prompt: the prefix is reused again
    second = SYSTEM + prompt(4, 70)
    rb2, ra2 = world.b.generate(second), world.a.generate(second)
    assert rb2["cached"] == ra2["cached"] == [4 * BLOCK] and rb2["outputs"] == ra2["outputs"]
    # a cache salt is a namespace of its own: B's salted request loads nothing
    assert world.b.generate(second, salt="another tenant")["cached"] == [0]


def test_partial_prefix_reuses_exactly_k_blocks(world: World) -> None:
    """A prompt sharing only its first 2 blocks with a stored 5-block one loads 2 blocks.

    The reference is A's answer with the same 2 blocks from its own prefix cache, asked under a
    salt of its own and before B: B stores the 3 blocks it computes when its request ends, and
    an unsalted request of A's racing that store could load them too."""
    assert world.a is not None and world.b is not None
    stored = prompt(5, 5 * BLOCK + 10)
    partial = stored[:2 * BLOCK] + prompt(6, 3 * BLOCK)
    before = world.cached_blocks()
    world.a.generate(stored, max_tokens=2)
    world.wait_stored(before + 5)
    salt = "the reference"  # the same full prefill, so the same bytes, in A's own cache
    world.a.generate(stored, max_tokens=2, salt=salt)
    ra = world.a.generate(partial, salt=salt)
    assert ra["cached"] == [2 * BLOCK]
    hits0 = world.hit_tokens()
    r = world.b.generate(partial)
    assert r["cached"] == [2 * BLOCK]
    assert world.hit_tokens() - hits0 >= 2 * BLOCK
    assert r["outputs"] == ra["outputs"]
    # B's store of its 3 blocks has landed before the next test counts blocks
    deadline = time.monotonic() + 30
    with world.client() as c:
        ns = next(n["namespace"] for n in c.stats()["namespaces"] if "|salt=" not in n["namespace"])
        while True:
            with c.lease(ns, partial[:5 * BLOCK], store_tokens=0) as lease:
                if lease.num_tokens == 5 * BLOCK:
                    break
            assert time.monotonic() < deadline, "B's blocks were not stored"
            time.sleep(0.1)


def test_loaded_kv_is_really_used(world: World) -> None:
    """Overwrite the cached blocks of a stored prompt through the client: B's output, the
    same as A's from its own prefix cache before, changes."""
    assert world.a is not None and world.b is not None
    p = prompt(7, 3 * BLOCK + 20)
    before = world.cached_blocks()
    world.a.generate(p)
    world.wait_stored(before + 3)
    clean = world.a.generate(p)["outputs"]  # from A's own prefix cache
    assert world.b.generate(p)["outputs"] == clean
    with world.client() as c:
        ns = [n["namespace"] for n in c.stats()["namespaces"]][0]
        with c.lease(ns, p[:3 * BLOCK], store_tokens=0) as lease:
            assert lease.num_tokens == 3 * BLOCK
            view = lease.view()
            for block in lease.block_ids:
                view[block].normal_()  # noise instead of the model's keys and values
    r = world.b.generate(p)
    assert r["cached"] == [3 * BLOCK]
    assert r["outputs"] != clean


def test_radixkv_killed_mid_run_means_misses(world: World) -> None:
    """SIGKILL radixkv: B keeps serving (misses, a warning), the same tokens as A."""
    assert world.a is not None and world.b is not None and world.server is not None
    world.server.stop(signal.SIGKILL)
    p = SYSTEM + prompt(8, 40)
    rb = world.b.generate(p)
    full = world.a.generate(p, salt="a full prefill")  # the salt misses A's own cache
    assert rb["cached"] == full["cached"] == [0] and rb["outputs"] == full["outputs"]
    assert world.b.stderr().count("unavailable") >= 2  # once at start, once for this outage


def test_radixkv_restarted_new_epoch_hits_again(world: World) -> None:
    """radixkv restarts (a new pool epoch): the connectors remap and hit again. One request
    each first: a link marked down retries after retry_s, and that request may still miss
    (or store nothing) while the scheduler's and the worker's links come back."""
    assert world.a is not None and world.b is not None
    world.serve()
    time.sleep(0.6)
    world.a.generate(prompt(19, 300))  # no shared prefix with what follows
    world.b.generate(prompt(29, 300))
    time.sleep(0.6)
    before = world.cached_blocks()
    p = SYSTEM + prompt(9, 30)
    ra = world.a.generate(p)  # SYSTEM from A's own cache; all 4 blocks stored
    world.wait_stored(before + 4)
    time.sleep(0.6)
    rb = world.b.generate(p)
    assert rb["cached"] == ra["cached"] == [4 * BLOCK] and rb["outputs"] == ra["outputs"]
    assert "is back" in world.b.stderr()


def test_a_restart_with_more_layers_loads_nothing(world: World) -> None:
    """radixkv restarts on the same socket with 60 layers (the model has 30), holding a prompt's
    3 blocks: B's request misses (no 60-layer KV loaded into its 30 layers), its log says why,
    and it saves nothing into that pool. Last of the `world` tests: B's link now refuses."""
    assert world.b is not None and world.server is not None
    config = json.loads((Path(world.model) / "config.json").read_text())
    deeper = world.dir / "deeper.json"
    deeper.write_text(json.dumps(dict(config, num_hidden_layers=60)))
    world.server.stop()
    world.serve(config=str(deeper))
    ns = f"vllm:{world.model}@main/bf16"  # the engine's namespace (base_namespace)
    p = prompt(41, 3 * BLOCK + 20)
    with Client(world.socket, client_id="other") as c:
        m = c.match(ns, p[:3 * BLOCK], 60.0, STORE_ALL)
        c.pool_of(m.epoch).view()[list(m.new_block_ids)] = 0.5
        c.insert(ns, p[:3 * BLOCK], m.new_block_ids, m.lease_id, release=True)
    r = world.b.generate(p)
    assert r["cached"] == [0]
    assert "does not fit this vLLM model's KV" in world.b.stderr()
    with world.client() as c:
        assert c.match(ns, p[:3 * BLOCK]).num_tokens == 3 * BLOCK
    assert world.cached_blocks() == 3  # B saved nothing into the 60-layer pool


REFUSE = r"""
import sys
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from radixkv.integrations.vllm import RadixKVConnector
from radixkv.integrations.link import LayoutMismatch
tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
config = EngineArgs(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=2048,
                    tensor_parallel_size=tp,
                    kv_transfer_config=KVTransferConfig(
                        kv_connector="RadixKVConnector", kv_role="kv_both",
                        kv_connector_module_path="radixkv.integrations.vllm",
                        kv_connector_extra_config={"socket": sys.argv[2]})).create_engine_config()
for role in (KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER):
    try:
        RadixKVConnector(config, role)
    except LayoutMismatch as e:
        print(role.name, "refused:", e)
    else:
        print(role.name, "started")
"""


def test_layout_mismatch_is_refused_by_the_connector(model_dir: str, tmp_path: Path) -> None:
    """radixkv serving another layout (fp32 KV, block size 16): the connector, built from
    vLLM's own engine config for this model, refuses in both roles (vLLM's worker builds it at
    start, so vLLM does not start: test_layout_mismatch_refuses_the_engine), the message naming
    both layouts and the `radixkv serve` flags that fit."""
    sock = str(tmp_path / "s.sock")
    server = start_server(sock, "--model-config", str(Path(model_dir) / "config.json"),
                          "--dtype", "fp32", "--block-size", "16", "--num-blocks", "8")
    try:
        out = subprocess.run([vllm_python(), "-c", REFUSE, model_dir, sock], capture_output=True,
                             text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = [line for line in out.stdout.splitlines()  # (vLLM logs to stdout too)
                 if line.startswith(("WORKER ", "SCHEDULER "))]
        assert [line.split(" ", 1)[0] for line in lines] == ["WORKER", "SCHEDULER"], out.stdout
        for line in lines:
            assert " refused: " in line and "does not fit this vLLM model's KV" in line
            assert "fp32, block_size 16" in line and "bf16, block_size 128" in line
            assert "--dtype bf16 --block-size 128" in line
    finally:
        server.stop()


def test_tensor_parallel_ranks_are_refused(model_dir: str, tmp_path: Path) -> None:
    """vLLM with tensor parallelism 3 (one of SmolLM2's 3 KV heads per rank), radixkv serving
    exactly one rank's layout: the connector still refuses, in both roles, as the ranks would
    share one namespace and load each other's heads."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shard = tmp_path / "shard.json"
    shard.write_text(json.dumps(dict(config, num_key_value_heads=1)))
    sock = str(tmp_path / "s.sock")
    server = start_server(sock, "--model-config", str(shard), "--dtype", "bf16",
                          "--block-size", str(BLOCK), "--num-blocks", "8")
    try:
        out = subprocess.run([vllm_python(), "-c", REFUSE, model_dir, sock, "3"],
                             capture_output=True, text=True, cwd=REPO,
                             env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = [line for line in out.stdout.splitlines()
                 if line.startswith(("WORKER ", "SCHEDULER "))]
        assert [line.split(" ", 1)[0] for line in lines] == ["WORKER", "SCHEDULER"], out.stdout
        for line in lines:
            assert " refused: " in line and "tensor_parallel_size 3" in line, line
    finally:
        server.stop()


@pytest.mark.thorough
def test_layout_mismatch_refuses_the_engine(model_dir: str, tmp_path: Path) -> None:
    """The same refusal inside a real vLLM engine's start: vLLM does not start, the message
    naming both layouts and the `radixkv serve` flags that fit (a whole engine start)."""
    sock = str(tmp_path / "s.sock")
    server = start_server(sock, "--model-config", str(Path(model_dir) / "config.json"),
                          "--dtype", "fp32", "--block-size", "16", "--num-blocks", "8")
    try:
        config = {"kv_connector": "RadixKVConnector",
                  "kv_connector_module_path": "radixkv.integrations.vllm", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"socket": sock}}
        with pytest.raises(AssertionError) as refused:
            Engine(model_dir, config, "0", tmp_path / "refused.log")
        text = str(refused.value)
        assert "does not fit this vLLM model's KV" in text
        assert "fp32, block_size 16" in text and "bf16, block_size 128" in text
        assert "--dtype bf16 --block-size 128" in text
    finally:
        server.stop()
