"""The block pool contract: one slab of memory cut into fixed-size KV blocks.

    slab (block-major, contiguous; block b starts at b * bytes_per_block)
    +-----------+-----------+-----------+-----+--------------+
    | block 0   | block 1   | block 2   | ... | page / 2 MiB |  <- padding to the backend's
    +-----------+-----------+-----------+-----+--------------+     allocation granule
    one block = [layers, 2 (K, V), block_size, kv_heads, head_dim] in the layout's dtype

Two sides:
- `BlockPool` (the owner, one per service): owns the memory and the free list, exports a
  `PoolHandle`, and releases the memory on `close()`.
- `PoolMapping` (an attaching process, e.g. an engine): maps the same memory from a handle, with
  the same zero-copy views and no free list.

Views (`view()`, `numpy_view()`, `block(i)`) alias the slab. A view keeps the mapping alive
(`close()` drops the pool's own reference; the memory goes when the last view does), so a view
never dangles, but it also pins the memory: drop views you no longer need.

The pool knows no tokens, trees or leases; torch is imported only when a torch view is asked for,
so a service process can own a pool without importing torch.
"""

from __future__ import annotations

import base64
import binascii
import operator
import os
import threading
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from gpu_pool.errors import IntegrityError, InvalidArgument, OutOfBlocks
from gpu_pool.layout import KVLayout

if TYPE_CHECKING:
    import torch

BACKENDS = ("host", "cuda")

# Element types of the typed views. numpy has no bfloat16 or float8: numpy views of those pools
# hold the raw bits (uint16 for bf16, uint8 for fp8); reinterpret with torch or ml_dtypes.
TORCH_DTYPES: dict[str, str] = {
    "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn",
}
NUMPY_DTYPES: dict[str, type[np.generic]] = {
    "fp32": np.float32, "fp16": np.float16, "bf16": np.uint16, "fp8": np.uint8,
}
ITEMSIZE: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def slab_shape(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    """Shape of `view()`: [num_blocks, layers, 2, block_size, kv_heads, head_dim], or
    [num_blocks, bytes_per_block] (uint8) for quantized layouts, whose blocks also hold scales."""
    if layout.is_quantized:
        return (num_blocks, layout.bytes_per_block)
    return (num_blocks, *layout.block_shape)


def slab_strides(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    """Byte strides of `view()` (C-contiguous)."""
    shape = slab_shape(layout, num_blocks)
    step = 1 if layout.is_quantized else ITEMSIZE[layout.dtype]
    strides = []
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def slab_bytes(layout: KVLayout, num_blocks: int, num_sink_blocks: int = 0) -> int:
    """Bytes the blocks use: regular blocks first, then the sink region (quantized layouts with
    sink tokens: each of its blocks also carries a sequence's first tokens in the model dtype)."""
    return ((num_blocks - num_sink_blocks) * layout.bytes_per_block
            + num_sink_blocks * layout.sink_bytes_per_block)


def sink_blocks_for(layout: KVLayout, num_blocks: int, sink_fraction: float) -> int:
    """The sink region's share of `num_blocks` (at least 1 when the layout has sink tokens)."""
    if not layout.sink_tokens:
        return 0
    if not 0 < sink_fraction <= 1:
        raise InvalidArgument(f"sink fraction must be in (0, 1], got {sink_fraction}")
    return max(1, min(num_blocks, round(num_blocks * sink_fraction)))


def fit_blocks(layout: KVLayout, memory_bytes: int, sink_fraction: float = 0.125) -> int:
    """The most blocks (sink region included) whose slab fits in `memory_bytes`."""
    n = num_blocks_for(layout, memory_bytes)
    if layout.sink_tokens:  # sink blocks are larger: solve, then step down to fit
        avg = layout.bytes_per_block + sink_fraction * layout.sink_bytes
        n = max(1, int(memory_bytes // avg))
        while n > 1 and slab_bytes(layout, n, sink_blocks_for(layout, n, sink_fraction)) \
                > memory_bytes:
            n -= 1
    return n


def num_blocks_for(layout: KVLayout, memory_bytes: int) -> int:
    """How many whole blocks of `layout` fit in `memory_bytes`. The backend then rounds the slab
    up to its allocation granule (a page on host, 2 MiB on cuda), at most one granule more."""
    memory_bytes = _index(memory_bytes, "memory_bytes")
    n = memory_bytes // layout.bytes_per_block
    if n < 1:
        raise InvalidArgument(
            f"memory_bytes {memory_bytes} holds no block: one block is "
            f"{layout.bytes_per_block} bytes"
        )
    return n


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists here and is not a zombie (dead, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _index(value: object, what: str) -> int:
    """An int-like value (int, numpy integer) that is not a bool, else InvalidArgument."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{what} must be an integer, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class PoolHandle:
    """Everything another process needs to map a pool; small and JSON-serialisable.

    `name` is the shared-memory segment name (host; "" for cuda); `ipc_handle` the 64-byte CUDA
    IPC handle (cuda; b"" for host); `device_id` the owner's device ordinal (-1 for host; ordinals
    differ between processes under CUDA_VISIBLE_DEVICES, so attach matches `device_uuid`);
    `epoch` is unique to this pool's life; `owner_pid` is the owning process."""

    backend: str
    name: str
    nbytes: int
    num_blocks: int
    layout: KVLayout
    epoch: str
    ipc_handle: bytes = b""
    device_id: int = -1
    device_uuid: str = ""
    owner_pid: int = 0
    num_sink_blocks: int = 0  # the last ids; see BlockPool

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InvalidArgument(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if not isinstance(self.layout, KVLayout):
            raise InvalidArgument(f"layout must be a KVLayout, got {type(self.layout).__name__}")
        if self.num_blocks < 1:
            raise InvalidArgument(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0 <= self.num_sink_blocks <= self.num_blocks:
            raise InvalidArgument(f"num_sink_blocks {self.num_sink_blocks} is not within "
                                  f"0..{self.num_blocks}")
        if self.num_sink_blocks and not self.layout.sink_tokens:
            raise InvalidArgument("sink blocks need a layout with sink tokens")
        need = slab_bytes(self.layout, self.num_blocks, self.num_sink_blocks)
        if self.nbytes < need:
            raise InvalidArgument(
                f"nbytes {self.nbytes} is less than the {self.num_blocks} blocks' {need} bytes"
            )
        if not self.epoch:
            raise InvalidArgument("epoch must not be empty")
        if self.backend == "host" and not self.name:
            raise InvalidArgument("a host pool handle needs the segment name")
        if self.backend == "cuda" and len(self.ipc_handle) != 64:
            raise InvalidArgument(
                f"a cuda pool handle needs a 64-byte IPC handle, got {len(self.ipc_handle)} bytes"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the pool's `view()` (see `slab_shape`; the sink region is apart)."""
        return slab_shape(self.layout, self.num_blocks - self.num_sink_blocks)

    @property
    def strides(self) -> tuple[int, ...]:
        """Byte strides of the pool's `view()`: of the 6-d
        [num_blocks, layers, 2, block_size, kv_heads, head_dim] view, or of the 2-d byte view
        [num_blocks, bytes_per_block] for quantized layouts."""
        return slab_strides(self.layout, self.num_blocks - self.num_sink_blocks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: the layout as a dict, the IPC handle as base64 text."""
        return {
            "backend": self.backend,
            "name": self.name,
            "nbytes": self.nbytes,
            "num_blocks": self.num_blocks,
            "layout": self.layout.to_dict(),
            "epoch": self.epoch,
            "ipc_handle": base64.b64encode(self.ipc_handle).decode("ascii"),
            "device_id": self.device_id,
            "device_uuid": self.device_uuid,
            "owner_pid": self.owner_pid,
            "num_sink_blocks": self.num_sink_blocks,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolHandle:
        required = ("backend", "nbytes", "num_blocks", "layout", "epoch")
        missing = [k for k in required if k not in data]
        if missing:
            raise InvalidArgument(f"pool handle lacks {', '.join(missing)}")
        layout = data["layout"]
        try:
            ipc = base64.b64decode(data.get("ipc_handle") or "", validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise InvalidArgument("pool handle ipc_handle is not base64") from None
        return cls(
            backend=str(data["backend"]),
            name=str(data.get("name", "")),
            nbytes=_index(data["nbytes"], "nbytes"),
            num_blocks=_index(data["num_blocks"], "num_blocks"),
            layout=layout if isinstance(layout, KVLayout) else KVLayout.from_dict(layout),
            epoch=str(data["epoch"]),
            ipc_handle=ipc,
            device_id=_index(data.get("device_id", -1), "device_id"),
            device_uuid=str(data.get("device_uuid", "")),
            owner_pid=_index(data.get("owner_pid", 0), "owner_pid"),
            num_sink_blocks=_index(data.get("num_sink_blocks", 0), "num_sink_blocks"),
        )


class _Slab(ABC):
    """Typed zero-copy views over a slab; shared by the owner and the attaching side."""

    layout: KVLayout
    num_blocks: int
    num_sink_blocks: int
    backend: str
    _closed: bool

    @property
    def num_regular_blocks(self) -> int:
        return self.num_blocks - self.num_sink_blocks

    @abstractmethod
    def _torch_bytes(self) -> torch.Tensor:
        """The slab as a 1-d uint8 tensor (zero-copy) that keeps the mapping alive."""

    def _numpy_bytes(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        raise InvalidArgument(
            f"numpy_view() needs a host pool; this pool is on {self.backend}: use view()"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"{type(self).__name__} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def view(self) -> torch.Tensor:
        """The whole slab as a torch tensor, zero-copy: [num_blocks, layers, 2, block_size,
        kv_heads, head_dim] in the layout's dtype (float32, float16, bfloat16, float8_e4m3fn),
        or uint8 [num_blocks, bytes_per_block] for quantized (int8/int4) layouts. On the device
        for cuda pools. The view keeps the memory mapped until it is dropped."""
        import torch

        self._check_open()
        cached: torch.Tensor | None = self.__dict__.get("_view")
        if cached is not None:  # built once: a request path asks several times (~70 us each)
            return cached
        n = self.num_regular_blocks
        used = self._torch_bytes()[: n * self.layout.bytes_per_block]
        if self.layout.is_quantized:
            view = used.view(n, self.layout.bytes_per_block)
        else:
            dtype = getattr(torch, TORCH_DTYPES[self.layout.dtype])
            view = used.view(dtype).view(slab_shape(self.layout, n))
        self.__dict__["_view"] = view
        return view

    def _drop_views(self) -> None:
        """Forget the cached views (at close: the mapping may go once callers drop theirs)."""
        self.__dict__.pop("_view", None)
        self.__dict__.pop("_sink_view", None)

    def sink_view(self) -> torch.Tensor:
        """The sink region as uint8 [num_sink_blocks, sink_bytes_per_block]: block id
        num_regular_blocks + i is row i (gpu_pool.quant reads both regions)."""
        self._check_open()
        cached: torch.Tensor | None = self.__dict__.get("_sink_view")
        if cached is not None:  # built once, as view()
            return cached
        start = self.num_regular_blocks * self.layout.bytes_per_block
        end = slab_bytes(self.layout, self.num_blocks, self.num_sink_blocks)
        view = self._torch_bytes()[start:end].view(self.num_sink_blocks,
                                                   self.layout.sink_bytes_per_block)
        self.__dict__["_sink_view"] = view
        return view

    def numpy_view(self) -> np.ndarray[Any, Any]:
        """The whole slab as a numpy array, zero-copy (host pools only): same shape as `view()`;
        float32/float16 for fp32/fp16, raw bits for the rest (uint16 for bf16, uint8 for fp8,
        uint8 [num_blocks, bytes_per_block] for int8/int4)."""
        self._check_open()
        n = self.num_regular_blocks
        used = self._numpy_bytes()[: n * self.layout.bytes_per_block]
        if self.layout.is_quantized:
            return used.reshape(n, self.layout.bytes_per_block)
        return used.view(NUMPY_DTYPES[self.layout.dtype]).reshape(slab_shape(self.layout, n))

    def read(self, block_ids: Sequence[int], *,
             out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks `block_ids` as engine-layout (k, v), each [layers, tokens, kv_heads, head_dim]
        in the model dtype: a copy (`gpu_pool.copy.gather`), dequantized for int8/int4 pools
        (`gpu_pool.quant.gather`). `out=(k, v)`: contiguous tensors of that shape to fill
        instead of allocating."""
        if self.layout.is_quantized:
            from gpu_pool import quant

            return quant.gather(self.layout, self.view(), self.sink_view(), block_ids, out=out)
        from gpu_pool.copy import gather

        return gather(self.view(), block_ids, out=out)

    def write(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write engine-layout k, v ([layers, tokens, kv_heads, head_dim], any float dtype,
        converted) into the distinct blocks `block_ids`, quantizing for int8/int4 pools (NaN or
        Inf refused). On cuda the copy is queued: synchronize before publishing the blocks."""
        view = self.view()
        if self.layout.is_quantized:
            from gpu_pool import quant

            quant.scatter(self.layout, view, self.sink_view(), block_ids, k, v)
            return
        from gpu_pool.copy import scatter

        scatter(view, block_ids, k.to(view.device, view.dtype), v.to(view.device, view.dtype))

    def block(self, block_id: int) -> torch.Tensor:
        """One block of `view()`: [layers, 2, block_size, kv_heads, head_dim] (or its bytes;
        a sink block's row of `sink_view()`)."""
        i = _index(block_id, "block id")
        if not 0 <= i < self.num_blocks:
            raise InvalidArgument(f"block id {i} out of range 0..{self.num_blocks - 1}")
        if i >= self.num_regular_blocks:
            return self.sink_view()[i - self.num_regular_blocks]
        return self.view()[i]

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class BlockPool(_Slab):
    """The owner's side: the slab plus its free lists. Not picklable; share `export()`.

    Free-list order is FIFO: `alloc` hands out the blocks freed longest ago (initially 0, 1, 2,
    ... in order), so a just-freed block is reused last. `alloc`/`free` are atomic (a lock) and
    change nothing when they raise.

    The last `num_sink_blocks` ids are the sink region (quantized layouts with sink tokens): a
    sink block can hold any block, a regular one cannot hold a sequence's first block. `alloc(n,
    sinks=s)` takes s sink blocks first, then regular ones, falling back to sink blocks."""

    backend: str = ""

    def __init__(self, layout: KVLayout, num_blocks: int, num_sink_blocks: int = 0) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
        num_blocks = _index(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise InvalidArgument(f"num_blocks must be >= 1, got {num_blocks}")
        num_sink_blocks = _index(num_sink_blocks, "num_sink_blocks")
        if not 0 <= num_sink_blocks <= num_blocks:
            raise InvalidArgument(f"num_sink_blocks {num_sink_blocks} is not within "
                                  f"0..{num_blocks}")
        if layout.sink_tokens and not num_sink_blocks:
            raise InvalidArgument(f"a layout with {layout.sink_tokens} sink tokens needs a sink "
                                  "region (num_sink_blocks >= 1)")
        if num_sink_blocks and not layout.sink_tokens:
            raise InvalidArgument("sink blocks need a layout with sink tokens")
        self.layout = layout
        self.num_blocks = num_blocks
        self.num_sink_blocks = num_sink_blocks
        self.epoch = uuid.uuid4().hex
        self._closed = False
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(num_blocks - num_sink_blocks))
        self._free_sink: deque[int] = deque(range(num_blocks - num_sink_blocks, num_blocks))
        self._is_free = bytearray(b"\x01") * num_blocks

    # --- free list -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._free_sink)

    @property
    def num_free_sink(self) -> int:
        return len(self._free_sink)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def slab_bytes(self) -> int:
        return slab_bytes(self.layout, self.num_blocks, self.num_sink_blocks)

    def is_free(self, block_id: int) -> bool:
        i = _index(block_id, "block id")
        if not 0 <= i < self.num_blocks:
            raise InvalidArgument(f"block id {i} out of range 0..{self.num_blocks - 1}")
        return bool(self._is_free[i])

    def alloc(self, n: int, sinks: int = 0) -> list[int]:
        """Take `n` >= 1 free blocks (oldest-freed first), the first `sinks` of them from the
        sink region. OutOfBlocks when fewer are free."""
        n = _index(n, "n")
        sinks = _index(sinks, "sinks")
        if n <= 0:
            raise InvalidArgument(f"alloc needs n >= 1, got {n}")
        if not 0 <= sinks <= n:
            raise InvalidArgument(f"sinks must be within 0..{n}, got {sinks}")
        if sinks and not self.num_sink_blocks:
            sinks = 0  # no sink tokens: every block can start a sequence
        with self._lock:
            self._check_open()
            if sinks > len(self._free_sink):
                raise OutOfBlocks(f"asked {sinks} sink blocks (a sequence's first block), "
                                  f"{len(self._free_sink)} free of {self.num_sink_blocks}")
            if n > self.num_free:
                raise OutOfBlocks(f"asked {n} blocks, {self.num_free} free of {self.num_blocks}")
            ids = [self._free_sink.popleft() for _ in range(sinks)]
            regular = min(n - sinks, len(self._free))
            ids += [self._free.popleft() for _ in range(regular)]
            ids += [self._free_sink.popleft() for _ in range(n - sinks - regular)]
            for i in ids:
                self._is_free[i] = 0
            return ids

    def is_sink(self, block_id: int) -> bool:
        return block_id >= self.num_blocks - self.num_sink_blocks

    def _release(self, ids: list[int]) -> None:
        first_sink = self.num_blocks - self.num_sink_blocks
        for i in ids:
            self._is_free[i] = 1
            (self._free_sink if i >= first_sink else self._free).append(i)

    def free(self, block_ids: Iterable[int]) -> None:
        """Return allocated blocks to the tail of the free list. Ids out of range, already
        free, or repeated raise InvalidArgument, and then nothing is freed."""
        ids = list(block_ids)
        if not all(type(i) is int for i in ids):  # numpy integers and the like: checked one by one
            ids = [_index(i, "block id") for i in ids]
        with self._lock:
            self._check_open()
            is_free = self._is_free
            if (ids and len(set(ids)) == len(ids) and 0 <= min(ids) and max(ids) < self.num_blocks
                    and not any(map(is_free.__getitem__, ids))):  # the common case, in C
                if self.num_sink_blocks:
                    self._release(ids)
                    return
                for i in ids:
                    is_free[i] = 1
                self._free.extend(ids)
                return
            seen: set[int] = set()
            for i in ids:
                if not 0 <= i < self.num_blocks:
                    raise InvalidArgument(
                        f"cannot free {len(ids)} blocks: block id {i} out of range "
                        f"0..{self.num_blocks - 1}"
                    )
                if self._is_free[i]:
                    raise InvalidArgument(
                        f"cannot free {len(ids)} blocks: block {i} is already free"
                    )
                if i in seen:
                    raise InvalidArgument(f"cannot free {len(ids)} blocks: block {i} given twice")
                seen.add(i)
            self._release(ids)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless: the free list holds distinct in-range ids, exactly those
        marked free, so allocated == num_blocks - num_free."""
        with self._lock:
            free = list(self._free) + list(self._free_sink)
            first_sink = self.num_blocks - self.num_sink_blocks
            if any(i >= first_sink for i in self._free) or any(
                    i < first_sink for i in self._free_sink):
                raise IntegrityError("a block id is on the other region's free list")
            marked = sum(self._is_free)
            distinct = set(free)
            if len(distinct) != len(free):
                raise IntegrityError(f"free list holds {len(free) - len(distinct)} duplicate ids")
            bad = [i for i in free if not 0 <= i < self.num_blocks]
            if bad:
                raise IntegrityError(f"free list holds out-of-range ids {bad[:8]}")
            if marked != len(free) or any(not self._is_free[i] for i in free):
                raise IntegrityError(
                    f"free list holds {len(free)} ids but {marked} blocks are marked free"
                )

    # --- sharing ---------------------------------------------------------------------------

    @abstractmethod
    def export(self) -> PoolHandle:
        """The handle another process passes to `attach()`."""

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_free}/{self.num_blocks} free"
        return (
            f"{type(self).__name__}({self.layout.dtype}, {self.num_blocks} blocks x "
            f"{self.layout.bytes_per_block} B, {state}, epoch {self.epoch[:8]})"
        )

    def __reduce__(self) -> Any:
        raise TypeError("a BlockPool cannot be pickled: pass pool.export() to other processes")


class PoolMapping(_Slab):
    """An attaching process's view of a pool: same views as the owner, no free list.

    `close()` is idempotent and never unlinks or frees the owner's memory; views taken before
    it stay valid (they hold the mapping) until dropped."""

    def __init__(self, handle: PoolHandle) -> None:
        self.handle = handle
        self.layout = handle.layout
        self.num_blocks = handle.num_blocks
        self.num_sink_blocks = handle.num_sink_blocks
        self.backend = handle.backend
        self.epoch = handle.epoch
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"{type(self).__name__}({self.backend}, {self.num_blocks} blocks, {state}, "
            f"epoch {self.epoch[:8]})"
        )


def create_pool(
    layout: KVLayout,
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
    backend: str = "host",
    device: int = 0,
    name_prefix: str = "radixkv",
    sink_fraction: float = 0.125,
) -> BlockPool:
    """Create the owner's pool: give exactly one of `num_blocks` or `memory_bytes`.
    `device` is used by the cuda backend, `name_prefix` by the host backend. For layouts with
    sink tokens, `sink_fraction` of the blocks are sink blocks (`memory_bytes` then buys fewer
    blocks: a sink block is larger)."""
    if (num_blocks is None) == (memory_bytes is None):
        raise InvalidArgument("give exactly one of num_blocks or memory_bytes")
    if memory_bytes is not None:
        n = fit_blocks(layout, memory_bytes, sink_fraction)
    else:
        assert num_blocks is not None
        n = num_blocks
    sinks = sink_blocks_for(layout, n, sink_fraction)
    if backend == "host":
        from gpu_pool.host import HostBlockPool

        return HostBlockPool(layout, n, name_prefix=name_prefix, num_sink_blocks=sinks)
    if backend == "cuda":
        from gpu_pool.cuda import CudaBlockPool

        return CudaBlockPool(layout, n, device=device, num_sink_blocks=sinks)
    raise InvalidArgument(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")


def attach(handle: PoolHandle | Mapping[str, Any]) -> PoolMapping:
    """Map a pool exported by `BlockPool.export()` (a PoolHandle or its `to_dict()`)."""
    if not isinstance(handle, PoolHandle):
        handle = PoolHandle.from_dict(handle)
    if handle.backend == "host":
        from gpu_pool.host import attach_host

        return attach_host(handle)
    from gpu_pool.cuda import attach_cuda

    return attach_cuda(handle)
