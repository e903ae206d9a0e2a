"""`radixkv serve` in a subprocess: the one way tools (demo, replay, benchmarks) and tests start a
server. The child prints a banner line once it serves; until then its output is kept for the
error message, afterwards a thread drains it so the child never blocks on a full pipe.

    with server_process("--num-blocks", "64") as server:   # a fresh socket in a temp dir
        Client(server.socket) ...
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from radixkv.protocol.errors import AlreadyExists, Unavailable

BANNER = "radixkv serving on"
SOCKET_TAKEN = "another radixkv server holds"  # the server's refusal when the socket is in use


@dataclass
class ServerProcess:
    """A running `radixkv serve`: its process, socket, banner line and output so far."""

    proc: subprocess.Popen[str]
    socket: str
    banner: str
    lines: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        return stop_process(self.proc, sig, timeout)


def stop_process(proc: subprocess.Popen[str], sig: int = signal.SIGTERM,
                 timeout: float = 30.0) -> int:
    """Send `sig` (SIGTERM: a clean stop) and wait; SIGKILL after `timeout`. Returns the exit
    code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_for_banner(proc: subprocess.Popen[str], banner: str,
                    timeout: float) -> tuple[list[str], str | None]:
    """Read a child's output (stdout, stderr merged) until a line starting with `banner`; return
    the lines so far and that line. From then on a thread drains the rest into the same list,
    so the child never blocks on a full pipe. A child that exits first, or hangs for `timeout`
    seconds (it is killed), gives its lines and None, once it has exited."""
    out = proc.stdout
    assert out is not None
    lines: list[str] = []
    timer = threading.Timer(timeout, proc.kill)  # a child that hangs before its banner
    timer.start()
    try:
        for line in out:
            lines.append(line)
            if line.startswith(banner):
                break
    finally:
        timer.cancel()
    if not lines or not lines[-1].startswith(banner):
        proc.wait()
        return lines, None
    found = lines[-1]  # before the drain thread appends what the child prints next
    threading.Thread(target=lambda: lines.extend(out), daemon=True).start()
    return lines, found


def start_server(socket: str, *flags: str, timeout: float = 60.0,
                 die_with_parent: bool = True) -> ServerProcess:
    """Start `python -m radixkv serve --socket SOCKET --log-level warning FLAGS...` and return
    once it serves. Raises AlreadyExists if another server holds the socket, Unavailable if the
    child exits or prints no banner within `timeout` seconds (its output in the message)."""
    args = [sys.executable, "-m", "radixkv", "serve", "--socket", socket,
            "--log-level", "warning", *flags]
    if die_with_parent:  # armed by the child itself: a preexec_fn would run the parent's
        args.append("--exit-with-parent")  # at-fork hooks (grpc's abort in a forked child)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, banner = wait_for_banner(proc, BANNER, timeout)
    if banner is None:
        text = "".join(lines)
        if SOCKET_TAKEN in text:
            raise AlreadyExists(text.strip())
        raise Unavailable(f"radixkv serve exited {proc.returncode} before serving:\n{text}")
    return ServerProcess(proc, socket, banner, lines)


@contextlib.contextmanager
def server_process(*flags: str, socket: str | None = None,
                   timeout: float = 60.0) -> Iterator[ServerProcess]:
    """`start_server` on `socket`, or on a fresh socket in a temporary directory; SIGTERM at exit
    and remove the directory."""
    directory = tempfile.mkdtemp(prefix="rkv-")  # short: socket paths are limited to 107 chars
    try:
        server = start_server(socket or os.path.join(directory, "s.sock"), *flags,
                              timeout=timeout)
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)

