"""The SGLang worker processes test_sglang*.py drive: _sglang_worker.py run by .venv-sglang's
python (scripts/bootstrap_sglang), one command per stdin line, one JSON answer
per line; and small helpers the tests share."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
PAGE = 4  # tokens per page: the tiny radixkv layout's block_size (tests/_server.py)


class Worker:
    """A tests/integrations/sglang/_sglang_worker.py process: send a command, read its answer."""

    def __init__(self, log: Path) -> None:
        if not SGLANG_PYTHON.exists():
            pytest.fail(f"{SGLANG_PYTHON} is missing: run `bash scripts/bootstrap_sglang` "
                        "(`bash scripts/bootstrap --tests` runs it)")
        self.log = log
        self.proc = subprocess.Popen(
            [str(SGLANG_PYTHON), str(Path(__file__).with_name("_sglang_worker.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"),  # noqa: SIM115
            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        self.lock = threading.Lock()

    def ready(self) -> None:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        assert line, f"worker did not start:\n{self.log.read_text()[-3000:]}"

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        with self.lock:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        assert line, f"worker died:\n{self.log.read_text()[-3000:]}"
        answer: dict[str, Any] = json.loads(line)
        assert "exception" not in answer, answer.get("trace")
        return answer

    def stop(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # SGLang's storage threads may hold it: no state
            self.proc.kill()
            self.proc.wait()


def start_workers() -> Iterator[dict[str, Worker]]:
    """Two workers, importing SGLang side by side (a test module's fixture)."""
    with tempfile.TemporaryDirectory(prefix="rkv-sgl-") as d:
        ws = {"A": Worker(Path(d) / "a.log"), "B": Worker(Path(d) / "b.log")}
        try:
            for w in ws.values():
                w.ready()
            yield ws
        finally:
            for w in ws.values():
                if w.proc.stdin:
                    w.proc.stdin.close()  # both start exiting at once
            for w in ws.values():
                w.stop()


def tokens(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PAGE))


def stored_write(worker: Worker, name: str, seq: list[int], seed: int) -> dict[str, Any]:
    """A write, again until it stores (the backend's link comes up within its retry_s, later
    on a loaded machine)."""
    import time

    deadline = time.monotonic() + 10
    while (wrote := worker("write", name=name, tokens=seq, seed=seed))["stored"] == 0:
        assert time.monotonic() < deadline, "the write stored nothing in 10 s"
        time.sleep(0.1)
    return wrote


def loaded_prefetch(worker: Worker, name: str, seq: list[int]) -> dict[str, Any]:
    """A prefetch, again until it loads something (a backup answers before radixkv has
    processed its Insert), for 10 s; the last answer."""
    import time

    deadline = time.monotonic() + 10
    while (got := worker("prefetch", name=name, tokens=seq))["loaded"] == 0:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return got


def no_errors(*ws: Worker) -> None:
    for w in ws:
        assert w("errors")["errors"] == []


def leases_back_to(socket: str, live: int) -> dict[str, Any]:
    """radixkv's stats (integrity checked) once it holds `live` leases: the backend sends some
    Releases without waiting for them, so the last may still be on its way."""
    from _server import wait_for

    from radixkv.client import Client

    def check() -> dict[str, Any] | None:
        with Client(socket) as kv:
            s = kv.stats(check_integrity=True)
        return s if s["live_leases"] == live else None

    out = wait_for(check, timeout=10, what=f"{live} live leases")
    assert isinstance(out, dict)
    return out
