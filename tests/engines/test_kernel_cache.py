"""The kernel build cache and the model cache trust only what this user controls: directories
are created 0700; a directory or file that another user owns or that group or others may write
is refused (the kernel then falls back to the torch ops, with a warning; a model load fails
with PermissionDenied); lock files are never opened through a symlink; and a library in the
cache that lacks the kernel's ops is not used. Each kernel case runs in a fresh process, as an
engine would, with $RADIXKV_CACHE_DIR pointing at a temporary cache."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpool import quant_kernel
from radixkv.engines import models
from radixkv.protocol.errors import PermissionDenied

ROOT = Path(__file__).resolve().parents[2]

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  const char* mark = getenv("PLANTED_MARK");
  FILE* f = mark ? fopen(mark, "w") : NULL;
  if (f) { fputs("ran", f); fclose(f); }
}
"""

# a quantized write through the pool, as an engine does: the kernel where it loads, else the
# torch ops; prints whether the kernel's ops were used
WRITE = """
import logging, torch
logging.basicConfig(level=logging.WARNING)
from kvpool import create_pool, quant_kernel
from kvpool.layout import KVLayout
lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype="int8")
with create_pool(lay, num_blocks=2) as pool:
    k = torch.randn(1, 4, 2, 8)
    pool.write([1], k, k)
    back, _ = pool.read([1])
    assert float((back - k).abs().max()) < 0.05
print("kernel used:", quant_kernel.ops() is not None)
"""


def public_key() -> str:
    """The build directory's key: a hash of inputs anyone on the machine can read (the
    source, the flags, the torch and Python versions, the CPU), so another user can compute
    where a victim's process will look."""
    with open("/proc/cpuinfo") as f:
        cpu = next((line for line in f if line.startswith(("flags", "Features"))), "")
    return hashlib.sha256(b"\0".join([
        quant_kernel.SOURCE.read_bytes(), " ".join(quant_kernel.CFLAGS).encode(),
        torch.__version__.encode(), sys.version.encode(), platform.machine().encode(),
        cpu.encode()])).hexdigest()[:16]


def plant(build: Path, mark: Path) -> None:
    """A library with a constructor (it writes `mark`) and the `built` marker, where the
    kernel would be."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build a library with")
    build.mkdir(parents=True, exist_ok=True)
    src = build.parent / "planted.c"
    src.write_text(PLANTED)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(build / "radixkv_quant.so"), str(src)],
                   check=True, capture_output=True)
    (build / "built").touch()


def run_write(cache: Path, mark: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "RADIXKV_CACHE_DIR": str(cache), "RADIXKV_NO_KERNEL": "0",
            "PLANTED_MARK": str(mark), "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", WRITE], env=full, capture_output=True,
                          text=True, timeout=300)


def test_a_library_planted_in_a_writable_cache_is_not_loaded(tmp_path):
    cache = tmp_path / "cache"
    build = cache / "kernels" / f"quant-{public_key()}"
    plant(build, tmp_path / "mark")
    for d in (cache, cache / "kernels", build):
        d.chmod(0o777)  # as a shared or careless $RADIXKV_CACHE_DIR would be
    out = run_write(cache, tmp_path / "mark")
    assert not (tmp_path / "mark").exists(), "the planted library's constructor ran"
    assert out.returncode == 0, out.stderr
    assert "kernel used: False" in out.stdout
    assert "writable by group or others" in out.stderr


def test_the_lock_file_is_not_opened_through_a_symlink(tmp_path):
    cache = tmp_path / "cache"
    key = public_key()
    plant(cache / "kernels" / f"quant-{key}", tmp_path / "mark")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (cache / "kernels" / f"quant-{key}.lock").symlink_to(victim)
    out = run_write(cache, tmp_path / "mark")
    assert victim.read_text() == "precious\n"
    assert out.returncode == 0, out.stderr
    assert "kernel used: False" in out.stdout
    assert "symlink" in out.stderr


def test_a_cached_library_without_the_ops_falls_back_to_the_torch_ops(tmp_path):
    cache = tmp_path / "cache"
    plant(cache / "kernels" / f"quant-{public_key()}", tmp_path / "mark")  # ours, private
    out = run_write(cache, tmp_path / "mark")
    assert out.returncode == 0, out.stderr  # every write raised AttributeError before
    assert "kernel used: False" in out.stdout
    assert "lacks the ops" in out.stderr


def test_cache_directories_are_created_private(tmp_path):
    cache = tmp_path / "fresh" / "cache"
    out = run_write(cache, tmp_path / "mark", CXX="no-such-compiler")  # no build: a fallback
    assert out.returncode == 0, out.stderr
    for d in (cache, cache / "kernels", cache / "kernels" / f"quant-{public_key()}"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


# ---- the model cache -------------------------------------------------------------------------

def stand_in(out: Path) -> None:
    (out / models.WEIGHTS).write_bytes(bytes(range(256)))
    (out / "config.json").write_text('{"num_hidden_layers": 1}')


def test_a_model_cache_others_may_write_is_refused(tmp_path, real_spec):
    spec = real_spec
    entry, converted = models.ensure_converted(spec, tmp_path / "cache", stand_in)
    assert converted
    for d in (tmp_path / "cache", tmp_path / "cache" / "models"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (tmp_path / "cache" / "models").chmod(0o777)  # anyone could swap the entry now
    with pytest.raises(PermissionDenied, match="writable by group or others"):
        models.ensure_converted(spec, tmp_path / "cache", stand_in)
    (tmp_path / "cache" / "models").chmod(0o700)
    entry.chmod(0o777)
    with pytest.raises(PermissionDenied, match="writable by group or others"):
        models.ensure_converted(spec, tmp_path / "cache", stand_in)
