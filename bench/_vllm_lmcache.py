"""`bench/vllm_ttft.py --lmcache`: the same two-instance run with LMCache's own server in place of
radixkv, interleaved with radixkv's, on the same prompts and the same CPU.

    radixkv:  A  radixkv connector       P+sA stored (all of A's prompts, then A exits)
              B  radixkv connector       P+sB: loads P's whole 128-token blocks  -> TTFT radixkv
    LMCache:  LA LMCacheMPConnector      P+sA stored in `lmcache server` (then LA exits)
              LB LMCacheMPConnector      P+sB: loads P's whole 256-token chunks  -> TTFT LMCache
    N         no connector               P+sC (no cache), then P+sB from vLLM's own prefix cache

LMCache 0.5.6 runs here in its multiprocess mode only (its in-process connector refuses CPU):
`lmcache server` is a process of its own (`.venv-lmcache`, scripts/bootstrap_lmcache, run
by _common.engine_python when missing) that
vLLM's LMCacheMPConnector talks to over ZMQ, the KV in its shared-memory L1. Its chunk is 256
tokens (`--chunk-size`), a multiple of vLLM's CPU block of 128; radixkv serves 128-token blocks.
B, LB and N take turns to go first in each repeat; outputs of B and LB are compared with N's
from vLLM's own prefix cache.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import log

from radixkv.cluster.local import free_port

CHUNK = 256  # LMCache's chunk: whole chunks are stored and loaded
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}


@contextlib.contextmanager
def lmcache_server(python: str, log: Path) -> Iterator[dict[str, Any]]:
    """`lmcache server` on loopback (request port, HTTP and Prometheus ports of its own, an L1 of
    2 GB in shared memory), not pinned (as radixkv's server); SIGTERM at exit, and its shared
    memory segment removed if it left one. Yields its ports."""
    ports = {"port": free_port(), "http_port": free_port(), "prometheus_port": free_port()}
    shm = f"rkv-bench-lmcache-{os.getpid()}"
    cmd = [str(Path(python).with_name("lmcache")), "server",
           "--host", "127.0.0.1", "--port", str(ports["port"]), "--http-host", "127.0.0.1",
           "--http-port", str(ports["http_port"]), "--prometheus-port",
           str(ports["prometheus_port"]), "--chunk-size", str(CHUNK), "--l1-size-gb", "2",
           "--eviction-policy", "LRU", "--supported-transfer-mode", "auto", "--shm-name", shm]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **QUIET}, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not _listening(ports["port"]):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"lmcache server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield ports
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{shm}")


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


def lmcache_connector(port: int) -> dict[str, Any]:
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                          "lmcache.mp.port": port}}


def server_retrieve_s(log: Path) -> list[float]:
    """The server's own time per retrieval, as its log reports it ("Retrieved N tokens in S
    seconds"), in order."""
    found = re.findall(r"Retrieved \d+ tokens in ([0-9.]+) seconds", log.read_text())
    return [float(x) for x in found]


def measure_lmcache(args: Any, shares: list[int], cases: list[tuple[int, list[int], list[int],
                    list[int]]], engines: tuple[Any, Any, Any], b_stats: Any, server_log: Path,
                    text: Callable[[int], list[int]],
                    ttft: Callable[[dict[str, Any]], float]) -> list[dict[str, Any]]:
    """B, LB and N (no cache, then its prefix cache) in a rotating order; each timed request
    after a short untimed one on the same engine (as vllm_ttft.measure); the first case is a
    warm-up. Each side's own time beside its TTFT: radixkv's Match and load copy (B's stats
    file), the LMCache server's retrieval (its log)."""
    b, lb, nc = engines
    keys = ("radixkv", "lmcache", "no_cache", "pc", "hit", "lm_hit", "same", "lm_same",
            "rkv_match", "rkv_copy", "lm_retrieve")
    t: dict[int, dict[str, list[Any]]] = {s: {k: [] for k in keys} for s in shares}

    def timed(engine: Any, prompt: list[int]) -> dict[str, Any]:
        engine.generate(text(32), max_tokens=1)
        return dict(engine.generate(prompt, max_tokens=args.max_tokens))

    for i, (share, _, pb, pc) in enumerate(cases):
        got: dict[str, dict[str, Any]] = {}
        order = ["b", "lb", "n"][i % 3:] + ["b", "lb", "n"][:i % 3]
        lines: list[dict[str, Any]] = []
        retrieved = 0.0
        for who in order:
            if who == "b":
                got["b"] = timed(b, pb)
                lines = b_stats.until_saved()
            elif who == "lb":
                seen = len(server_retrieve_s(server_log))
                got["lb"] = timed(lb, pb)
                time.sleep(0.2)  # its log line is written after the load
                retrieved = sum(server_retrieve_s(server_log)[seen:])
            else:
                got["n"] = timed(nc, pc)
                got["pc"] = timed(nc, pb)
        rb, rl, rn, rp = got["b"], got["lb"], got["n"], got["pc"]
        log(f"bench: {share}% shared{' (warm-up)' if i == 0 else ''}: radixkv "
            f"{ttft(rb) * 1e3:.0f} ms (hit {rb['cached'][0]}), LMCache {ttft(rl) * 1e3:.0f} "
            f"(hit {rl['cached'][0]}), no cache {ttft(rn) * 1e3:.0f}, vLLM cache "
            f"{ttft(rp) * 1e3:.0f} (hit {rp['cached'][0]})")
        if i == 0:
            continue
        row = t[share]
        for key, value in (("radixkv", ttft(rb)), ("lmcache", ttft(rl)), ("no_cache", ttft(rn)),
                           ("pc", ttft(rp)), ("hit", rb["cached"][0]),
                           ("lm_hit", rl["cached"][0]), ("same", rb["outputs"] == rp["outputs"]),
                           ("lm_same", rl["outputs"] == rp["outputs"]),
                           ("rkv_match", sum(x["s"] for x in lines if x["op"] == "match")),
                           ("rkv_copy", sum(x.get("copy_s", x["s"]) for x in lines
                                            if x["op"] == "load")),
                           ("lm_retrieve", retrieved)):
            row[key].append(value)
    return [_row(args, s, t[s]) for s in shares]


def _row(args: Any, share: int, t: dict[str, list[Any]]) -> dict[str, Any]:
    def ratio(x: str, y: str) -> float:
        return float(statistics.median(a / b for a, b in zip(t[x], t[y], strict=True)))

    def ms(key: str) -> float:
        return float(statistics.median(t[key])) * 1e3

    return {"shared_pct": share, "shared_tokens": args.prompt_tokens * share // 100,
            "radixkv_hit_tokens": min(t["hit"]), "lmcache_hit_tokens": min(t["lm_hit"]),
            "ttft_radixkv_ms": ms("radixkv"), "ttft_lmcache_ms": ms("lmcache"),
            "ttft_no_cache_ms": ms("no_cache"), "ttft_vllm_prefix_cache_ms": ms("pc"),
            "ratio_radixkv_vs_lmcache": ratio("radixkv", "lmcache"),
            "ratio_vs_no_cache": ratio("radixkv", "no_cache"),
            "ratio_lmcache_vs_no_cache": ratio("lmcache", "no_cache"),
            "outputs_identical_to_vllm_prefix_cache": all(t["same"]),
            "outputs_identical_lmcache": all(t["lm_same"]),
            "radixkv_match_ms": ms("rkv_match"), "radixkv_load_copy_ms": ms("rkv_copy"),
            "lmcache_server_retrieve_ms": ms("lm_retrieve"),
            "ttft_radixkv_each_ms": [x * 1e3 for x in t["radixkv"]],
            "ttft_lmcache_each_ms": [x * 1e3 for x in t["lmcache"]]}


LMCACHE_GOALS = "50 and 90 % shared: radixkv's TTFT <= 0.9x LMCache's and hit tokens >= " \
    "LMCache's; outputs identical to vLLM's prefix cache for both"


def lmcache_goals(rows: list[dict[str, Any]]) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for r in rows:
        if r["shared_pct"] in (50, 90):
            s = r["shared_pct"]
            out[f"{s}pct_ttft_vs_lmcache<=0.9"] = r["ratio_radixkv_vs_lmcache"] <= 0.9
            out[f"{s}pct_hit_tokens>=lmcache"] = \
                r["radixkv_hit_tokens"] >= r["lmcache_hit_tokens"]
    out["outputs_identical_to_vllm_prefix_cache"] = all(
        r["outputs_identical_to_vllm_prefix_cache"] for r in rows)
    out["outputs_identical_lmcache"] = all(r["outputs_identical_lmcache"] for r in rows)
    return out
