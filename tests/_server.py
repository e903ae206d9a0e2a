"""Test helpers: run a real `radixkv serve` in a subprocess on a temporary Unix socket, and a tiny
model config so pool blocks are small (block_size 4, 1 KiB blocks)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# 2 layers x 2 kv_heads x head_dim 8, fp32, block_size 4 -> 2*2*2*8*4 B * 4 tokens = 1 KiB/block
TINY_CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "hidden_size": 32, "torch_dtype": "float32"}
BLOCK_SIZE = 4


@dataclass
class RunningServer:
    proc: subprocess.Popen[str]
    socket: str
    banner: str
    log: list[str]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc.poll() is None


def tiny_config_path(directory: str) -> str:
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump(TINY_CONFIG, f)
    return path


@contextlib.contextmanager
def running_server(*flags: str, num_blocks: int = 16, lease_ttl: float = 30.0,
                   block_size: int = BLOCK_SIZE,
                   socket_path: str | None = None) -> Iterator[RunningServer]:
    """Start `radixkv serve` on a fresh socket (or `socket_path`); SIGTERM it at exit and check
    it cleaned up."""
    directory = tempfile.mkdtemp(prefix="rkv-")  # short: socket paths are limited to 107 chars
    sock = socket_path or os.path.join(directory, "s.sock")
    args = [sys.executable, "-m", "radixkv", "serve", "--socket", sock,
            "--model-config", tiny_config_path(directory), "--block-size", str(block_size),
            "--num-blocks", str(num_blocks), "--lease-ttl", str(lease_ttl),
            "--log-level", "warning", *flags]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO)
    assert proc.stdout is not None
    lines: list[str] = []
    banner = ""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("radixkv serving on"):
            banner = line
            break
    if not banner:
        proc.kill()
        proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
        raise RuntimeError("server did not start:\n" + "".join(lines))
    # keep draining its output so it never blocks on a full pipe
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore
    server = RunningServer(proc, sock, banner, lines)
    try:
        yield server
    finally:
        rc = server.stop()
        leftover = os.path.exists(sock)
        shutil.rmtree(directory, ignore_errors=True)
        assert rc == 0, f"server exited {rc}:\n{''.join(lines)}"
        assert not leftover, "server left its socket behind"
