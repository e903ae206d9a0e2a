"""Releases a connector sends without waiting for their answers, from one background thread.

For leases whose Release answer changes nothing for the caller: a prefetch whose copy is known
to have run under the lease's pins, a lease no get will use. The caller only queues the ids
(microseconds); the thread sends what is queued as one Release per client, and if a batch is
refused (one of its leases already ended, which fails the whole call) each of its leases again
alone, so that a stale one never keeps the others' pins. A failure is only reported
(`on_error`): the lease then ends by its TTL. (A gRPC future per Release would cost the caller
the start of a channel thread, ~0.4 ms here, and is cancelled if dropped unanswered.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol


class Releases(Protocol):
    """What the thread calls: radixkv.client.Client's release."""

    def release(self, *lease_ids: int, hint: str | None = None) -> int: ...


class Releaser:
    def __init__(self, on_error: Callable[[BaseException, int], None],
                 name: str = "radixkv-release") -> None:
        """`on_error(error, leases)`: a Release of `leases` leases failed."""
        self.on_error = on_error
        self.name = name
        self.sent = 0  # Release calls made
        self._queue: list[tuple[Releases, list[int]]] = []
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def release(self, client: Releases, lease_ids: Sequence[int]) -> None:
        """Queue a Release of `lease_ids` through `client`."""
        if not lease_ids:
            return
        with self._cond:
            self._queue.append((client, list(lease_ids)))
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued Release was sent and answered; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch, self._queue, self._busy = self._queue, [], True
            try:
                for client, ids in _by_client(batch):
                    self._send(client, ids)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, client: Releases, ids: list[int]) -> None:
        try:
            self.sent += 1
            client.release(*ids)
            return
        except Exception as e:  # noqa: BLE001 - reported; the TTL ends these leases
            if len(ids) == 1:
                self.on_error(e, 1)
                return
        for lease_id in ids:  # one of them failed the batch: each alone
            try:
                self.sent += 1
                client.release(lease_id)
            except Exception as e:  # noqa: BLE001
                self.on_error(e, 1)


def _by_client(batch: list[tuple[Releases, list[int]]]) -> list[tuple[Releases, list[int]]]:
    out: dict[int, tuple[Releases, list[int]]] = {}
    for client, ids in batch:
        out.setdefault(id(client), (client, []))[1].extend(ids)
    return list(out.values())
