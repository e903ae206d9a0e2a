"""Map a shared pool's pages into an attaching process ahead of its first copies.

A process that maps a host pool gets its page-table entries one page fault at a time, at its
first touch of each 4 KiB page: about 3.6 us each here, so a first copy out of (or into) blocks
this process never touched runs several times slower than the same copy again (measured in
docs/operations.md). `start` asks the kernel to fill the mapping's entries in the background
(madvise MADV_POPULATE_WRITE, Linux 5.14+: no memory is allocated, the owner reserved it with
posix_fallocate), in chunks, from a daemon thread that holds no GIL during the calls (ctypes).
On an older kernel, or any refusal, it stops quietly: pages then fault in on first use as before.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading

log = logging.getLogger("kvpool.prefault")

MADV_POPULATE_WRITE = 23  # linux/mman.h
CHUNK = 64 << 20  # bytes per call: a closed mapping stops the thread within one chunk

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int


class Prefault:
    """The background fill of one mapping; `done` is set when it ends (filled or stopped)."""

    def __init__(self, mm: mmap.mmap, name: str) -> None:
        window = (ctypes.c_char * len(mm)).from_buffer(mm)  # the address only: the export
        self._address, self._length = ctypes.addressof(window), len(mm)  # ends with `window`
        del window
        self.filled = 0  # bytes whose entries are in place
        self.done = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"prefault-{name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No further chunk (the mapping is about to go); the one in flight may finish."""
        self._stopped = True

    def _run(self) -> None:
        try:
            while self.filled < self._length and not self._stopped:
                size = min(CHUNK, self._length - self.filled)
                if _madvise(self._address + self.filled, size, MADV_POPULATE_WRITE) != 0:
                    log.debug("prefault stopped at %d of %d bytes: errno %d", self.filled,
                              self._length, ctypes.get_errno())
                    return
                self.filled += size
        finally:
            self.done.set()
