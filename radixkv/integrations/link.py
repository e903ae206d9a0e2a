"""A connector's connection to radixkv that never takes the engine down.

Every call goes through `Link.call`: a radixkv that is absent, killed or restarting turns into
`Down` (the caller treats it as a cache miss), logged once per outage as a warning, and retried
no sooner than `retry_s` later so that a dead service costs no time per request. Each time the
service is (re)reached, and before the first answer of a new pool epoch is used
(`check_answer`), its pool layout is checked against the engine's (`check`): a mismatch at the
first contact raises LayoutMismatch (refuse to start); later it is logged and the link stays
down (the engine keeps serving without the cache).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvpool import PoolMapping
from radixkv.client import Client

log = logging.getLogger("radixkv.integrations")

T = TypeVar("T")


class Down(Exception):
    """radixkv cannot be used right now (absent, restarting, or refused): a cache miss."""


class LayoutMismatch(RuntimeError):
    """radixkv's pool layout does not fit the engine's KV (the message names both)."""


def check_pool_layout(client: Client, want: tuple[int, int, int, str, int], engine: str,
                      size_name: str, fix: str) -> None:
    """LayoutMismatch unless radixkv's pool is full attention, unquantized, and has `want`
    (layers, kv heads, head_dim, dtype, block size); the message names both layouts (`engine`:
    whose KV, `size_name`: what the engine calls its block size) and `fix` (how to start
    radixkv so that it fits)."""
    have = client.pool_info().layout
    got = (have.num_layers, have.num_kv_heads, have.head_dim, have.dtype, have.block_size)
    if got != want or have.is_quantized or have.is_windowed:
        layers, heads, dim, dtype, size = want
        raise LayoutMismatch(
            f"radixkv's pool layout ({have.num_layers} layers, {have.num_kv_heads} kv heads x "
            f"{have.head_dim}, {have.dtype}, block_size {have.block_size}"
            f"{', quantized' if have.is_quantized else ''}"
            f"{', sliding window' if have.is_windowed else ''}) does not fit {engine} "
            f"({layers} layers, {heads} kv heads x {dim}, {dtype}, {size_name} {size}): "
            f"start radixkv with {fix}")


class Link:
    """One lazily created Client (`client_id` shared by the engine's processes, so that a
    lease taken by one is ended by another), its outages, and the layout check."""

    def __init__(self, target: str | None, client_id: str, check: Callable[[Client], None],
                 timeout: float = 5.0, retry_s: float = 1.0, what: str = "engine",
                 logger: logging.Logger | None = None) -> None:
        self.target = target
        self.client_id = client_id
        self.timeout = timeout
        self.retry_s = retry_s
        self.what = what
        self._check = check
        self._client: Client | None = None
        self._retired: list[Client] = []  # clients dropped after a failure (closed at close())
        self._checked_epoch: str | None = None
        self._retry_at = 0.0
        self._down_since: float | None = None
        self._refused: str | None = None
        self._lock = threading.Lock()
        self.failures = 0
        self.log = logger or log

    def start(self) -> bool:
        """First contact: True if radixkv answers with a fitting layout; False (logged) if it is
        not reachable; LayoutMismatch if it answers with another layout."""
        try:
            self._ensure()
            return True
        except LayoutMismatch:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to reach it: run without it
            self._fail(e)
            return False

    def _ensure(self) -> Client:
        if self._client is None:
            self._client = Client(self.target, client_id=self.client_id, timeout=self.timeout)
        client = self._client
        if self._checked_epoch is None:
            client.check_epoch()
            self._check(client)
            self._checked_epoch = client.pool().epoch
        return client

    def call(self, fn: Callable[[Client], T]) -> T:
        """`fn(client)`, or Down if radixkv is unusable (the failure is logged once per
        outage; the next attempt comes after `retry_s`)."""
        with self._lock:
            if self._refused is not None:
                raise Down(self._refused)
            if self._down_since is not None and time.monotonic() < self._retry_at:
                raise Down("radixkv is down")
        try:
            client = self._ensure()
            result = fn(client)
        except LayoutMismatch as e:
            with self._lock:
                self._refused = str(e)
            self.log.error("radixkv: %s; the %s runs without radixkv", e, self.what)
            raise Down(str(e)) from None
        except Down:
            raise
        except Exception as e:  # noqa: BLE001 - never let radixkv take the engine down
            self._fail(e)
            raise Down(str(e)) from None
        with self._lock:
            if self._down_since is not None:
                self.log.warning("radixkv at %s is back after %.1f s",
                                 self.target or "default socket",
                                 time.monotonic() - self._down_since)
                self._down_since = None
        return result

    def check_answer(self, client: Client, epoch: str,
                     release: Callable[[], object] | None = None) -> None:
        """Inside `call`, before an answer of pool epoch `epoch` is used (loaded from, saved
        into): if that pool's layout was not checked yet, check it now. LayoutMismatch (the
        link then refuses) or Down (radixkv restarted again meanwhile), after `release()`."""
        if epoch == self._checked_epoch:
            return
        if self._checked_epoch is not None:
            self.log.warning("radixkv restarted (pool epoch %s -> %s): remapping its pool",
                             self._checked_epoch, epoch)
            self._checked_epoch = None
        try:
            self._check(client)
            client.check_epoch()
            if client.epoch != epoch:  # the layout checked may not be that epoch's
                raise Down(f"radixkv restarted again (pool epoch {epoch} -> {client.epoch})")
        except BaseException:
            if release is not None:
                with contextlib.suppress(Exception):
                    release()
            raise
        self._checked_epoch = epoch

    def checked_pool(self, client: Client, epoch: str) -> PoolMapping:
        """Inside `call`: the pool mapping of `epoch` (`Client.pool_of`: StalePool if that pool
        is gone), its layout checked if it is new to the link (as `check_answer`)."""
        mapping = client.pool_of(epoch)
        self.check_answer(client, epoch)
        return mapping

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            self.failures += 1
            self._retry_at = time.monotonic() + self.retry_s
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
            self._checked_epoch = None  # a restarted service may have another pool
            if self._client is not None:
                # the next attempt gets a fresh channel (this one may sit in gRPC's reconnect
                # backoff for seconds after radixkv is back); not closed now: another thread
                # may still read the old pool mapping, which stays mapped until close()
                if self._client.mapped:
                    self._retired.append(self._client)
                else:
                    self._client.close()
                self._client = None
        if first:
            self.log.warning("radixkv at %s is unavailable (%s: %s): serving without it (cache "
                        "misses) and retrying every %g s", self.target or "default socket",
                        type(e).__name__, e, self.retry_s)

    def close(self) -> None:
        for client in (*self._retired, self._client):
            if client is not None:
                client.close()
        self._client, self._retired = None, []

    @property
    def client(self) -> Any:
        return self._client
