"""Directories and files only this user controls: the kernel build cache (kvpool/quant_kernel.py)
and the model cache (radixkv/engines/models.py) load code and weights from them, so another
local user who could write there could run code in an engine's process.

The rule is the Unix socket's (radixkv/protocol/env.py `check_socket_dir`): a real directory or file
(not a symlink), owned by this user, not writable by group or others. Directories are created
0700; lock files are opened with O_NOFOLLOW (never through a symlink another user planted) and
never truncated.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvpool.errors import PermissionDenied


def check_private(path: Path, what: str) -> None:
    """PermissionDenied unless `path` is a real directory or file (not a symlink) of this user
    that group and others cannot write. `what` names it in the message."""
    st = os.lstat(path)
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        raise PermissionDenied(f"{what} {path} is a symlink: refusing to follow it")
    if st.st_uid != uid or st.st_mode & 0o022:
        raise PermissionDenied(
            f"{what} {path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}:"
            f" it must be yours (uid {uid}) and not writable by group or others; remove it, "
            "or fix its owner and mode (chmod go-w)")


def private_dir(path: Path, what: str) -> Path:
    """`path`, created 0700 (its missing parents as the umask makes them) unless it exists,
    then checked (check_private)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_private(path, what)
    return path


def open_lock(path: Path) -> int:
    """A file descriptor of lock file `path` (created 0600, never truncated, never through a
    symlink) for flock; PermissionDenied if it is a symlink or not this user's file. The
    caller closes it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if path.is_symlink():
            raise PermissionDenied(f"lock file {path} is a symlink: refusing to follow it") \
                from None
        raise PermissionDenied(f"cannot open the lock file {path}: {e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise PermissionDenied(f"lock file {path} is not a file of yours (uid {st.st_uid})")
    return fd
