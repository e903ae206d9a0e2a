"""One SGLang "worker" for test_sglang*.py beside it, run by .venv-sglang/bin/python: SGLang's
real HiCacheController(s) on CPU (_sglang_harness.py) with radixkv (or SGLang's file backend) as
the storage backend, driven by JSON commands, one per stdin line, one JSON answer per line.

    {"op": "open", "name": "a", "layout": "page_first", "socket": "...", "tp_rank": 0, ...}
    {"op": "write", "name": "a", "tokens": [...], "seed": 1}   -> pages stored, page digests
    {"op": "prefetch", "name": "a", "tokens": [...]}           -> hit / loaded tokens, digests
    {"op": "exists" | "get" | "set" | "clear", ...}            -> the backend called directly
    {"op": "slow_copy", "seconds": 1.5}  -> each copy out of radixkv's pool sleeps first (0: off;
                                            "to_pool": true: each copy into it)
    {"op": "slow_insert", "seconds": 1}  -> each Insert sleeps first (0: off)
    {"op": "errors"}                       -> errors SGLang's threads logged since the last ask

Every answer also reports whether an exception escaped (it must not)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _sglang_harness as h  # noqa: E402
import torch  # noqa: E402

PLAIN_COPY: list[Any] = []  # HostPages.copy, while slow_copy replaces it
PLAIN_INSERT: list[Any] = []  # Client.insert_keys, while slow_insert replaces it
ERRORS: list[str] = []  # records at ERROR from SGLang's and radixkv's loggers, thread crashes


class Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        ERRORS.append(f"{record.name}: {record.getMessage()}")


def hook(args: Any) -> None:
    ERRORS.append(f"thread {args.thread.name}: {args.exc_type.__name__}: {args.exc_value}")


def digests(cc: Any, slots: torch.Tensor | None) -> list[str]:
    if slots is None:
        return []
    return [hashlib.sha256(b).hexdigest()[:16] for b in h.page_bytes(cc, slots)]


class Worker:
    def __init__(self) -> None:
        self.cc: dict[str, Any] = {}

    def open(self, name: str, layout: str = "page_first", backend: str = "radixkv",
             socket: str | None = None, tp_rank: int = 0, tp_size: int = 1,
             geometry: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
             model: str = "tiny", prefix_keys: bool = True,
             env: dict[str, str] | None = None) -> dict[str, Any]:
        """A controller `name`; `env`: variables set while SGLang creates its backend (its
        failure injector reads SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE then)."""
        g = h.Geometry(**{k: getattr(torch, v) if k == "dtype" else v
                          for k, v in (geometry or {}).items()})
        h.set_rank(tp_rank, tp_size)
        config: dict[str, Any] = dict(extra or {})
        if backend == "radixkv":
            config.update(backend_name="radixkv", module_path="radixkv.integrations.sglang",
                          class_name="RadixKVStore", interface_v1=1, socket=socket,
                          hicache_storage_pass_prefix_keys=prefix_keys)
            backend = "dynamic"
        os.environ.update(env or {})
        try:
            self.cc[name] = h.controller(g, layout, backend, config, model)
        except Exception as e:  # noqa: BLE001 - the refusal is the answer
            return {"refused": f"{type(e).__name__}: {e}"}
        finally:
            for var in env or {}:
                del os.environ[var]
        store = self.cc[name].storage_backend
        return {"namespace": getattr(store, "namespace", None)}

    def write(self, name: str, tokens: list[int], seed: int = 0,
              prefix: bool = True, settle: bool = True) -> dict[str, Any]:
        """SGLang's backup of `tokens`' pages; with `settle`, once the backend's Inserts (sent
        after its answers) are answered too, so that another backend's lookup, which reads
        radixkv's table in microseconds, finds what this one wrote (a backup answers before
        radixkv has processed its Insert)."""
        cc = self.cc[name]
        slots = cc.mem_pool_host.alloc(len(tokens))
        h.fill(cc, slots, seed)
        stored = h.write(cc, slots, tokens, [] if prefix else None)
        releaser = getattr(cc.storage_backend, "releaser", None)
        if settle and releaser is not None:
            releaser.wait_inserts()
        out = {"stored": stored, "pages": digests(cc, slots)}
        cc.mem_pool_host.free(slots)
        return out

    def prefetch(self, name: str, tokens: list[int], rid: str = "r") -> dict[str, Any]:
        cc = self.cc[name]
        hit, loaded, slots = h.prefetch(cc, rid, tokens)
        out = {"hit": hit, "loaded": loaded,
               "pages": digests(cc, None if slots is None else slots[:loaded])}
        if slots is not None:
            cc.mem_pool_host.free(slots)
        return out

    def backend(self, name: str) -> Any:
        store = self.cc[name].storage_backend
        return getattr(store, "_backend", store)  # under SGLang's failure injector: the real one

    def exists(self, name: str, keys: list[str], prefix: list[str] | None = None) -> Any:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        info = HiCacheStorageExtraInfo(prefix_keys=prefix)
        return {"exists": self.backend(name).batch_exists(keys, info)}

    def get(self, name: str, keys: list[str], prefix: list[str] | None = None,
            slots: list[int] | None = None) -> Any:
        """batch_get_v1 into fresh host slots (or `slots` as given, maybe past the host pool,
        with every host page's digest before and after): which pages loaded, their digests."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        cc = self.cc[name]
        if slots is not None:
            every = torch.arange(cc.mem_pool_host.size)
            before = digests(cc, every)
            done = self.backend(name).batch_get_v1(keys, torch.tensor(slots),
                                                   HiCacheStorageExtraInfo(prefix_keys=prefix))
            return {"done": done, "host_before": before, "host_after": digests(cc, every)}
        slots = cc.mem_pool_host.alloc(len(keys) * cc.page_size)
        try:
            start = time.monotonic()
            done = self.backend(name).batch_get_v1(keys, slots,
                                                   HiCacheStorageExtraInfo(prefix_keys=prefix))
            seconds = time.monotonic() - start
            loaded = done.count(True)
            return {"done": done, "pages": digests(cc, slots[:loaded * cc.page_size]),
                    "seconds": seconds}
        finally:
            cc.mem_pool_host.free(slots)

    def set(self, name: str, keys: list[str], slots: list[int], seed: int = 0) -> Any:
        """batch_set_v1 of `keys` from host `slots` as given (maybe past the host pool; those
        inside it are filled first): what it answered, and the digests of the pages inside."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        cc = self.cc[name]
        at = torch.tensor(slots)
        inside = at[(at >= 0) & (at < cc.mem_pool_host.size)]
        h.fill(cc, inside, seed)
        done = self.backend(name).batch_set_v1(keys, at, HiCacheStorageExtraInfo(prefix_keys=[]))
        return {"done": done, "pages": digests(cc, inside)}

    def slow_copy(self, seconds: float, to_pool: bool = False) -> dict[str, Any]:
        """A copy out of radixkv's pool (into it: `to_pool`) that takes `seconds` longer (it
        sleeps, then copies: it reads what the blocks hold by then); 0 restores the plain copy."""
        from radixkv.integrations.layout import HostPages

        slow = to_pool

        def copy(pages: Any, kv: Any, slots: Any, view: Any, blocks: Any, to_pool: bool) -> None:
            if to_pool == slow:
                time.sleep(seconds)
            PLAIN_COPY[0](pages, kv, slots, view, blocks, to_pool)

        if not PLAIN_COPY:
            PLAIN_COPY.append(HostPages.copy)
        HostPages.copy = copy if seconds else PLAIN_COPY[0]  # type: ignore[method-assign]
        return {}

    def slow_insert(self, seconds: float) -> dict[str, Any]:
        """Each Insert (radixkv.client.Client.insert_keys) sleeps `seconds` first; 0: off."""
        from radixkv.client import Client

        def insert_keys(client: Any, *args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return PLAIN_INSERT[0](client, *args, **kwargs)

        if not PLAIN_INSERT:
            PLAIN_INSERT.append(Client.insert_keys)
        Client.insert_keys = insert_keys if seconds else PLAIN_INSERT[0]  # type: ignore
        return {}

    def clear(self, name: str) -> dict[str, Any]:
        self.backend(name).clear()
        return {}

    def keys(self, name: str, tokens: list[int]) -> dict[str, Any]:
        return {"keys": h.page_keys(tokens, self.cc[name].page_size)}

    def stats(self, name: str) -> dict[str, Any]:
        backend = self.backend(name)
        metrics = backend.get_stats()  # SGLang's StorageMetrics, per batch since last asked
        return {"stats": backend.counters(), "prefetch_pgs": metrics.prefetch_pgs,
                "backup_pgs": metrics.backup_pgs}

    def errors(self) -> dict[str, Any]:
        """The errors logged since the last ask."""
        out = list(ERRORS)
        ERRORS.clear()
        return {"errors": out}


def main() -> None:
    logging.getLogger().addHandler(Collect(level=logging.ERROR))
    threading.excepthook = hook
    worker = Worker()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            answer = getattr(worker, op)(**cmd)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            answer = {"exception": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
