"""Helpers shared by the bench/ scripts (the radixkv package never imports this).

Scripts run as `python bench/<name>.py`, so bench/ is on sys.path and they `from _common import`.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    """Progress on stderr, so that stdout stays the bench's result."""
    print(message, file=sys.stderr, flush=True)


def engine_python(engine: str) -> str:
    """The python of an engine's own venv (.venv-vllm, .venv-sglang, .venv-lmcache), created by its
    scripts/bootstrap_<engine> first if it is missing."""
    python = REPO / f".venv-{engine}" / "bin" / "python"
    if not python.exists():
        log(f"bench: .venv-{engine} is missing: running scripts/bootstrap_{engine} (a few minutes)")
        subprocess.run(["bash", str(REPO / "scripts" / f"bootstrap_{engine}")], check=True)
    return str(python)


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation) of `values`; 0.0 when empty."""
    arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=float)
    return float(np.percentile(arr, q)) if arr.size else 0.0


def percentile_us(seconds: Iterable[float], q: float) -> float:
    """The q-th percentile of durations given in seconds, in microseconds."""
    return percentile(seconds, q) * 1e6


def latency_us(seconds: Iterable[float]) -> dict[str, float]:
    """{"mean", "p50", "p99"} in microseconds of durations given in seconds."""
    arr = np.asarray(list(seconds) if not isinstance(seconds, np.ndarray) else seconds, float)
    if not arr.size:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    p50, p99 = np.percentile(arr, [50, 99]) * 1e6
    return {"mean": float(arr.mean() * 1e6), "p50": float(p50), "p99": float(p99)}


def time_calls(fn: Callable[[], Any], repeat: int, warmup: int = 1) -> list[float]:
    """Durations in seconds of `repeat` calls of fn, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, Mapping):
        return "/".join(_fmt(v) for v in value.values())
    return str(value)


def summary_line(name: str, fields: Mapping[str, Any]) -> str:
    """`name: key=value key=value ...`; put units in the keys (match_us, mem_per_block_B).
    A nested mapping prints its values joined by '/' after keys joined the same way."""
    parts = []
    for key, value in fields.items():
        if isinstance(value, Mapping):
            key = f"{key}[{'/'.join(map(str, value))}]"
        parts.append(f"{key}={_fmt(value)}")
    return f"{name}: " + " ".join(parts)


def emit(name: str, fields: Mapping[str, Any], as_json: bool) -> None:
    """Print the result as one JSON object or one summary line."""
    if as_json:
        print(json.dumps({"bench": name, **fields}, indent=2))
    else:
        print(summary_line(name, fields))


@contextlib.contextmanager
def radixkv_server(directory: str, *flags: str) -> Iterator[str]:
    """`radixkv serve --socket DIRECTORY/s.sock *flags` in a subprocess (radixkv.server.launch);
    yields the socket path once it serves, SIGTERMs it at exit."""
    from radixkv.server.launch import server_process

    with server_process(*flags, socket=f"{directory}/s.sock") as server:
        yield server.socket
