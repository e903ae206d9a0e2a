"""CPU kernels built on first use (torch C++ extensions, or plain C libraries loaded with ctypes:
`CLibrary`), then loaded: the one build-and-load path of kvpool/quant_kernel.py,
radixkv/integrations/pages_kernel.py and radixkv/table/native.py.

A kernel is compiled for this CPU into $RADIXKV_CACHE_DIR (default ~/.cache/radixkv)/kernels/
<prefix>-<key>/, the key hashing the source, the flags, torch, Python and the CPU's features; a
file lock keeps two processes from building at once (the second waits, then loads). Loading
registers torch.ops.<name>. `RADIXKV_NO_KERNEL=1` disables every kernel, and any machine where
one cannot be built (no compiler, no ninja) logs it once and the caller's torch ops serve.

The key is no secret (anyone can compute it), so the cache is trusted only as far as this user
controls it (kvpool/private_dir.py): its directories are created 0700, and one that another
user owns or that group or others may write, a library or marker there of the same kind, or a
lock file that is a symlink, is refused: the torch ops then run instead, with a warning saying
why. So does a library there that lacks the kernel's ops.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.private_dir import check_private, open_lock, private_dir


def disabled() -> bool:
    """$RADIXKV_NO_KERNEL set (and not "0"): use the torch ops (read at every call)."""
    return os.environ.get("RADIXKV_NO_KERNEL", "0") not in ("", "0")


def cache_dir() -> Path:
    """$RADIXKV_CACHE_DIR, else ~/.cache/radixkv (kernels live under kernels/, beside the
    converted models of radixkv.engines.models)."""
    env = os.environ.get("RADIXKV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixkv"


def reason(e: Exception) -> str:
    """One line of a build failure: the compiler's first error, else the message's first line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return ((errors or lines or [type(e).__name__])[0])[:300]


def cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


class Kernel:
    """One kernel: its source, flags and ops, loaded once per process (`ops`)."""

    def __init__(self, name: str, source: Path, cflags: Sequence[str], ldflags: Sequence[str],
                 ops: Sequence[str], prefix: str, what: str, fallback: str, build_s: str,
                 log: logging.Logger) -> None:
        self.name = name  # the library's and torch.ops namespace's name
        self.source = source
        self.cflags = list(cflags)
        self.ldflags = list(ldflags)
        self.op_names = tuple(ops)  # what loading the library must register
        self.prefix = prefix  # of its build directory under kernels/
        self.what = what  # its name in messages ("quantized-KV CPU kernel")
        self.fallback = fallback  # what serves without it ("the torch-op codec")
        self.build_s = build_s  # how long a build takes here, for the message ("10-20 s")
        self.log = log
        self._lock = threading.Lock()
        self._loaded: list[Any] = []  # [torch.ops.<name>] once loaded, [None] if it cannot be

    def ops(self) -> Any | None:
        """torch.ops.<name>, building it on the first call; None when disabled or when it
        cannot be built or loaded (the reason logged once)."""
        if disabled():
            return None
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    try:
                        self._loaded.append(self._build_and_load())
                    except Exception as e:  # no compiler, no ninja, a failed build: fall back
                        self.log.warning("%s unavailable (%s); using %s", self.what, reason(e),
                                         self.fallback)
                        self.log.debug("kernel build failed", exc_info=True)
                        self._loaded.append(None)
        return self._loaded[0]

    def key(self) -> str:
        """The build's key: a hash of the source, the flags, torch, Python and the CPU."""
        import torch

        return hashlib.sha256(b"\0".join([
            self.source.read_bytes(), " ".join(self.cflags).encode(),
            torch.__version__.encode(), sys.version.encode(), platform.machine().encode(),
            cpu_features().encode()])).hexdigest()[:16]

    def build_dir(self) -> Path:
        """Where this source, these flags, torch, Python and CPU build the kernel (not
        created)."""
        return Path(os.path.realpath(cache_dir())) / "kernels" / f"{self.prefix}-{self.key()}"

    def _build_and_load(self) -> Any:
        build = self.build_dir()
        private_dir(build.parent.parent, "the cache directory")
        private_dir(build.parent, "the kernel cache directory")
        private_dir(build, "the kernel build directory")
        built = build / "built"  # written last: a build killed halfway is redone
        lock = open_lock(build.parent / f"{build.name}.lock")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released if this process dies, unlike torch's
            if not built.exists():
                self._build(build)
                built.touch(0o600)
        finally:
            os.close(lock)
        library = build / f"{self.name}.so"
        check_private(built, "the kernel build marker")
        check_private(library, "the kernel library")
        return self._load(library)

    def _load(self, library: Path) -> Any:
        import torch

        torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
        ops = getattr(torch.ops, self.name)
        missing = [name for name in self.op_names if not hasattr(ops, name)]
        if missing:
            raise RuntimeError(f"{library} lacks the ops {', '.join(missing)} (a library of "
                               "another source? remove its directory to rebuild)")
        return ops

    def _build(self, build: Path) -> None:
        from torch.utils import cpp_extension

        compiler = os.environ.get("CXX", "c++")  # what torch compiles with
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler: {compiler} not found")
        print(f"radixkv: compiling the {self.what} once, into {build} ({self.build_s}) ...",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        (build / "lock").unlink(missing_ok=True)  # torch's own lock file, left by a killed build
        cpp_extension.load(name=self.name, sources=[str(self.source)], extra_cflags=self.cflags,
                           extra_ldflags=self.ldflags, build_directory=str(build),
                           is_python_module=False, verbose=False)
        print(f"radixkv: {self.what} built in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)


class CLibrary(Kernel):
    """A plain C library built with the system's C compiler ($CC, else cc) and loaded with
    ctypes (no torch): what a reader that must not import torch calls. `ops` gives the
    ctypes.CDLL; `op_names` are the symbols it must export."""

    def key(self) -> str:
        return hashlib.sha256(b"\0".join([
            self.source.read_bytes(), " ".join(self.cflags).encode(), sys.version.encode(),
            platform.machine().encode(), cpu_features().encode()])).hexdigest()[:16]

    def _build(self, build: Path) -> None:
        compiler = os.environ.get("CC", "cc")
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C compiler: {compiler} not found")
        out = build / f"{self.name}.so"
        done = subprocess.run([compiler, *self.cflags, "-shared", "-fPIC", "-o", str(out),
                               str(self.source), *self.ldflags],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(done.stderr or f"{compiler} exited {done.returncode}")
        os.chmod(out, 0o700)

    def _load(self, library: Path) -> Any:
        lib = ctypes.CDLL(str(library))
        missing = [name for name in self.op_names if not hasattr(lib, name)]
        if missing:
            raise RuntimeError(f"{library} lacks {', '.join(missing)} (a library of another "
                               "source? remove its directory to rebuild)")
        return lib
