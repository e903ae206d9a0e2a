"""The calls that end a lease, sent without waiting for their answers, from one background thread.

Two kinds, in the order they were queued (FIFO):
- Releases whose answer changes nothing for the caller: a prefetch whose copy is known to have
  run under the lease's pins, a lease no get will use. The thread sends the Releases queued
  next to each other as one Release per client, and if a batch is refused (one of its leases
  already ended, which fails the whole call) each of its leases again alone, so that a stale one
  never keeps the others' pins. A failure is only reported (`on_error`): the lease then ends by
  its TTL.
- Inserts (with release=True) of pages whose copy into the pool already ended: the caller has
  answered before radixkv made them matchable (`insert`, with the call to make and what to do
  with its failure). `wait_inserts` waits for those queued so far, for a caller that reads what
  it wrote (cheap when none is queued).

The caller only queues (microseconds). (A gRPC future per call would cost the caller the start
of a channel thread, ~0.4 ms here, and is cancelled if dropped unanswered.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class Releases(Protocol):
    """What the thread calls: radixkv.client.Client's release."""

    def release(self, *lease_ids: int, hint: str | None = None) -> int: ...


@dataclass(frozen=True)
class _Insert:
    send: Callable[[], object]
    on_error: Callable[[BaseException], None]


_Item = tuple[Releases, list[int]] | _Insert


class Releaser:
    def __init__(self, on_error: Callable[[BaseException, int], None],
                 name: str = "radixkv-release") -> None:
        """`on_error(error, leases)`: a Release of `leases` leases failed."""
        self.on_error = on_error
        self.name = name
        self.sent = 0  # Release calls made
        self.inserts = 0  # Inserts made
        self._queue: list[_Item] = []
        self._pending_inserts = 0  # queued or being sent
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def release(self, client: Releases, lease_ids: Sequence[int]) -> None:
        """Queue a Release of `lease_ids` through `client`."""
        if lease_ids:
            self._put((client, list(lease_ids)))

    def insert(self, send: Callable[[], object],
               on_error: Callable[[BaseException], None]) -> None:
        """Queue `send()` (an Insert that ends its lease); `on_error(error)` if it raises."""
        with self._cond:
            self._pending_inserts += 1
        self._put(_Insert(send, on_error))

    @property
    def inserting(self) -> bool:
        """Whether an Insert is queued or being sent."""
        return self._pending_inserts > 0

    def wait_inserts(self, timeout: float = 10.0) -> bool:
        """Wait until every Insert queued so far was sent and answered; False on timeout."""
        if not self._pending_inserts:  # the common case: no lock taken
            return True
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending_inserts, timeout)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued call was sent and answered; False on timeout."""
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

    def _put(self, item: _Item) -> None:
        with self._cond:
            self._queue.append(item)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch, self._queue, self._busy = self._queue, [], True
            try:
                releases: list[tuple[Releases, list[int]]] = []
                for item in batch:
                    if isinstance(item, _Insert):
                        self._send_releases(releases)
                        releases = []
                        self._send_insert(item)
                    else:
                        releases.append(item)
                self._send_releases(releases)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _send_insert(self, item: _Insert) -> None:
        try:
            self.inserts += 1
            item.send()
        except Exception as e:  # noqa: BLE001 - reported; nothing was inserted
            item.on_error(e)
        finally:
            with self._cond:
                self._pending_inserts -= 1
                self._cond.notify_all()

    def _send_releases(self, releases: list[tuple[Releases, list[int]]]) -> None:
        for client, ids in _by_client(releases):
            self._send(client, ids)

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
