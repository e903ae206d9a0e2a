"""The gateway tests' helpers: stub engine servers (tests/gateway/_stub_engine.py) and
`radixkv gateway` in subprocesses, and HTTP calls whose error answers are answers too."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STUB = REPO / "tests" / "gateway" / "_stub_engine.py"


@dataclass
class Proc:
    proc: subprocess.Popen[str]
    url: str
    lines: list[str]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def output(self) -> str:
        rest = self.proc.stdout.read() if self.proc.stdout and self.proc.poll() is not None \
            else ""
        return "".join(self.lines) + (rest or "")


def start(cmd: list[str], banner: str, timeout: float = 60.0) -> Proc:
    """Start `cmd`; wait for the line starting with `banner` (its last word: a URL or port)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(banner):
            word = line[len(banner):].split()[0].rstrip(":,")
            url = word if word.startswith("http") else f"http://127.0.0.1:{word}"
            return Proc(proc, url, lines)
    proc.kill()
    raise AssertionError(f"{cmd[:4]} did not start:\n{''.join(lines)}")


@contextlib.contextmanager
def stub_engines(*names: str, max_model_len: int = 512) -> Iterator[dict[str, Proc]]:
    stubs: dict[str, Proc] = {}
    try:
        for name in names:
            stubs[name] = start([sys.executable, str(STUB), name,
                                 "--max-model-len", str(max_model_len)], f"stub {name} on")
        yield stubs
    finally:
        for s in stubs.values():
            s.stop()


@contextlib.contextmanager
def gateway(tokenizer: str, *flags: str) -> Iterator[Proc]:
    """`radixkv gateway` on a free port; at exit SIGTERM, and it must exit 0."""
    g = start([sys.executable, "-m", "radixkv", "gateway", "--tokenizer", tokenizer,
               "--port", "0", "--log-level", "warning", *flags], "radixkv gateway listening on")
    try:
        yield g
    finally:
        rc = g.stop()
        assert rc == 0, f"the gateway exited {rc}:\n{g.output()}"


def call(url: str, body: Any = None, token: str | None = None, raw: bytes | None = None,
         method: str | None = None) -> tuple[int, dict[str, str], Any]:
    """(status, headers, parsed JSON body or text) of one request; errors are answers too."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, h, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, h, text = e.code, dict(e.headers), e.read().decode()
    try:
        return status, {k.lower(): v for k, v in h.items()}, json.loads(text)
    except ValueError:
        return status, {k.lower(): v for k, v in h.items()}, text


def wait_ready(url: str, engines: int, timeout: float = 30.0) -> None:
    """Until the gateway's /health counts `engines` engines up."""
    deadline = time.monotonic() + timeout
    while True:
        status, _, body = call(url + "/health")
        if status == 200 and body.get("engines_up") == engines:
            return
        assert time.monotonic() < deadline, f"gateway health: {status} {body}"
        time.sleep(0.2)
