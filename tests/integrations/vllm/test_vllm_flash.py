"""The vLLM connector's worker side on vLLM's FlashAttention KV layout (per layer
[2, pages, block_size, kv_heads, head_dim], as vLLM keeps it on GPUs), through a real radixkv
server: a writer process stores its pages (copy into the pool, Insert), a reader process loads
them into its own pages (copy out, Release), both with the connector's WorkerSide and Link.

On "cuda" (marked gpu; scripts/gpu_check runs it) the pool is radixkv's CUDA-IPC pool and the
pages are GPU tensors: device-to-device copies, stream-synchronized before Insert and Release.
On "cpu" the same path runs on the host pool (FlashPages on CPU tensors), so the test's logic is
checked on every machine. vLLM itself is not needed: WorkerSide gets vLLM's tensors as
`register_kv_caches` would hand them over.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("grpc", reason="radixkv's server needs grpcio")

from radixkv.server.launch import start_server  # noqa: E402

LAYERS, HEADS, DIM, BLOCK, PAGES = 3, 2, 16, 16, 12
SPAWN = multiprocessing.get_context("spawn")


def cuda_ready() -> bool:
    try:
        from kvpool.cuda import is_available
    except ImportError:
        return False
    return bool(is_available() and torch.cuda.is_available())


def pages_of(seed: int, device: str) -> dict[str, Any]:
    """vLLM-shaped KV caches for LAYERS layers (names as vLLM gives them), seeded."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn(2, PAGES, BLOCK, HEADS, DIM, generator=g).to(torch.bfloat16).to(device)
            for i in range(LAYERS)}


def _side(sock: str, device: str, seed: int, tokens: list[int], pages: list[int],
          store: bool, writer_pages: list[int], out: Any) -> None:
    """A writer (store=True: its seeded pages `pages` go to radixkv under `tokens`) or a reader
    (loads the cached prefix of `tokens` into zeroed pages `pages`); puts a result dict."""
    try:
        from radixkv.client import STORE_ALL
        from radixkv.integrations.link import Link
        from radixkv.integrations.vllm.messages import Load, Save
        from radixkv.integrations.vllm.stats import Stats
        from radixkv.integrations.vllm.worker import WorkerSide

        if device == "cuda":
            torch.cuda.set_device(0)
        link = Link(sock, f"vllm-{'writer' if store else 'reader'}", check=lambda c: None)
        assert link.start()
        worker = WorkerSide(link, None, HEADS, DIM, BLOCK, Stats(None))
        caches = pages_of(seed, device)
        if not store:
            caches = {k: torch.zeros_like(v) for k, v in caches.items()}
        worker.register(caches)
        client = link.client
        if store:
            m = client.match("ns", tokens, 60.0, STORE_ALL)
            worker.save([Save("w", m.lease_id, m.epoch, "ns", tuple(tokens),
                              m.block_ids + m.new_block_ids, m.new_block_ids, tuple(pages))])
            assert worker.take_sent() == {"w"}
            out.put({"stored": len(m.new_block_ids)})
        else:
            m = client.match("ns", tokens, 60.0)
            n = m.num_tokens // BLOCK
            worker.load([Load("r", m.lease_id, m.epoch, m.block_ids[:n], tuple(pages[:n]))])
            failed = worker.take_failed()
            pool = client.pool_of(m.epoch).view()
            # the pool holds radixkv's canonical [layers, 2, block, heads, dim] of each page
            canonical = all(
                torch.equal(pool[b, i], kv[:, p])
                for b, p in zip(m.block_ids[:n], pages[:n], strict=True)
                for i, kv in enumerate(worker.layers))
            # the writer's pages (writer_pages, seed 1) arrived in this reader's pages
            written = pages_of(1, "cpu")
            arrived = all(torch.equal(kv.cpu()[:, p], written[name][:, w])
                          for name, kv in caches.items()
                          for w, p in zip(writer_pages, pages[:n], strict=False))
            untouched = [p for p in range(PAGES) if p not in pages[:n]]
            rest_zero = not any(kv[:, untouched].any() for kv in caches.values())
            out.put({"loaded": n, "failed": sorted(failed), "canonical": canonical,
                     "arrived": arrived, "rest_zero": rest_zero,
                     "device": str(worker.layers[0].device),
                     "pool_device": str(pool.device)})
        link.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put({"error": f"{type(e).__name__}: {e}"})


def run_side(*args: Any) -> dict[str, Any]:
    q = SPAWN.Queue()
    proc = SPAWN.Process(target=_side, args=(*args, q))
    proc.start()
    result = q.get(timeout=120)
    proc.join(30)
    assert "error" not in result, result["error"]
    return dict(result)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_flash_pages_between_processes_through_the_pool(device: str, tmp_path: Path) -> None:
    if device == "cuda" and not cuda_ready():
        pytest.skip("needs a CUDA GPU visible to CuPy and torch")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": LAYERS, "num_attention_heads": 4,
                                  "num_key_value_heads": HEADS, "head_dim": DIM,
                                  "hidden_size": 4 * DIM}))
    sock = str(tmp_path / "s.sock")
    server = start_server(sock, "--model-config", str(config), "--dtype", "bf16",
                          "--block-size", str(BLOCK), "--num-blocks", "16",
                          "--backend", "cuda" if device == "cuda" else "host")
    try:
        tokens = list(range(1000, 1000 + 4 * BLOCK + 5))
        written_pages = [7, 2, 9, 4]  # the writer's pages of the 4 full blocks
        assert run_side(sock, device, 1, tokens, written_pages, True, [])["stored"] == 4
        # a prompt sharing its first 3 blocks: the reader loads exactly those into its pages
        other = tokens[:3 * BLOCK] + list(range(5000, 5000 + BLOCK + 7))
        read_pages = [0, 11, 5]
        r = run_side(sock, device, 2, other, read_pages, False, written_pages[:3])
        assert r["loaded"] == 3 and r["failed"] == [] and r["canonical"]
        assert r["arrived"] and r["rest_zero"]
        assert r["device"].startswith(device) and r["pool_device"].startswith(device)
    finally:
        server.stop()
