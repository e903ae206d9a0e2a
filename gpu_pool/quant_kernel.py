"""The fused CPU codec for quantized blocks (quant_kernel.cpp): built on first use, then loaded.

gpu_pool/quant.py's torch ops stay the reference and the fallback: CUDA tensors, K/V of
another dtype than fp32/fp16/bf16, `RADIXKV_NO_KERNEL=1`, and any machine where the extension
cannot be built (no compiler, no ninja), which is logged once and never fails a call.

The build is a torch C++ extension compiled for this CPU (`-march=native`) into
$RADIXKV_CACHE_DIR (default ~/.cache/radixkv)/kernels/quant-<key>/, the key hashing the
source, the flags, torch, Python and the CPU's features; a file lock keeps two processes from
building at once (the second waits, then loads). Loading registers torch.ops.radixkv_quant.

The key is no secret (anyone can compute it), so the cache is trusted only as far as this user
controls it (gpu_pool/private_dir.py): its directories are created 0700, and one that another
user owns or that group or others may write, a library or marker there of the same kind, or a
lock file that is a symlink, is refused: the torch ops then run instead, with a warning saying
why. So does a library there that lacks the kernel's ops.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_pool.layout import KVLayout
from gpu_pool.private_dir import check_private, open_lock, private_dir

if TYPE_CHECKING:
    import torch

log = logging.getLogger("gpu_pool.quant_kernel")

SOURCE = Path(__file__).with_name("quant_kernel.cpp")
NAME = "radixkv_quant"
# no FMA contraction: quant.py's mul and add round one by one
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing",
          "-fopenmp"]
DTYPE_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}  # quant_kernel.cpp Dtype
OPS = ("decode", "encode")  # what loading the library must register
# encode's answers other than 0 (written): quant_kernel.cpp Refusal
NON_FINITE = 1  # K/V holds NaN or Inf
BEYOND_FP16 = 2  # a scale or minimum would overflow fp16

_lock = threading.Lock()
_loaded: list[Any] = []  # [torch.ops.radixkv_quant] once loaded, [None] when it cannot be


def disabled() -> bool:
    """$RADIXKV_NO_KERNEL set (and not "0"): use the torch-op codec (read at every call)."""
    return os.environ.get("RADIXKV_NO_KERNEL", "0") not in ("", "0")


def cache_dir() -> Path:
    """$RADIXKV_CACHE_DIR, else ~/.cache/radixkv (kernels live under kernels/, beside the
    converted models of radixkv.engines.models)."""
    env = os.environ.get("RADIXKV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixkv"


def ops() -> Any | None:
    """torch.ops.radixkv_quant, building it on the first call; None when disabled or when it
    cannot be built or loaded (the reason logged once)."""
    if disabled():
        return None
    if not _loaded:
        with _lock:
            if not _loaded:
                try:
                    _loaded.append(_build_and_load())
                except Exception as e:  # no compiler, no ninja, a failed build: fall back
                    log.warning("quantized-KV CPU kernel unavailable (%s); using the torch-op "
                                "codec", _reason(e))
                    log.debug("kernel build failed", exc_info=True)
                    _loaded.append(None)
    return _loaded[0]


def usable(t: torch.Tensor, dtype: torch.dtype) -> Any | None:
    """The ops when the kernel applies to pool rows `t` and K/V of `dtype`, else None."""
    import torch

    if t.device.type != "cpu" or dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    return ops()


@functools.lru_cache(maxsize=64)
def format_of(layout: KVLayout) -> tuple[int, ...]:
    """The layout as quant_kernel.cpp's Format reads it: geometry, codec, segment offsets."""
    offsets = {}
    offset = 0
    for name, shape, itemsize in layout.segments():
        offsets[name] = offset
        offset += itemsize * math.prod(shape)
    return (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim,
            8 if layout.dtype == "int8" else 4, layout.group, int(layout.key_scales == "channel"),
            layout.sink_tokens, DTYPE_CODES[layout.model_dtype], layout.bytes_per_block,
            offsets["data"], offsets["k_scale"], offsets.get("k_zero", 0), offsets["v_scale"],
            offsets.get("v_zero", 0))


def _reason(e: Exception) -> str:
    """One line of a build failure: the compiler's first error, else the message's first line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return ((errors or lines or [type(e).__name__])[0])[:300]


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def build_dir() -> Path:
    """Where this source, these flags, torch, Python and CPU build the kernel (not created)."""
    import torch

    key = hashlib.sha256(b"\0".join([
        SOURCE.read_bytes(), " ".join(CFLAGS).encode(), torch.__version__.encode(),
        sys.version.encode(), platform.machine().encode(),
        _cpu_features().encode()])).hexdigest()[:16]
    return Path(os.path.realpath(cache_dir())) / "kernels" / f"quant-{key}"


def _build_and_load() -> Any:
    import torch

    build = build_dir()
    private_dir(build.parent.parent, "the cache directory")
    private_dir(build.parent, "the kernel cache directory")
    private_dir(build, "the kernel build directory")
    built = build / "built"  # written last: a build killed halfway is redone
    lock = open_lock(build.parent / f"{build.name}.lock")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released if this process dies, unlike torch's baton
        if not built.exists():
            _build(build)
            built.touch(0o600)
    finally:
        os.close(lock)
    library = build / f"{NAME}.so"
    check_private(built, "the kernel build marker")
    check_private(library, "the kernel library")
    torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    ops = torch.ops.radixkv_quant
    missing = [name for name in OPS if not hasattr(ops, name)]
    if missing:
        raise RuntimeError(f"{library} lacks the ops {', '.join(missing)} (a library of another "
                           "source? remove its directory to rebuild)")
    return ops


def _build(build: Path) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")  # what torch compiles with
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler: {compiler} not found")
    print(f"radixkv: compiling the quantized-KV CPU kernel once, into {build} (10-20 s) ...",
          file=sys.stderr, flush=True)
    start = time.monotonic()
    (build / "lock").unlink(missing_ok=True)  # torch's own lock file, left by a killed build
    cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                       extra_ldflags=["-fopenmp"], build_directory=str(build),
                       is_python_module=False, verbose=False)
    print(f"radixkv: quantized-KV CPU kernel built in {time.monotonic() - start:.0f} s",
          file=sys.stderr, flush=True)
