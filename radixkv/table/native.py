"""The compiled read of the lookup table (peek_kernel.c through ctypes): a prompt's hashes and
its leading run in one call, where the numpy path takes a dozen array operations. Built once per
machine into the kernel cache (kvpool/jit.py); RADIXKV_NO_KERNEL=1, or no C compiler, leaves the
numpy path (reader.py), which gives the same answers."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

from kvpool.jit import CLibrary

log = logging.getLogger("radixkv.table")

_P = ctypes.c_void_p
_I = ctypes.c_int64
KERNEL = CLibrary("radixkv_peek", Path(__file__).with_name("peek_kernel.c"), ["-O2"], [],
                  ["rkv_peek"], "peek", "lookup-table read kernel", "the numpy read", "1 s",
                  log)


def peek_function() -> Any | None:
    """rkv_peek with its argument types set, or None where the kernel is not built."""
    lib = KERNEL.ops()
    if lib is None:
        return None
    fn = lib.rkv_peek
    if fn.restype is not _I:
        fn.argtypes = [_P, _I, _I, _P, ctypes.c_uint64, _P, ctypes.c_uint64, _I, _P, _P, _P]
        fn.restype = _I
    return fn
