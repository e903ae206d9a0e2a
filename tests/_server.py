"""Test helpers: run a real `radixkv serve` in a subprocess on a temporary Unix socket, and a tiny
model config so pool blocks are small (block_size 4, 1 KiB blocks)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from radixkv.server.launch import ServerProcess, start_server

REPO = Path(__file__).resolve().parents[1]

# 2 layers x 2 kv_heads x head_dim 8, fp32, block_size 4 -> 2*2*2*8*4 B * 4 tokens = 1 KiB/block
TINY_CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "hidden_size": 32, "torch_dtype": "float32"}
BLOCK_SIZE = 4
TOKEN = "s3cret-token-0123456789"  # the token the `token_file` fixture (conftest) writes

RunningServer = ServerProcess


def tiny_config_path(directory: str) -> str:
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump(TINY_CONFIG, f)
    return path


def tiny_flags(directory: str, num_blocks: int = 32) -> tuple[str, ...]:
    """`radixkv serve` flags for the tiny layout (its config written into `directory`), for
    servers that tests start through other launchers (local_cluster, start_server)."""
    return ("--model-config", tiny_config_path(directory), "--block-size", str(BLOCK_SIZE),
            "--num-blocks", str(num_blocks), "--log-level", "warning")


@contextlib.contextmanager
def running_server(*flags: str, num_blocks: int = 16, lease_ttl: float = 30.0,
                   block_size: int = BLOCK_SIZE,
                   socket_path: str | None = None) -> Iterator[RunningServer]:
    """Start `radixkv serve` with the tiny layout on a fresh socket (or `socket_path`); SIGTERM it
    at exit and check it exited 0 and removed its socket."""
    with tempfile.TemporaryDirectory(prefix="rkv-") as directory:
        sock = socket_path or os.path.join(directory, "s.sock")
        server = start_server(
            sock, "--model-config", tiny_config_path(directory), "--block-size", str(block_size),
            "--num-blocks", str(num_blocks), "--lease-ttl", str(lease_ttl), *flags)
        try:
            yield server
        finally:
            rc = server.stop()
            assert rc == 0, f"server exited {rc}:\n{server.output()}"
            assert not os.path.exists(sock), "server left its socket behind"


def wait_for(check: Callable[[], object], timeout: float = 15.0, what: str = "") -> object:
    """Poll `check` every 50 ms until it returns something true, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.05)


def store_many(kv: Any, namespace: str, prompts: list[list[int]]) -> None:
    """Cache `prompts` through `kv` (a Client): batches of one Match with store, then one
    Insert with release."""
    for i in range(0, len(prompts), 64):
        batch = prompts[i:i + 64]
        leases = kv.match_many([(namespace, p) for p in batch], store_tokens=1 << 30)
        kv.insert_many([(namespace, p, m.block_ids + m.new_block_ids, m.lease_id)
                        for p, m in zip(batch, leases, strict=True)], release=True)
