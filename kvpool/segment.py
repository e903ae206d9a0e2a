"""Shared-memory segments this process owns: registered so that they are unlinked at close, at
exit and on signals (kvpool.host.install_signal_cleanup); `OwnedSegment`, a small one beside a
pool (the service's lookup table), created and flock-held like the host pool's slab (the same
`<prefix>-<pid>-<hex>` names, so `reclaim_stale_segments` reclaims one a killed owner left);
and `map_readonly`, how other processes map one."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import threading
import uuid
import weakref
from typing import Any

from kvpool.errors import InvalidArgument, PermissionDenied, StalePool

SHM_DIR = "/dev/shm"
SEGMENT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")

# Segments this process owns and has not unlinked yet: path -> owner pid (the pid guards
# forked children, which inherit this dict but must not unlink their parent's segments).
_LIVE: dict[str, int] = {}
_LIVE_LOCK = threading.RLock()  # re-entrant: the signal handler runs on the main thread


def _unlink(path: str, owner_pid: int) -> None:
    """Unlink an owned segment once; a no-op in any process but the owner."""
    with _LIVE_LOCK:
        _LIVE.pop(path, None)
    if os.getpid() != owner_pid:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def unlink_owned_segments() -> list[str]:
    """Unlink every segment this process owns (the pools stay mapped and usable here, but no
    new process can attach). What the signal handlers run; returns the paths unlinked."""
    pid = os.getpid()
    with _LIVE_LOCK:
        owned = [p for p, owner in _LIVE.items() if owner == pid]
    for path in owned:
        _unlink(path, pid)
    return owned


def _finalize_owner(path: str, owner_pid: int, fd: int) -> None:
    _unlink(path, owner_pid)
    with contextlib.suppress(OSError):
        os.close(fd)


def own(obj: Any, path: str, fd: int) -> weakref.finalize:  # type: ignore[type-arg]
    """Make this process the owner of segment `path` (open as `fd`, flock held): unlinked, and
    `fd` closed, by the returned finalizer (call it to close), when `obj` is collected, at exit,
    or by the signal cleanup (kvpool.host.install_signal_cleanup)."""
    pid = os.getpid()
    with _LIVE_LOCK:
        _LIVE[path] = pid
    return weakref.finalize(obj, _finalize_owner, path, pid, fd)


class OwnedSegment:
    """`<prefix>-<pid>-<uuid hex>` in `shm_dir`, `nbytes` long, zero-filled, mapped read-write
    here; unlinked by `close()`, at exit, or by the signal cleanup."""

    def __init__(self, nbytes: int, prefix: str = "radixkv", mode: int = 0o600,
                 shm_dir: str = SHM_DIR) -> None:
        self.owner_pid = os.getpid()
        self.name = f"{prefix}-{self.owner_pid}-{uuid.uuid4().hex}"
        self.path = os.path.join(shm_dir, self.name)
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # owned while this process lives
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            raise
        self._finalizer = own(self, self.path, fd)

    def close(self) -> None:
        """Unlink (no new reader attaches); readers' mappings stay valid until they drop them."""
        self._finalizer()


def map_readonly(name: str, nbytes: int, shm_dir: str = SHM_DIR) -> tuple[mmap.mmap, int]:
    """A read-only mapping of segment `name` (StalePool if it is gone or shorter than
    `nbytes`) and a descriptor of it, kept open for `owner_alive` (the caller closes it)."""
    if not SEGMENT_NAME_RE.fullmatch(name):
        raise InvalidArgument(f"segment name {name!r} is not a plain file name")
    path = os.path.join(shm_dir, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise StalePool(f"shared-memory segment {name!r} is gone: its owner closed it or "
                        "exited; ask the service again") from None
    except PermissionError:
        raise PermissionDenied(f"cannot open shared-memory segment {path!r}: it belongs to "
                               "another user") from None
    try:
        if os.fstat(fd).st_size < nbytes:
            raise StalePool(f"shared-memory segment {name!r} is shorter than {nbytes} bytes")
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ), fd
    except BaseException:
        os.close(fd)
        raise


def owner_alive(fd: int) -> bool:
    """Whether the owner of the segment open as `fd` still holds its lock (it does for its
    whole life; the kernel drops it the moment the owner dies, SIGKILL included): one
    non-blocking flock, about a microsecond."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
