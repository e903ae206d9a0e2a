"""What a radixkv process does as a process: stop on SIGTERM/SIGINT, pin its threads to CPUs,
exit with its parent, and say so loudly when a TCP listener runs without a token."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any

from radixkv.protocol.errors import InvalidArgument

log = logging.getLogger("radixkv.server.app")


def insecure_warning(where: str) -> list[str]:
    """The lines logged when a TCP listener runs without a token (--insecure)."""
    bar = "!" * 72
    return [bar, f"INSECURE: {where} accepts every call without a token (--insecure): any local "
            "user, and anyone who reaches the port, can read cached token ids (DumpTree), "
            "pin and clear the cache", bar]


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM or SIGINT sets (logged): the main thread waits on it."""
    done = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %s: shutting down", signal.Signals(signum).name)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return done


def pin_cpus(spec: str) -> set[int]:
    """Run this process (every thread it starts from now on) on the CPUs of `spec` ("3",
    "2,3", "0-1"): Python runs one thread at a time, and a server whose threads hop between
    cores moves its hot data between their caches on every hand-off. Returns the set;
    InvalidArgument for a malformed list or a CPU this process may not use."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise InvalidArgument(f"--cpus {spec!r}: give CPU numbers and ranges, e.g. 3 or "
                              "2,3 or 0-1") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise InvalidArgument(f"--cpus {spec!r}: this process may use CPUs "
                              f"{','.join(map(str, sorted(allowed)))}")
    for tid in os.listdir("/proc/self/task"):  # this thread and any a library started
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)
    return cpus


def exit_with_parent() -> None:
    """Have the kernel SIGTERM this process when its parent exits (Linux PR_SET_PDEATHSIG), so
    a server launched by a tool that dies before its cleanup stops cleanly too."""
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        log.warning("--exit-with-parent needs Linux prctl; the server will outlive its parent")
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)
