"""The `cuda` backend: the slab is one plain device allocation shared with CUDA IPC.

- Owner: `cupy.cuda.Memory(nbytes)` is one cudaMalloc (never CuPy's MemoryPool: an IPC handle
  names the whole underlying allocation, so pooled sub-allocations cannot be exported), rounded
  up to 2 MiB and zeroed; `export()` carries `cudaIpcGetMemHandle(base)`, the device ordinal and
  the device UUID.
- Attaching process: the device is found by UUID (ordinals differ under CUDA_VISIBLE_DEVICES),
  the handle opened once per process (`cudaIpcOpenMemHandle`, cached) and wrapped as torch
  without a copy: UnownedMemory -> MemoryPointer -> cupy.ndarray -> torch.from_dlpack. The handle
  is closed (`cudaIpcCloseMemHandle`) when the last mapping and view of it are gone.
- The owner's process cannot open its own handle (CUDA refuses): `attach()` there returns a
  mapping over the owner's own allocation.
- The owner must outlive every importer's use: freeing an allocation others have open is
  undefined behaviour. The service allocates once at start and never resizes.
- Ordering: device writes are asynchronous. A writer synchronizes its stream (or records an
  event) before telling anyone the blocks are ready.

CuPy is imported inside functions only: importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import ctypes
import os
import threading
import uuid
import weakref
from typing import TYPE_CHECKING, Any

from kvpool.base import BlockPool, PoolMapping
from kvpool.errors import InvalidArgument, OutOfBlocks, StalePool, Unavailable
from kvpool.handle import PoolHandle, pid_alive
from kvpool.layout import KVLayout
from kvpool.units import format_bytes

if TYPE_CHECKING:
    import torch

SLAB_ALIGN = 2 << 20  # 2 MiB

# Pools owned by this process, by epoch: in-process attach uses their memory directly.
_OWNED: weakref.WeakValueDictionary[str, CudaBlockPool] = weakref.WeakValueDictionary()
# IPC handles opened by this process, by handle bytes (one open per process per handle).
_OPENED: weakref.WeakValueDictionary[bytes, _IpcOpening] = weakref.WeakValueDictionary()
_OPEN_LOCK = threading.Lock()
_UUIDS: dict[int, str] = {}


def _cupy() -> Any:
    """CuPy with a usable GPU, else Unavailable saying which is missing."""
    try:
        import cupy
    except ImportError as e:
        raise Unavailable(
            "the cuda backend needs CuPy: pip install 'radixkv[cuda12]' (or [cuda13]); "
            f"import failed: {e}"
        ) from None
    try:
        ok = bool(cupy.cuda.is_available())
    except Exception:  # a broken driver install raises instead of answering
        ok = False
    if not ok:
        raise Unavailable(
            "no CUDA GPU is visible (cupy.cuda.is_available() is False); use backend='host'"
        )
    return cupy


def is_available() -> bool:
    """True if CuPy imports and sees a GPU. Never raises."""
    try:
        _cupy()
    except Unavailable:
        return False
    return True


def device_uuid(ordinal: int) -> str:
    """The device's UUID as nvidia-smi prints it ("GPU-xxxxxxxx-xxxx-..."), from the driver
    (cuDeviceGetUuid). CuPy's getDeviceProperties()['uuid'] is not used first because Cython
    turns the char[16] into bytes cut at the first NUL."""
    if ordinal in _UUIDS:
        return _UUIDS[ordinal]
    raw = _driver_uuid(ordinal)
    if raw is None:
        props = _cupy().cuda.runtime.getDeviceProperties(ordinal)
        raw = bytes(props.get("uuid", b"")).ljust(16, b"\0")[:16]
    text = f"GPU-{uuid.UUID(bytes=raw)}"
    _UUIDS[ordinal] = text
    return text


def _driver_uuid(ordinal: int) -> bytes | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev = ctypes.c_int()
    buf = (ctypes.c_ubyte * 16)()
    get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or getattr(lib, "cuDeviceGetUuid", None)
    if get_uuid is None or lib.cuInit(0) != 0:
        return None
    if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0 or get_uuid(buf, dev) != 0:
        return None
    return bytes(buf)


def _local_ordinal(cupy: Any, wanted: str) -> int:
    count = cupy.cuda.runtime.getDeviceCount()
    seen = [device_uuid(i) for i in range(count)]
    if wanted in seen:
        return seen.index(wanted)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise Unavailable(
        f"the pool's device {wanted} is not visible in this process (visible: "
        f"{', '.join(seen) or 'none'}; CUDA_VISIBLE_DEVICES={visible!r})"
    )


def _as_torch(cupy: Any, mem: Any, nbytes: int) -> torch.Tensor:
    """A 1-d uint8 torch tensor over `mem` (a CuPy memory object), zero-copy. The tensor holds
    the CuPy array, which holds `mem` (and through UnownedMemory its owner object)."""
    import torch
    from torch.utils.dlpack import from_dlpack

    arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    try:
        return from_dlpack(arr)
    except (RuntimeError, TypeError, BufferError) as e:
        raise Unavailable(
            f"torch cannot wrap CUDA memory (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}): {e}"
        ) from e


class CudaBlockPool(BlockPool):
    """A pool in one cudaMalloc on `device` (an ordinal in this process), owned here."""

    backend = "cuda"

    def __init__(self, layout: KVLayout, num_blocks: int, device: int = 0,
                 num_sink_blocks: int = 0, num_window_blocks: int = 0) -> None:
        super().__init__(layout, num_blocks, num_sink_blocks, num_window_blocks)
        cupy = _cupy()
        count = cupy.cuda.runtime.getDeviceCount()
        if not isinstance(device, int) or not 0 <= device < count:
            raise InvalidArgument(f"device {device!r} out of range: {count} CUDA devices visible")
        self.device_id = device
        self.nbytes = -(-self.slab_bytes // SLAB_ALIGN) * SLAB_ALIGN
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(device):
            try:
                self._mem: Any = cupy.cuda.Memory(self.nbytes)
            except (runtime.CUDARuntimeError, MemoryError) as e:
                try:
                    free, total = runtime.memGetInfo()
                    room = f"{format_bytes(free)} free of {format_bytes(total)}"
                except runtime.CUDARuntimeError:
                    room = "free memory unknown"
                raise OutOfBlocks(
                    f"cannot allocate {format_bytes(self.nbytes)} for {self.num_blocks} blocks "
                    f"on cuda:{device} ({room}): {e}"
                ) from None
            runtime.memset(self._mem.ptr, 0, self.nbytes)
            runtime.deviceSynchronize()
            self._ipc_handle = bytes(runtime.ipcGetMemHandle(self._mem.ptr))
        self.device_uuid = device_uuid(device)
        self.owner_pid = os.getpid()
        self._raw: torch.Tensor | None = None
        _OWNED[self.epoch] = self

    def _torch_bytes(self) -> torch.Tensor:
        self._check_open()
        if self._raw is None:
            self._raw = _as_torch(_cupy(), self._mem, self.nbytes)
        return self._raw

    def export(self) -> PoolHandle:
        self._check_open()
        return PoolHandle(
            backend="cuda",
            name="",
            nbytes=self.nbytes,
            num_blocks=self.num_blocks,
            layout=self.layout,
            epoch=self.epoch,
            ipc_handle=self._ipc_handle,
            device_id=self.device_id,
            device_uuid=self.device_uuid,
            owner_pid=self.owner_pid,
            num_sink_blocks=self.num_sink_blocks,
            num_window_blocks=self.num_window_blocks,
        )

    def close(self) -> None:
        """Drop the pool's reference to the allocation; it is freed when the last view of it
        goes. Importers must be done with it first (see the module notes). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._drop_views()
        _OWNED.pop(self.epoch, None)
        self._raw = None
        self._mem = None


class _IpcOpening:
    """One cudaIpcOpenMemHandle in this process; closed when garbage collected, i.e. once the
    last mapping and the last view (which hold it through UnownedMemory) are gone."""

    def __init__(self, ptr: int, device: int) -> None:
        self.ptr = ptr
        self.device = device
        weakref.finalize(self, _close_ipc, ptr, device)


def _close_ipc(ptr: int, device: int) -> None:
    try:
        import cupy

        with cupy.cuda.Device(device):
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)
    except Exception:  # interpreter or driver shutting down: the process exit releases it
        pass


class CudaPoolMapping(PoolMapping):
    """An attaching process's mapping of a cuda pool (or, in the owner's process, a mapping
    over the owner's allocation). `view()` lives on `self.device`."""

    def __init__(self, handle: PoolHandle, raw: torch.Tensor, device: int) -> None:
        super().__init__(handle)
        self.device = device
        self._raw: torch.Tensor | None = raw

    def _torch_bytes(self) -> torch.Tensor:
        self._check_open()
        assert self._raw is not None
        return self._raw

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_views()
        self._raw = None


def attach_cuda(handle: PoolHandle) -> CudaPoolMapping:
    cupy = _cupy()
    if handle.owner_pid == os.getpid():
        # CUDA cannot open a handle in the process that exported it ("invalid device
        # context"): map the owner's allocation instead.
        pool = _OWNED.get(handle.epoch)
        if pool is None or pool.closed:
            raise StalePool(
                f"cuda pool epoch {handle.epoch} was owned by this process and is closed"
            )
        return CudaPoolMapping(handle, pool._torch_bytes(), pool.device_id)
    device = _local_ordinal(cupy, handle.device_uuid)
    with _OPEN_LOCK:
        opening = _OPENED.get(handle.ipc_handle)
        if opening is None:
            with cupy.cuda.Device(device):
                try:
                    ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle.ipc_handle)
                except cupy.cuda.runtime.CUDARuntimeError as e:
                    raise _open_error(handle, e) from None
            opening = _IpcOpening(ptr, device)
            _OPENED[handle.ipc_handle] = opening
    mem = cupy.cuda.UnownedMemory(opening.ptr, handle.nbytes, opening, device_id=device)
    with cupy.cuda.Device(device):
        raw = _as_torch(cupy, mem, handle.nbytes)
    return CudaPoolMapping(handle, raw, device)


def _open_error(handle: PoolHandle, error: Exception) -> Exception:
    text = (
        f"cannot open the CUDA IPC handle of pool epoch {handle.epoch} (owner pid "
        f"{handle.owner_pid}, {handle.device_uuid}): {error}"
    )
    if handle.owner_pid and not pid_alive(handle.owner_pid):
        return StalePool(f"{text}; the owner has exited: fetch the pool handle again")
    return Unavailable(
        f"{text}; the owner may have restarted (fetch the pool handle again), or CUDA IPC is "
        "not permitted between these processes (containers need a shared IPC namespace)"
    )
