"""Opening the disk tier on `--disk-dir`: the directory is checked first, and every reason it
cannot hold the tier is an error naming it (the server exits 2 with it): missing, not a
directory, on a read-only filesystem, owned by another user or writable by group or others,
not writable, too little free space for the preallocated file, a slot or lock file that is a
symlink, another user's or writable by others (disk/claim.py), another server holding the
directory, or a file of another pool layout already there."""

from __future__ import annotations

import os
import stat

from kvpool.base import BlockPool
from kvpool.layout import format_bytes
from radixkv.disk.claim import DirectoryInUse, UnsafeFile
from radixkv.disk.slots import FILE_NAME, BadTierFile, SlotFile
from radixkv.disk.tier import DiskTier
from radixkv.protocol.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
)


def check_directory(directory: str, need_bytes: int) -> None:
    """The precise error for a directory that cannot hold a `need_bytes` tier file."""
    where = f"--disk-dir {directory}"
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        raise FailedPrecondition(f"{where} does not exist (create it first)") from None
    except OSError as e:
        raise PermissionDenied(f"{where}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"{where} is not a directory")
    vfs = os.statvfs(directory)
    if vfs.f_flag & os.ST_RDONLY:
        raise FailedPrecondition(f"{where} is on a read-only filesystem")
    if st.st_uid != os.geteuid():
        raise PermissionDenied(f"{where} is owned by uid {st.st_uid}, not this user "
                               f"(uid {os.geteuid()}): use a directory of your own")
    if st.st_mode & 0o022:  # another user could replace the slot file with their own KV
        raise PermissionDenied(f"{where} has mode {stat.S_IMODE(st.st_mode):o}: it must not "
                               "be writable by group or others (chmod go-w)")
    if not os.access(directory, os.W_OK | os.X_OK) or not st.st_mode & stat.S_IWUSR:
        raise PermissionDenied(f"{where} is not writable by this user")
    path = os.path.join(directory, FILE_NAME)
    have = os.lstat(path).st_size if os.path.lexists(path) else 0
    free = vfs.f_bavail * vfs.f_frsize
    if need_bytes - have > free:
        raise FailedPrecondition(
            f"{where}: the tier needs {format_bytes(need_bytes)} and its filesystem has "
            f"{format_bytes(free)} free (give a smaller --disk-capacity)")


def open_disk_tier(pool: BlockPool, directory: str, capacity_blocks: int,
                   promote_blocks: int) -> DiskTier:
    """The disk tier for `pool` on `directory`, its index rebuilt from what the file holds."""
    if pool.num_window_blocks:
        raise InvalidArgument("--disk-dir: the disk tier holds full-attention pools only "
                              "(this layout has a sliding window)")
    if pool.backend != "host":
        raise InvalidArgument(f"--disk-dir: the disk tier needs the host pool (this one is "
                              f"{pool.backend})")
    if capacity_blocks < 1:
        raise InvalidArgument(f"--disk-capacity holds no block ({capacity_blocks})")
    need = SlotFile.size_of(pool.layout, capacity_blocks)
    check_directory(directory, need)
    try:
        return DiskTier(pool, directory, capacity_blocks, promote_blocks)
    except DirectoryInUse as e:
        raise AlreadyExists(f"--disk-dir {directory} is in use: {e}") from None
    except UnsafeFile as e:
        raise PermissionDenied(f"--disk-dir {directory}: {e}") from None
    except BadTierFile as e:
        raise FailedPrecondition(f"--disk-dir {directory}: {e}") from None
    except OSError as e:
        raise FailedPrecondition(f"--disk-dir {directory}: {e.strerror or e}") from None


def blocks_in(pool: BlockPool, size_bytes: int) -> int:
    """How many slots `size_bytes` of disk hold for `pool`'s blocks."""
    return SlotFile.slots_in(pool.layout, size_bytes)
