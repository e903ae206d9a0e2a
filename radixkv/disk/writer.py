"""The disk tier's writer: slot writes queued (under the tier's condition) and written in
batches by one thread, off the service lock, through SlotFile (CRC, os.pwritev). A write never
touches a slot a promotion is reading (the tier's busy marks); a failed write is retried with
backoff, counted and reported (`error`, `last_error`), and the queue waits meanwhile."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from radixkv.disk.index import Entry
from radixkv.disk.slots import SlotFile
from radixkv.protocol.errors import Unavailable

log = logging.getLogger("radixkv.disk")

WRITE_BATCH = 64  # slots per writer pass
MAX_PENDING = 1024  # queued demotions before a demotion waits for the writer
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 2.0  # a failed write's backoff: doubled up to the cap
STOP_ATTEMPTS = 3  # a stopping tier's tries of a failing write before it gives up
SYNC_FAILING_S = 5.0  # how long sync waits on a failing writer before Unavailable


class SlotWriter:
    def __init__(self, file: SlotFile, cond: threading.Condition,
                 busy: dict[int, int]) -> None:
        self.file, self.cond = file, cond
        self.busy = busy  # slot -> promotions reading it now: writes to these wait
        self.queue: deque[tuple[int, Entry | None]] = deque()  # (slot, entry | tombstone)
        self.stopping = False
        self.writing = False  # the thread holds a batch it has not written yet
        self.error: BaseException | None = None  # the last write failed (it is retried)
        self.last_error = ""  # the last write or fsync error, kept after a recovery
        self.errors = 0  # writes and fsyncs that failed
        self.queued = self.done = 0  # writes queued, and written (or skipped), so far
        self._thread = threading.Thread(target=self._loop, name="disk-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Write what is queued (a failing disk: a few tries), then end the thread."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self._thread.join()

    def enqueue(self, slot: int, entry: Entry | None) -> None:
        with self.cond:
            self.room()
            self.append(slot, entry)

    def room(self) -> None:
        """Under _cond: wait while MAX_PENDING writes are queued (not while a promotion reads:
        the writer may be waiting for its slots, and the promotion's own evictions come here
        before its read)."""
        while len(self.queue) >= MAX_PENDING and not self.busy and self.error is None:
            self.cond.wait(1.0)

    def append(self, slot: int, entry: Entry | None) -> None:
        self.queue.append((slot, entry))
        self.queued += 1
        self.cond.notify_all()

    def sync(self) -> None:
        """Off the service lock: wait until every write queued so far (a Clear's tombstones)
        is done and fsynced. Unavailable if the writer keeps failing or the fsync fails."""
        with self.cond:
            mark, give_up = self.queued, None
            while self.done < mark:
                if self.error is None:
                    give_up = None
                elif give_up is None:
                    give_up = time.monotonic() + SYNC_FAILING_S
                elif time.monotonic() >= give_up:
                    raise Unavailable(self._not_durable(self.error))
                self.cond.wait(0.05)
        try:
            self.file.sync()
        except OSError as e:
            self.note_error(e, failing=False)  # (nothing to retry: the next write says)
            raise Unavailable(self._not_durable(e)) from None

    @staticmethod
    def _not_durable(e: BaseException) -> str:
        return (f"cleared in memory and in the disk index, but the disk tier cannot write "
                f"({e}): a crash before its writes succeed may bring those blocks back")

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stopping:
                    self.cond.wait()
                if not self.queue:
                    return
                batch = [self.queue.popleft() for _ in range(min(WRITE_BATCH, len(self.queue)))]
                self.writing = True
                self.cond.notify_all()
            if not self._write_batch(batch):
                return
            for _, entry in batch:
                if entry is not None:
                    entry.staging = None
            with self.cond:
                self.writing = False
                self.done += len(batch)
                self.cond.notify_all()

    def _write_batch(self, batch: list[tuple[int, Entry | None]]) -> bool:
        """Write one batch, retrying with backoff while it fails; False: the tier is stopping
        with the disk still failing (what is queued is lost, logged)."""
        backoff, failures = RETRY_FIRST_S, 0
        while True:
            with self.cond:
                slots = {slot for slot, _ in batch}
                while any(slot in self.busy for slot in slots):  # a promotion reads one
                    self.cond.wait()
            jobs: list[tuple[int, bytes, bytes | memoryview] | int] = []
            for slot, entry in batch:
                payload = None if entry is None else entry.staging
                if entry is None:
                    jobs.append(slot)
                elif payload is not None:  # (None: cleared, or dropped, since it was queued)
                    jobs.append((slot, self.file.encode_meta(entry.meta, payload), payload))
            try:
                self.file.write(jobs)
            except Exception as e:  # noqa: BLE001 - a failing disk: retried, reported
                self.note_error(e)
                failures += 1
                with self.cond:
                    if self.stopping and failures >= STOP_ATTEMPTS:
                        log.error("disk tier stopping with writes failing: %d queued writes "
                                  "lost (%s)", len(batch) + len(self.queue), e)
                        self.queue.clear()
                        self.writing = False
                        self.cond.notify_all()
                        return False
                    self.cond.wait(backoff)  # (a stop wakes it)
                backoff = min(2 * backoff, RETRY_MAX_S)
                continue
            if self.error is not None:
                log.warning("disk tier writes succeed again after %d errors",
                            self.errors)
                with self.cond:
                    self.error = None
                    self.cond.notify_all()
            return True

    def note_error(self, e: BaseException, failing: bool = True) -> None:
        """A failed write (`failing`: until a retry succeeds) or fsync, counted and logged."""
        with self.cond:
            if self.error is None:
                log.error("disk tier write failed (retried with backoff; demotions dropped "
                          "meanwhile): %s", e)
            if failing:
                self.error = e
            self.last_error = str(e)
            self.errors += 1
            self.cond.notify_all()
