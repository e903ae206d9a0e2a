"""The connector's own costs as JSON lines (`stats_file` in the extra config), written by both
the scheduler and the worker side."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
from typing import Any


def open_own(path: str) -> int:
    """An fd appending to `path`, a regular file of this user's own (created 0600), never
    opened through a symbolic link (OSError otherwise)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, "it is a symbolic link (not followed)") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise OSError(errno.EPERM, f"not a regular file of uid {os.geteuid()}'s own")
    return fd


class Stats:
    """Optional JSON lines of the connector's own costs (`stats_file` in the extra config); a
    file that cannot be written is one warning, then no more lines (never an error)."""

    def __init__(self, path: str | None, logger: logging.Logger | None = None) -> None:
        self.path = path
        self.log = logger or logging.getLogger("radixkv.integrations")
        self._fd: int | None = None
        self._lock = threading.Lock()

    def record(self, **fields: Any) -> None:
        if not self.path:
            return
        line = (json.dumps(fields) + "\n").encode()
        with self._lock:
            if not self.path:
                return
            try:
                if self._fd is None:
                    self._fd = open_own(self.path)
                os.write(self._fd, line)
            except OSError as e:
                self.log.warning("radixkv: cannot write the connector's stats_file %s (%s); "
                                 "no more stats are written", self.path, e.strerror or e)
                self.path = None
                self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        with self._lock:
            self._close()
