"""Who may hold the disk tier's files: this user only, and one server at a time.

`open_owned` opens a file of the tier without following a symlink and refuses one that is not a
regular file of this user or that group or others may write: such a file could hold another
user's KV, served as ours. `lock_directory` takes an exclusive flock on `radixkv-disk-tier.lock`
(held while the tier is open; the kernel lets it go when the process dies) and writes the
holder's pid there, so a second server on the same directory is refused, naming the first.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

LOCK_NAME = "radixkv-disk-tier.lock"


class UnsafeFile(Exception):
    """A tier file another user owns or could write, a symlink or not a regular file."""


class DirectoryInUse(Exception):
    """Another process holds the directory's lock."""


def open_owned(path: str, flags: int) -> int:
    """`path` opened with `flags` (created 0600), never through a symlink; UnsafeFile unless it
    is a regular file of this user not writable by group or others."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(f"{path} is a symbolic link: refusing to follow it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path} is not a regular file")
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise UnsafeFile(f"{path} is owned by uid {st.st_uid} with mode "
                             f"{stat.S_IMODE(st.st_mode):o}: it must be yours (uid "
                             f"{os.geteuid()}) and not writable by group or others")
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_directory(directory: str) -> int:
    """The held lock of `directory` (an fd: close it to let go); DirectoryInUse naming the
    holder's pid if another process holds it."""
    path = os.path.join(directory, LOCK_NAME)
    fd = open_owned(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DirectoryInUse(f"another radixkv server (pid {holder}) holds it (lock "
                             f"{path})") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
