"""`bench/vllm_ttft.py --peer`: engine B's member is not engine A's; B's prefix comes by peer fetch.

    etcd on loopback; members a and b (`serve --peer-fetch`, TCP with the cluster token)
    A  radixkv connector on a    P+sA, stored on a (all of A's prompts first, then A exits)
    B  radixkv connector on b    P+sB: b pulls P's blocks from a while B's connector answers
                                 vLLM "ask again", then loads them            -> TTFT peer
    N  no connector              P+sC (no cache), then P+sB from its own prefix cache

`peer_fetch_ms` is b's own time fetching from a during B's request (Stats peers); B's greedy
output is compared with N's from vLLM's own prefix cache (`outputs_identical_to_vllm_prefix_cache`).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import log

from radixkv.client import Client
from radixkv.cluster.local import free_port, local_cluster

TOKEN = "vllm-peer-bench-token-0123456789"


@contextlib.contextmanager
def two_members(directory: str, *flags: str) -> Iterator[tuple[str, str]]:
    """etcd + members a and b, each on its own TCP port with the token and --peer-fetch; the
    engines started meanwhile send the token (RADIXKV_AUTH_TOKEN). Yields their sockets."""
    token_file = Path(directory) / "token"
    token_file.write_text(TOKEN + "\n")
    before = os.environ.get("RADIXKV_AUTH_TOKEN")
    os.environ["RADIXKV_AUTH_TOKEN"] = TOKEN
    try:
        with local_cluster(0, *flags, router=False) as c:
            for node in ("a", "b"):
                port = free_port()
                c.start_member(node, "--tcp", f"127.0.0.1:{port}", "--advertise",
                               f"127.0.0.1:{port}", "--auth-token-file", str(token_file),
                               "--peer-fetch")
            yield c.members["a"].socket, c.members["b"].socket
    finally:
        if before is None:
            os.environ.pop("RADIXKV_AUTH_TOKEN", None)
        else:
            os.environ["RADIXKV_AUTH_TOKEN"] = before


def fetch_totals(socket: str) -> tuple[float, int]:
    """Member b's fetch time (ms) and blocks from a, so far."""
    with Client(socket, token=TOKEN) as kv:
        peer = {p["node_id"]: p for p in kv.stats().get("peers", [])}.get("a", {})
    return float(peer.get("fetch_ms", 0.0)), int(peer.get("blocks_in", 0))


def measure_peer(args: Any, shares: list[int], cases: list[tuple[int, list[int], list[int],
                 list[int]]], b: Any, nc: Any, sock_b: str,
                 text: Callable[[int], list[int]], ttft: Callable[[dict[str, Any]], float]
                 ) -> list[dict[str, Any]]:
    """B and N take turns to go first, each timed request after a short untimed one (as
    vllm_ttft.measure); the first case is a warm-up."""
    t: dict[int, dict[str, list[Any]]] = {
        s: {k: [] for k in ("peer", "no_cache", "pc", "fetch_ms", "fetched", "hit", "same")}
        for s in shares}

    def timed(engine: Any, prompt: list[int]) -> dict[str, Any]:
        engine.generate(text(32), max_tokens=1)
        return dict(engine.generate(prompt, max_tokens=args.max_tokens))

    def peer(prompt: list[int]) -> tuple[dict[str, Any], float, int]:
        ms0, n0 = fetch_totals(sock_b)
        answer = timed(b, prompt)
        ms1, n1 = fetch_totals(sock_b)
        return answer, ms1 - ms0, n1 - n0

    for i, (share, _, pb, pc) in enumerate(cases):
        if i % 2:
            rb, fetch_ms, fetched = peer(pb)
        rn = timed(nc, pc)
        rp = timed(nc, pb)
        if not i % 2:
            rb, fetch_ms, fetched = peer(pb)
        log(f"bench: {share}% shared{' (warm-up)' if i == 0 else ''}: peer "
            f"{ttft(rb) * 1e3:.0f} ms (hit {rb['cached'][0]}, fetch {fetch_ms:.0f} ms, "
            f"{fetched} blocks), no cache {ttft(rn) * 1e3:.0f}, vLLM cache "
            f"{ttft(rp) * 1e3:.0f} (hit {rp['cached'][0]})")
        if i == 0:
            continue
        row = t[share]
        for key, value in (("peer", ttft(rb)), ("no_cache", ttft(rn)), ("pc", ttft(rp)),
                           ("fetch_ms", fetch_ms), ("fetched", fetched),
                           ("hit", rb["cached"][0]), ("same", rb["outputs"] == rp["outputs"])):
            row[key].append(value)
    return [_row(args, s, t[s]) for s in shares]


def _row(args: Any, share: int, t: dict[str, list[Any]]) -> dict[str, Any]:
    def ratio(key: str) -> float:
        return float(statistics.median(x / y for x, y in zip(t["peer"], t[key], strict=True)))

    return {"shared_pct": share, "shared_tokens": args.prompt_tokens * share // 100,
            "radixkv_hit_tokens": min(t["hit"]), "peer_fetched_blocks": min(t["fetched"]),
            "peer_fetch_ms": statistics.median(t["fetch_ms"]),
            "ttft_peer_ms": statistics.median(t["peer"]) * 1e3,
            "ttft_no_cache_ms": statistics.median(t["no_cache"]) * 1e3,
            "ttft_vllm_prefix_cache_ms": statistics.median(t["pc"]) * 1e3,
            "ratio_vs_no_cache": ratio("no_cache"),
            "ratio_vs_vllm_prefix_cache": ratio("pc"),
            "outputs_identical_to_vllm_prefix_cache": all(t["same"]),
            "ttft_peer_each_ms": [x * 1e3 for x in t["peer"]]}
