"""A listening Unix socket that another local user cannot prepare and a crash does not block.

`claim_socket(path, what)` checks the directory (radixkv.protocol.env.check_socket_dir: this user's,
not writable by group or others), takes an exclusive flock on `PATH.lock` (opened with O_NOFOLLOW,
so a planted symlink is refused), and unlinks a socket left there: whoever held the lock before is
gone, so that socket is stale. The server and the router both bind this way; the caller binds with
umask 0177 (socket 0600) and calls `release_socket` at exit.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO, Any

from radixkv.protocol.env import check_socket_dir
from radixkv.protocol.errors import AlreadyExists, InvalidArgument, PermissionDenied

MAX_PATH = 107


def claim_socket(path: str, what: str) -> IO[Any]:
    """The held lock file of `path` (keep it open while serving). AlreadyExists if another
    live `what` holds it; PermissionDenied for an unsafe directory or lock file."""
    if len(path) > MAX_PATH:
        raise InvalidArgument(f"unix socket path is {len(path)} characters, limit "
                              f"{MAX_PATH}: {path}")
    Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_socket_dir(path)
    try:  # never through a symlink another user planted
        fd = os.open(path + ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as e:
        raise PermissionDenied(f"cannot open the lock file {path}.lock: {e}") from None
    lock = os.fdopen(fd, "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise AlreadyExists(f"another {what} holds {path} (lock {path}.lock)") from None
    if os.path.lexists(path):
        os.unlink(path)  # a stale socket: its owner is gone (we hold the lock)
    return lock


def release_socket(path: str, lock: IO[Any]) -> None:
    """Unlink the socket and its lock file, then let the lock go."""
    if os.path.lexists(path):
        os.unlink(path)
    try:
        os.unlink(path + ".lock")
    except FileNotFoundError:
        pass
    lock.close()
