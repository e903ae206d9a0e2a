"""A replay over a cluster (`radixkv replay --nodes N` / `--router ADDR`): starting one on this
machine, and the replay's view of it (geometry from the router, Stats summed over members).
Which member each request goes to is radixkv.replay.routing's."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class ReplayWindow:
    """A replay of a sliding-window model: its window and how many window parts the pool has
    beside its full parts (the replay's capacity_blocks)."""

    sliding_window: int  # W tokens
    window_parts: int
    all_windowed: bool = False  # every layer windowed (Mistral): full parts hold no bytes


def service_flags(directory: str, block_size: int, capacity_blocks: int,
                  policy: str, sink_fraction: float = 0.0,
                  window: ReplayWindow | None = None) -> tuple[str, ...]:
    """`radixkv serve` flags of a replay's service: a tiny layout written to `directory`.
    `sink_fraction` > 0 gives the pool a sink region of that share, as a quantized pool with
    sink tokens has (the tiny layout then stores int8). `window`: a sliding-window pool of
    `capacity_blocks` full parts and `window.window_parts` window parts (two tiny layers: the
    first windowed, the second full, unless all are windowed)."""
    config = os.path.join(directory, "config.json")
    with open(config, "w") as f:  # fp16, 1 layer/head/dim: 4 x block_size bytes per block
        json.dump({"num_hidden_layers": 2 if window else 1, "num_attention_heads": 1,
                   "num_key_value_heads": 1, "head_dim": 2 if block_size == 1 else 1,
                   "torch_dtype": "float16"}, f)
    sinks = ("--kv-dtype", "int8", "--kv-sink-fraction", str(sink_fraction),
             "--kv-sink-tokens", str(min(4, block_size - 1))) if sink_fraction else ()
    windowed = ("--sliding-window", str(window.sliding_window), "--window-layers",
                "all" if window.all_windowed else "0", "--num-window-blocks",
                str(window.window_parts)) if window else ()
    return ("--model-config", config, "--block-size", str(block_size),
            "--num-blocks", str(capacity_blocks), "--policy", policy, *sinks, *windowed)


PEER_FETCH_MIN_TOKENS = 64


@dataclass(frozen=True, slots=True)
class StartedCluster:
    """A cluster the replay starts on this machine (`radixkv replay --nodes N`)."""

    nodes: int
    kill_member_after: int | None = None  # SIGKILL member n0 once this many requests are done
    reference: bool = False  # also replay on one node of nodes x capacity (the figure to reach)
    peer_fetch: bool = False  # the members pull prefixes from each other (serve --peer-fetch)


@dataclass
class ClusterRun:
    """A replay over a cluster: its router, and the LocalCluster when the replay started it."""

    router: str
    local: Any = None
    killed: list[str] = field(default_factory=list)
    peer_fetch: bool = False  # its members fetch from each other


@contextlib.contextmanager
def start_cluster(spec: StartedCluster, block_size: int, capacity_blocks: int,
                  policy: str = "lru") -> Iterator[Any]:
    """etcd + `spec.nodes` members of `capacity_blocks` each + a router, all on this machine
    (radixkv.cluster.local); yields the LocalCluster once the router has indexed them all."""
    from radixkv.cluster.local import local_cluster
    from radixkv.cluster.routed import RouterClient

    with tempfile.TemporaryDirectory(prefix="rkv-replay-") as directory:
        flags = service_flags(directory, block_size, capacity_blocks, policy)
        if spec.peer_fetch:  # fetch once a peer holds 64 tokens more (1 block of 512)
            flags = (*flags, "--peer-fetch", "--peer-fetch-min-blocks",
                     str(max(1, -(-PEER_FETCH_MIN_TOKENS // block_size))))
        with local_cluster(spec.nodes, *flags) as cluster:
            with RouterClient(cluster.router) as rc:
                rc.wait_members(spec.nodes)
            yield cluster


class ClusterStats:
    """The replay's view of a cluster: geometry from the router's member list, Stats summed
    over the members that answer (a killed one drops out of the sums)."""

    def __init__(self, router: str) -> None:
        from radixkv.cluster.routed import RouterClient

        self.router = RouterClient(router)
        self.num_members = 0

    def __enter__(self) -> ClusterStats:
        return self

    def __exit__(self, *exc: object) -> None:
        self.router.close()

    def wait_ready(self) -> None:
        self.num_members = len(self.router.wait_members(1)["members"])

    def geometry(self) -> tuple[int, int, int]:
        """(block size, blocks per member, bytes per block) of the first member."""
        from radixkv.client import Client

        m = self.router.members()["members"][0]
        with Client(m["address"]) as kv:
            info = kv.pool_info()
        return m["block_size"], m["num_blocks"], info.layout.bytes_per_block

    def stats(self, check_integrity: bool = False) -> dict[str, Any]:
        from radixkv.client import Client
        from radixkv.protocol.errors import RadixKVError

        total: dict[str, Any] = {"namespaces": [], "integrity": ""}
        by_ns: dict[str, dict[str, Any]] = {}
        checks = []
        for m in self.router.members()["members"]:
            try:
                with Client(m["address"], timeout=10) as kv:
                    st = kv.stats(check_integrity)
            except RadixKVError:
                continue
            for key, value in st.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
            for ns in st["namespaces"]:
                acc = by_ns.setdefault(ns["namespace"], {"namespace": ns["namespace"]})
                for key, value in ns.items():
                    if isinstance(value, int) and key != "namespace":
                        acc[key] = acc.get(key, 0) + value
            for peer in st.get("peers", []):
                for key in ("blocks_in", "bytes_in", "fetches", "failures",
                            "checksum_failures"):
                    total[f"peer_{key}"] = total.get(f"peer_{key}", 0) + int(peer.get(key, 0))
                total.setdefault("peer_recent_fetch_ms", []).extend(peer.get("recent_fetch_ms", []))
            checks.append(f"{m['node_id']} {st['integrity']}")
        total["namespaces"] = list(by_ns.values())
        if check_integrity:
            ok = all(c.endswith(" ok") for c in checks)
            total["integrity"] = "ok" if ok and checks else "; ".join(checks)
        for key in ("cached_blocks", "evicted_blocks"):
            total.setdefault(key, 0)
        return total


def peer_figures(before: dict[str, Any], after: dict[str, Any],
                 peer_fetch: bool) -> dict[str, Any]:
    """The report's peer fetch figures from the summed Stats around the run (empty without)."""
    if not peer_fetch:
        return {}
    recent = after.get("peer_recent_fetch_ms") or []
    return {"peer_fetched_blocks": after.get("peer_blocks_in", 0) - before.get("peer_blocks_in", 0),
            "peer_fetch_bytes": after.get("peer_bytes_in", 0) - before.get("peer_bytes_in", 0),
            "peer_fetch_p50_ms": float(np.median(recent)) if recent else None}
