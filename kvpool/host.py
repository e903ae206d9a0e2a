"""The `host` backend: the slab is a POSIX shared-memory file in /dev/shm (Linux), mapped with
mmap by the owner and by every attaching process, zero-copy.

Why plain os.open + mmap rather than multiprocessing.shared_memory: on Python <= 3.12 the
resource tracker unlinks segments it registered when any process that attached exits
(cpython#82300), and it races the owner's own cleanup. Here nothing is registered anywhere;
the owner alone unlinks:
- on `close()`, on garbage collection and at interpreter exit (a weakref finalizer);
- on SIGTERM/SIGINT once `install_signal_cleanup()` was called (opt-in, chains prior handlers);
- after SIGKILL it cannot: the next pool started with the same prefix reclaims the segment.
  Names are `<prefix>-<owner pid>-<epoch hex>`; the owner holds an flock on the file for its
  whole life, so a segment is reclaimed only when its pid is dead *and* nobody holds the lock
  (which also protects owners in another pid namespace sharing /dev/shm).

Memory is reserved at creation (posix_fallocate): a /dev/shm too small for the slab fails then,
with the numbers, instead of SIGBUS on the first touch of an unbacked page.

Views hold a buffer export on the mmap, so `close()` while views exist cannot leave them
dangling: the name is unlinked at once and the pages are unmapped when the last view goes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import signal
from collections.abc import Callable, Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.base import BlockPool, PoolMapping
from kvpool.errors import (
    InvalidArgument,
    OutOfBlocks,
    PermissionDenied,
    StalePool,
    Unavailable,
)
from kvpool.handle import PoolHandle, pid_alive
from kvpool.layout import KVLayout
from kvpool.prefault import Prefault
from kvpool.segment import SEGMENT_NAME_RE, SHM_DIR, own, unlink_owned_segments
from kvpool.slab import Slab
from kvpool.units import format_bytes

if TYPE_CHECKING:  # torch is imported lazily, on the first torch view
    import torch

log = logging.getLogger("kvpool.host")

PAGE = mmap.PAGESIZE
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*")


def _round_up(n: int, granule: int) -> int:
    return -(-n // granule) * granule


_installed: set[int] = set()


def install_signal_cleanup(
    signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT),
) -> None:
    """Unlink this process's segments on the given signals, then defer to whatever handler was
    there before: a Python handler is called (SIGINT's default raises KeyboardInterrupt as
    usual), SIG_IGN keeps ignoring, SIG_DFL (or a handler set outside Python) restores the
    default and re-sends the signal, so the process still dies of it. Idempotent; call it from
    the main thread, after the program's own handlers are installed (a handler installed later
    replaces ours: chain to `unlink_owned_segments()` from it)."""
    for sig in signals:
        sig = signal.Signals(sig)
        if sig in _installed:
            continue
        previous = signal.getsignal(sig)

        def handler(
            signum: int,
            frame: FrameType | None,
            previous: Callable[[int, FrameType | None], Any] | int | None = previous,
        ) -> None:
            unlinked = unlink_owned_segments()
            if unlinked:
                log.info("signal %d: unlinked %s", signum, ", ".join(unlinked))
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_IGN:
                return
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        try:
            signal.signal(sig, handler)
        except ValueError as e:  # not the main thread
            raise InvalidArgument(f"install_signal_cleanup must run in the main thread: {e}") from e
        _installed.add(sig)


def reclaim_stale_segments(prefix: str = "radixkv", shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink `<prefix>-<pid>-<hex>` segments whose owner is dead (pid gone and the owner's
    flock free) and return their names. Run at every pool start; safe to run any time."""
    pattern = re.compile(re.escape(prefix) + r"-(\d+)-[0-9a-f]{32}")
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    reclaimed = []
    for name in names:
        m = pattern.fullmatch(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or pid_alive(pid):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live owner we cannot see (other pid namespace)
            os.close(fd)
            continue
        try:
            size = os.fstat(fd).st_size
            os.unlink(path)
        except FileNotFoundError:
            continue
        finally:
            os.close(fd)
        log.warning(
            "reclaimed stale shared-memory segment %s (%s) of dead pid %d",
            name, format_bytes(size), pid,
        )
        reclaimed.append(name)
    return reclaimed


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


class _Mapping:
    """One mmap of a segment and the arrays over it. The numpy array holds a buffer export on
    the mmap, and torch tensors from it hold the array, so the pages stay mapped while any view
    lives; `release()` drops our references and unmaps now if no view is left."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.mm: mmap.mmap | None = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        self.array: np.ndarray[Any, np.dtype[np.uint8]] | None = np.frombuffer(
            self.mm, dtype=np.uint8
        )
        self.tensor: torch.Tensor | None = None

    def torch_bytes(self) -> torch.Tensor:
        import torch

        assert self.array is not None
        if self.tensor is None:
            self.tensor = torch.from_numpy(self.array)
        return self.tensor

    def release(self) -> bool:
        """Drop our references; True if the pages were unmapped now (no view outstanding)."""
        mm, self.mm, self.array, self.tensor = self.mm, None, None, None
        if mm is None:
            return True
        try:
            mm.close()
        except BufferError:  # views alive: the mmap closes when the last one is collected
            return False
        return True


class _MappedBytes(Slab):
    """The byte views of a host slab, for the owner and for attaching processes alike."""

    _map: _Mapping

    def _torch_bytes(self) -> torch.Tensor:
        self._check_open()
        return self._map.torch_bytes()

    def _numpy_bytes(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        self._check_open()
        assert self._map.array is not None
        return self._map.array


class HostBlockPool(_MappedBytes, BlockPool):
    """A pool in /dev/shm/<prefix>-<pid>-<epoch>, owned by this process.

    `reserve` (default True) commits the memory at creation so that a too-small /dev/shm fails
    here and not with SIGBUS later; `mode` is the segment's permission bits (attaching engines
    must be able to open it read-write: the same user by default)."""

    backend = "host"

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        name_prefix: str = "radixkv",
        *,
        reserve: bool = True,
        mode: int = 0o600,
        shm_dir: str = SHM_DIR,
        num_sink_blocks: int = 0,
        num_window_blocks: int = 0,
    ) -> None:
        super().__init__(layout, num_blocks, num_sink_blocks, num_window_blocks)
        if not isinstance(name_prefix, str) or not _PREFIX_RE.fullmatch(name_prefix):
            raise InvalidArgument(
                f"name_prefix {name_prefix!r} must be letters, digits, '_', '.', "
                "and single '-' between them"
            )
        if not os.path.isdir(shm_dir):
            raise Unavailable(f"{shm_dir} does not exist: the host pool needs POSIX shared memory")
        reclaim_stale_segments(name_prefix, shm_dir)
        self.nbytes = _round_up(self.slab_bytes, PAGE)
        free = shm_free_bytes(shm_dir)
        if free < self.nbytes:
            raise OutOfBlocks(self._too_small(free, shm_dir))
        self.owner_pid = os.getpid()
        self.name = f"{name_prefix}-{self.owner_pid}-{self.epoch}"
        self.path = os.path.join(shm_dir, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            # The lock marks the segment as owned for as long as this process lives
            # (released by the kernel on any death, SIGKILL included).
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, self.nbytes)
            if reserve:
                try:
                    os.posix_fallocate(fd, 0, self.nbytes)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        free = shm_free_bytes(shm_dir)
                        raise OutOfBlocks(self._too_small(free, shm_dir)) from None
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
            self._map = _Mapping(fd, self.nbytes)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            raise
        self._fd = fd  # kept open: holds the flock
        # the service's own copies into blocks (disk promotions, peer fetches) then do not pay a
        # page fault per 4 KiB either; the memory is reserved already, only the entries are new
        assert self._map.mm is not None
        self.prefault = Prefault(self._map.mm, self.name) if reserve else None
        self._finalizer = own(self, self.path, fd)

    def _too_small(self, free: int, shm_dir: str) -> str:
        return (
            f"{shm_dir} has {format_bytes(free)} free, the pool needs "
            f"{format_bytes(self.nbytes)} ({self.describe()}); enlarge {shm_dir} (e.g. docker "
            "--shm-size) or ask for fewer blocks"
        )

    def export(self) -> PoolHandle:
        self._check_open()
        return PoolHandle(
            backend="host",
            name=self.name,
            nbytes=self.nbytes,
            num_blocks=self.num_blocks,
            layout=self.layout,
            epoch=self.epoch,
            owner_pid=self.owner_pid,
            num_sink_blocks=self.num_sink_blocks,
            num_window_blocks=self.num_window_blocks,
        )

    def close(self) -> None:
        """Unlink the segment (no new attach succeeds) and drop the pool's mapping. Idempotent.
        Views still alive here, and other processes' mappings, stay valid until dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.prefault is not None:
            self.prefault.stop()
        self._drop_views()
        self._finalizer()  # unlink + close the fd (releases the flock)
        if not self._map.release():
            log.debug("pool %s closed with views alive; unmapped when they go", self.name)


class HostPoolMapping(_MappedBytes, PoolMapping):
    """An attaching process's mapping of a host pool. Never unlinks anything. With `prefault`
    (the default) its pages are mapped in ahead of use, in the background (kvpool/prefault.py:
    a first copy then does not pay a page fault per 4 KiB)."""

    def __init__(self, handle: PoolHandle, shm_dir: str = SHM_DIR, prefault: bool = True
                 ) -> None:
        super().__init__(handle)
        if not SEGMENT_NAME_RE.fullmatch(handle.name):
            raise InvalidArgument(f"segment name {handle.name!r} is not a plain file name")
        path = os.path.join(shm_dir, handle.name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise StalePool(
                f"shared-memory segment {handle.name!r} (pool epoch {handle.epoch}) is gone: "
                f"its owner (pid {handle.owner_pid}) closed the pool or exited; fetch the pool "
                "handle again"
            ) from None
        except PermissionError:
            raise PermissionDenied(
                f"cannot open shared-memory segment {path!r} read-write: it belongs to another "
                "user (the owner creates it with mode 0600 unless told otherwise)"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < handle.nbytes:
                raise StalePool(
                    f"shared-memory segment {handle.name!r} is {size} bytes, the handle says "
                    f"{handle.nbytes}: it is not the pool of epoch {handle.epoch}"
                )
            self._map = _Mapping(fd, handle.nbytes)
        finally:
            os.close(fd)  # the mapping stays valid without the descriptor
        assert self._map.mm is not None
        self.prefault = Prefault(self._map.mm, handle.name) if prefault else None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.prefault is not None:
            self.prefault.stop()
        self._drop_views()
        self._map.release()


def attach_host(handle: PoolHandle) -> HostPoolMapping:
    return HostPoolMapping(handle)
