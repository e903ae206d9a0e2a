"""The block pool contract: one slab of memory cut into fixed-size KV blocks.

    slab (block-major, contiguous; block b starts at b * bytes_per_block)
    +-----------+-----------+-----------+-----+--------------+
    | block 0   | block 1   | block 2   | ... | page / 2 MiB |  <- padding to the backend's
    +-----------+-----------+-----------+-----+--------------+     allocation granule
    one block = [layers, 2 (K, V), block_size, kv_heads, head_dim] in the layout's dtype

A sliding-window layout's pool holds two regions in one id space, each block a plain layout of
its own layers (`KVLayout.full_part()`, `window_part()`), so the codecs work on either:

    ids 0 .. F-1        full parts    [F, L_full, 2, B, H, D]   full_bytes_per_block each
    ids F .. F+W-1      window parts  [W, L_win, 2, B, H, D]    window_bytes_per_block each

A full part is a cached block position's KV of the full-attention layers, a window part the
same position's KV of the windowed layers; the two are allocated and freed apart (`alloc`,
`alloc_window`). All-windowed layouts (Mistral-7B-v0.1) have 0-byte full parts: their F ids
still name block positions but take no memory. How many of each a memory budget buys:
gpu_pool/sizing.py.

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
from gpu_pool.sizing import (
    _index,
    check_window_region,
    fit_blocks,
    fit_window_blocks,
    sink_blocks_for,
    slab_bytes,
    slab_shape,
    slab_strides,
    window_blocks_for,
)

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


@dataclass(frozen=True, slots=True)
class PoolHandle:
    """Everything another process needs to map a pool; small and JSON-serialisable.

    `name` is the shared-memory segment name (host; "" for cuda); `ipc_handle` the 64-byte CUDA
    IPC handle (cuda; b"" for host); `device_id` the owner's device ordinal (-1 for host; ordinals
    differ between processes under CUDA_VISIBLE_DEVICES, so attach matches `device_uuid`);
    `epoch` is unique to this pool's life; `owner_pid` is the owning process;
    `num_window_blocks` the window region's size (the last ids; 0: one region of whole blocks,
    which is also how a handle without it reads)."""

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
    num_window_blocks: int = 0  # the last ids: window parts (sliding-window layouts)

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
        if self.num_window_blocks:
            check_window_region(self.layout, self.num_blocks, self.num_sink_blocks,
                                self.num_window_blocks)
        need = slab_bytes(self.layout, self.num_blocks, self.num_sink_blocks,
                          self.num_window_blocks)
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
        """Shape of the pool's `view()` (see `slab_shape`; the sink or window region is apart;
        a windowed pool's view is of its full parts)."""
        if self.num_window_blocks:
            return slab_shape(self.layout.full_part(), self.num_blocks - self.num_window_blocks)
        return slab_shape(self.layout, self.num_blocks - self.num_sink_blocks)

    @property
    def strides(self) -> tuple[int, ...]:
        """Byte strides of the pool's `view()`: of the 6-d
        [num_blocks, layers, 2, block_size, kv_heads, head_dim] view, or of the 2-d byte view
        [num_blocks, bytes_per_block] for quantized layouts."""
        if self.num_window_blocks:
            return slab_strides(self.layout.full_part(),
                                self.num_blocks - self.num_window_blocks)
        return slab_strides(self.layout, self.num_blocks - self.num_sink_blocks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: the layout as a dict, the IPC handle as base64 text; num_window_blocks
        only when there is a window region."""
        out = {
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
        if self.num_window_blocks:
            out["num_window_blocks"] = self.num_window_blocks
        return out

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
            num_window_blocks=_index(data.get("num_window_blocks", 0), "num_window_blocks"),
        )


class _Slab(ABC):
    """Typed zero-copy views over a slab; shared by the owner and the attaching side."""

    layout: KVLayout
    num_blocks: int
    num_sink_blocks: int
    num_window_blocks: int
    num_full_blocks: int  # the ids `view()` and `read` cover (and sink blocks): all but windows
    full_layout: KVLayout  # what a block of `view()` is: `layout`, or its full part
    window_layout: KVLayout | None  # what a block of `window_view()` is (windowed pools)
    backend: str
    _closed: bool

    def _set_regions(self, layout: KVLayout, num_blocks: int, num_sink_blocks: int,
                     num_window_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.num_sink_blocks = num_sink_blocks
        self.num_window_blocks = num_window_blocks
        self.num_full_blocks = num_blocks - num_window_blocks
        self.full_layout = layout.full_part() if num_window_blocks else layout
        self.window_layout = layout.window_part() if num_window_blocks else None

    @property
    def num_regular_blocks(self) -> int:
        """Rows of `view()`: the ids before the sink or window region."""
        return self.num_blocks - self.num_sink_blocks - self.num_window_blocks

    def is_window(self, block_id: int) -> bool:
        """Whether `block_id` names a window part (the last num_window_blocks ids)."""
        return bool(self.num_window_blocks) and block_id >= self.num_full_blocks

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
        for cuda pools. The view keeps the memory mapped until it is dropped. A windowed pool:
        its full parts, [num_full_blocks, ...] of `full_layout` (an all-windowed one's layer
        axis is 0 long); the window parts are `window_view()`."""
        self._check_open()
        cached: torch.Tensor | None = self.__dict__.get("_view")
        if cached is not None:  # built once: a request path asks several times (~70 us each)
            return cached
        view = self._typed(0, self.num_regular_blocks, self.full_layout)
        self.__dict__["_view"] = view
        return view

    def window_view(self) -> torch.Tensor:
        """The window parts, as `view()` is the full parts: [num_window_blocks, ...] of
        `window_layout`, block id num_full_blocks + i at row i. InvalidArgument on a pool
        without a window region."""
        self._check_open()
        cached: torch.Tensor | None = self.__dict__.get("_window_view")
        if cached is not None:
            return cached
        if self.window_layout is None:
            raise InvalidArgument(self._no_window())
        start = self.num_full_blocks * self.full_layout.bytes_per_block
        view = self._typed(start, self.num_window_blocks, self.window_layout)
        self.__dict__["_window_view"] = view
        return view

    def _typed(self, start: int, n: int, layout: KVLayout) -> torch.Tensor:
        """`n` blocks of `layout` from byte `start`, typed as `view()` describes."""
        import torch

        used = self._torch_bytes()[start:start + n * layout.bytes_per_block]
        if layout.is_quantized:
            return used.view(n, layout.bytes_per_block)
        dtype = getattr(torch, TORCH_DTYPES[layout.dtype])
        return used.view(dtype).view(slab_shape(layout, n))

    def _drop_views(self) -> None:
        """Forget the cached views (at close: the mapping may go once callers drop theirs)."""
        self.__dict__.pop("_view", None)
        self.__dict__.pop("_window_view", None)
        self.__dict__.pop("_sink_view", None)

    def sink_view(self) -> torch.Tensor:
        """The sink region as uint8 [num_sink_blocks, sink_bytes_per_block]: block id
        num_regular_blocks + i is row i (gpu_pool.quant reads both regions)."""
        self._check_open()
        cached: torch.Tensor | None = self.__dict__.get("_sink_view")
        if cached is not None:  # built once, as view()
            return cached
        start = self.num_regular_blocks * self.full_layout.bytes_per_block
        end = start + self.num_sink_blocks * self.layout.sink_bytes_per_block
        view = self._torch_bytes()[start:end].view(self.num_sink_blocks,
                                                   self.layout.sink_bytes_per_block)
        self.__dict__["_sink_view"] = view
        return view

    def numpy_view(self) -> np.ndarray[Any, Any]:
        """The whole slab as a numpy array, zero-copy (host pools only): same shape as `view()`;
        float32/float16 for fp32/fp16, raw bits for the rest (uint16 for bf16, uint8 for fp8,
        uint8 [num_blocks, bytes_per_block] for int8/int4)."""
        self._check_open()
        n, layout = self.num_regular_blocks, self.full_layout
        used = self._numpy_bytes()[: n * layout.bytes_per_block]
        if layout.is_quantized:
            return used.reshape(n, layout.bytes_per_block)
        return used.view(NUMPY_DTYPES[layout.dtype]).reshape(slab_shape(layout, n))

    def read(self, block_ids: Sequence[int], *,
             out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks `block_ids` as engine-layout (k, v), each [layers, tokens, kv_heads, head_dim]
        in the model dtype: a copy (`gpu_pool.copy.gather`), dequantized for int8/int4 pools
        (`gpu_pool.quant.gather`). A windowed pool: full parts, layers = the full layers (0 for
        an all-windowed layout: empty tensors); window parts are `read_window`'s. `out=(k, v)`:
        contiguous tensors of that shape to fill instead of allocating."""
        try:
            if self.full_layout.is_quantized:
                from gpu_pool import quant

                return quant.gather(self.full_layout, self.view(), self.sink_view(), block_ids,
                                    out=out)
            from gpu_pool.copy import gather

            return gather(self.view(), block_ids, out=out)
        except InvalidArgument:  # a window part's id says so (no cost on the way without)
            if self.num_window_blocks:
                self._full_ids(block_ids, "read")
            raise

    def write(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write engine-layout k, v ([layers, tokens, kv_heads, head_dim], any float dtype,
        converted) into the distinct blocks `block_ids`, quantizing for int8/int4 pools (NaN or
        Inf refused). On cuda the copy is queued: synchronize before publishing the blocks.
        A windowed pool: full parts, layers = the full layers; window parts: `write_window`."""
        view = self.view()
        try:
            if self.full_layout.is_quantized:
                from gpu_pool import quant

                quant.scatter(self.full_layout, view, self.sink_view(), block_ids, k, v)
                return
            from gpu_pool.copy import scatter

            scatter(view, block_ids, k.to(view.device, view.dtype),
                    v.to(view.device, view.dtype))
        except InvalidArgument:
            if self.num_window_blocks:
                self._full_ids(block_ids, "write")
            raise

    def read_window(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Window parts `block_ids` (ids num_full_blocks .. num_blocks - 1) as `read` gives
        full parts: (k, v), each [windowed layers, tokens, kv_heads, head_dim] in the model
        dtype, in the order of `window_layers`."""
        view, ids = self.window_view(), self._window_ids(block_ids, "read_window")
        assert self.window_layout is not None
        if self.window_layout.is_quantized:
            from gpu_pool import quant

            return quant.gather(self.window_layout, view, view[:0], ids)
        from gpu_pool.copy import gather

        return gather(view, ids)

    def write_window(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write engine-layout k, v ([windowed layers, tokens, kv_heads, head_dim]) into the
        distinct window parts `block_ids`, as `write` does full parts."""
        view, ids = self.window_view(), self._window_ids(block_ids, "write_window")
        assert self.window_layout is not None
        if self.window_layout.is_quantized:
            from gpu_pool import quant

            quant.scatter(self.window_layout, view, view[:0], ids, k, v)
            return
        from gpu_pool.copy import scatter

        scatter(view, ids, k.to(view.device, view.dtype), v.to(view.device, view.dtype))

    def _no_window(self) -> str:
        return (f"this pool has no window parts (its layout {self.layout!r} has no sliding "
                "window)" if not self.layout.is_windowed else
                "this pool has no window parts (one region of whole blocks)")

    def _full_ids(self, block_ids: Sequence[int], what: str) -> None:
        """InvalidArgument naming the first of `block_ids` that is not a full part."""
        first = self.num_full_blocks
        for i in block_ids:
            i = _index(i, "block id")
            if first <= i < self.num_blocks:
                raise InvalidArgument(
                    f"block id {i} is a window part (ids {first}..{self.num_blocks - 1}); "
                    f"{what} takes full parts 0..{first - 1}: use {what}_window")

    def _window_ids(self, block_ids: Sequence[int], what: str) -> list[int]:
        """Window-part ids as rows of `window_view()`; InvalidArgument naming a wrong one."""
        if not self.num_window_blocks:
            raise InvalidArgument(f"{what}: {self._no_window()}")
        first, n = self.num_full_blocks, self.num_blocks
        rows = []
        for i in block_ids:
            i = _index(i, "block id")
            if not first <= i < n:
                where = (f"is a full part (ids 0..{first - 1})" if 0 <= i < first
                         else f"out of range 0..{n - 1}")
                raise InvalidArgument(f"block id {i} {where}; {what} takes window parts "
                                      f"{first}..{n - 1}")
            rows.append(i - first)
        return rows

    def block(self, block_id: int) -> torch.Tensor:
        """One block of `view()`: [layers, 2, block_size, kv_heads, head_dim] (or its bytes;
        a sink block's row of `sink_view()`, a window part's of `window_view()`)."""
        i = _index(block_id, "block id")
        if not 0 <= i < self.num_blocks:
            raise InvalidArgument(f"block id {i} out of range 0..{self.num_blocks - 1}")
        if i >= self.num_regular_blocks:
            if self.num_window_blocks:
                return self.window_view()[i - self.num_regular_blocks]
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
    sinks=s)` takes s sink blocks first, then regular ones, falling back to sink blocks.

    A sliding-window layout's pool: the last `num_window_blocks` ids are window parts, the
    first `num_full_blocks` full parts (the module notes). `alloc` hands out full parts and
    `num_free` counts them, as for any pool; `alloc_window` and `num_free_window` are the
    window parts'; `free` takes both."""

    backend: str = ""

    def __init__(self, layout: KVLayout, num_blocks: int, num_sink_blocks: int = 0,
                 num_window_blocks: int = 0) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
        num_blocks = _index(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise InvalidArgument(f"num_blocks must be >= 1, got {num_blocks}")
        num_sink_blocks = _index(num_sink_blocks, "num_sink_blocks")
        num_window_blocks = _index(num_window_blocks, "num_window_blocks")
        if layout.is_windowed or num_window_blocks:
            check_window_region(layout, num_blocks, num_sink_blocks, num_window_blocks)
        if not 0 <= num_sink_blocks <= num_blocks:
            raise InvalidArgument(f"num_sink_blocks {num_sink_blocks} is not within "
                                  f"0..{num_blocks}")
        if layout.sink_tokens and not num_sink_blocks:
            raise InvalidArgument(f"a layout with {layout.sink_tokens} sink tokens needs a sink "
                                  "region (num_sink_blocks >= 1)")
        if num_sink_blocks and not layout.sink_tokens:
            raise InvalidArgument("sink blocks need a layout with sink tokens")
        self._set_regions(layout, num_blocks, num_sink_blocks, num_window_blocks)
        self.epoch = uuid.uuid4().hex
        self._closed = False
        self._lock = threading.Lock()
        first = self.num_regular_blocks  # of the sink or window region
        self._free: deque[int] = deque(range(first))
        self._free_sink: deque[int] = deque(range(first, num_blocks) if num_sink_blocks else ())
        self._free_window: deque[int] = deque(range(first, num_blocks) if num_window_blocks
                                              else ())
        self._two_regions = bool(num_sink_blocks or num_window_blocks)  # `free` sorts ids
        self._is_free = bytearray(b"\x01") * num_blocks

    # --- free list -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Free blocks `alloc` can hand out (a windowed pool: full parts)."""
        return len(self._free) + len(self._free_sink)

    @property
    def num_free_sink(self) -> int:
        return len(self._free_sink)

    @property
    def num_free_window(self) -> int:
        """Free window parts (0 without a window region)."""
        return len(self._free_window)

    @property
    def num_used(self) -> int:
        """Blocks `alloc` handed out and not freed (a windowed pool: full parts)."""
        return self.num_full_blocks - self.num_free

    @property
    def slab_bytes(self) -> int:
        return slab_bytes(self.layout, self.num_blocks, self.num_sink_blocks,
                          self.num_window_blocks)

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
                raise OutOfBlocks(f"asked {n} blocks, {self.num_free} free of "
                                  f"{self.num_full_blocks}")
            ids = [self._free_sink.popleft() for _ in range(sinks)]
            regular = min(n - sinks, len(self._free))
            ids += [self._free.popleft() for _ in range(regular)]
            ids += [self._free_sink.popleft() for _ in range(n - sinks - regular)]
            for i in ids:
                self._is_free[i] = 0
            return ids

    def alloc_window(self, m: int) -> list[int]:
        """Take `m` >= 1 free window parts (oldest-freed first; ids num_full_blocks and up).
        OutOfBlocks when fewer are free; InvalidArgument on a pool without window parts."""
        m = _index(m, "m")
        if m <= 0:
            raise InvalidArgument(f"alloc_window needs m >= 1, got {m}")
        if not self.num_window_blocks:
            raise InvalidArgument(f"alloc_window: {self._no_window()}")
        with self._lock:
            self._check_open()
            free = self._free_window
            if m > len(free):
                raise OutOfBlocks(f"asked {m} window parts, {len(free)} free of "
                                  f"{self.num_window_blocks}")
            ids = [free.popleft() for _ in range(m)]
            for i in ids:
                self._is_free[i] = 0
            return ids

    def is_sink(self, block_id: int) -> bool:
        return block_id >= self.num_blocks - self.num_sink_blocks

    def _release(self, ids: list[int]) -> None:
        first = self.num_regular_blocks
        other = self._free_window if self.num_window_blocks else self._free_sink
        for i in ids:
            self._is_free[i] = 1
            (other if i >= first else self._free).append(i)

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
                if self._two_regions:
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
        """Raise IntegrityError unless: the free lists hold distinct in-range ids of their own
        region, exactly those marked free, so allocated == num_blocks - num_free -
        num_free_window."""
        with self._lock:
            free = list(self._free) + list(self._free_sink) + list(self._free_window)
            first = self.num_regular_blocks
            if any(i >= first for i in self._free) or any(
                    i < first for i in (*self._free_sink, *self._free_window)):
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

    def describe(self) -> str:
        """The blocks in words: "1024 blocks x 1024 B", or for a windowed pool
        "16 full parts x 512 B + 16 window parts x 512 B"."""
        if not self.num_window_blocks:
            return f"{self.num_blocks} blocks x {self.layout.bytes_per_block} B"
        return (f"{self.num_full_blocks} full parts x {self.layout.full_bytes_per_block} B + "
                f"{self.num_window_blocks} window parts x {self.layout.window_bytes_per_block} B")

    def __repr__(self) -> str:
        if self._closed:
            state = "closed"
        elif self.num_window_blocks:
            state = (f"{self.num_free}/{self.num_full_blocks} + "
                     f"{self.num_free_window}/{self.num_window_blocks} free")
        else:
            state = f"{self.num_free}/{self.num_blocks} free"
        return (f"{type(self).__name__}({self.layout.dtype}, {self.describe()}, {state}, "
                f"epoch {self.epoch[:8]})")

    def __reduce__(self) -> Any:
        raise TypeError("a BlockPool cannot be pickled: pass pool.export() to other processes")


class PoolMapping(_Slab):
    """An attaching process's view of a pool: same views as the owner, no free list.

    `close()` is idempotent and never unlinks or frees the owner's memory; views taken before
    it stay valid (they hold the mapping) until dropped."""

    def __init__(self, handle: PoolHandle) -> None:
        self.handle = handle
        self._set_regions(handle.layout, handle.num_blocks, handle.num_sink_blocks,
                          handle.num_window_blocks)
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
    num_window_blocks: int | None = None,
    window_fraction: float | None = None,
) -> BlockPool:
    """Create the owner's pool: give exactly one of `num_blocks` or `memory_bytes`.
    `device` is used by the cuda backend, `name_prefix` by the host backend. For layouts with
    sink tokens, `sink_fraction` of the blocks are sink blocks (`memory_bytes` then buys fewer
    blocks: a sink block is larger).

    Sliding-window layouts get full parts and window parts (the module notes). `num_blocks`
    is then the full parts F, and the window parts are `num_window_blocks` (default: F) or
    those that make `window_fraction` of the bytes (`window_blocks_for`); the pool has F + W
    ids. `memory_bytes` is split by `window_fraction` (default `default_window_fraction`;
    `fit_window_blocks`). Both are refused for other layouts."""
    if (num_blocks is None) == (memory_bytes is None):
        raise InvalidArgument("give exactly one of num_blocks or memory_bytes")
    if layout.is_windowed:
        n, windows = _window_counts(layout, num_blocks, memory_bytes, num_window_blocks,
                                    window_fraction)
    else:
        if num_window_blocks or window_fraction is not None:
            raise InvalidArgument(f"window parts need a sliding-window layout; {layout!r} has "
                                  "full attention on every layer")
        n = (fit_blocks(layout, memory_bytes, sink_fraction) if memory_bytes is not None
             else _index(num_blocks, "num_blocks"))
        windows = 0
    sinks = sink_blocks_for(layout, n, sink_fraction)
    if backend == "host":
        from gpu_pool.host import HostBlockPool

        return HostBlockPool(layout, n, name_prefix=name_prefix, num_sink_blocks=sinks,
                             num_window_blocks=windows)
    if backend == "cuda":
        from gpu_pool.cuda import CudaBlockPool

        return CudaBlockPool(layout, n, device=device, num_sink_blocks=sinks,
                             num_window_blocks=windows)
    raise InvalidArgument(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")


def _window_counts(layout: KVLayout, num_blocks: int | None, memory_bytes: int | None,
                   num_window_blocks: int | None, window_fraction: float | None
                   ) -> tuple[int, int]:
    """(ids, window parts) of a windowed pool from create_pool's arguments."""
    if layout.sink_tokens:
        check_window_region(layout, 2, 0, 1)  # says sinks are not supported yet
    if num_window_blocks is not None and window_fraction is not None:
        raise InvalidArgument("give num_window_blocks or window_fraction, not both")
    if memory_bytes is not None:
        if num_window_blocks is not None:
            raise InvalidArgument("with memory_bytes, size the window parts by window_fraction "
                                  "(num_window_blocks goes with num_blocks)")
        full, windows = fit_window_blocks(layout, memory_bytes, window_fraction)
        return full + windows, windows
    full = _index(num_blocks, "num_blocks")
    if full < 1:
        raise InvalidArgument(f"num_blocks must be >= 1, got {full}")
    windows = (window_blocks_for(layout, full, window_fraction) if num_window_blocks is None
               else _index(num_window_blocks, "num_window_blocks"))
    if windows < 1:
        raise InvalidArgument(f"num_window_blocks must be >= 1, got {windows}")
    return full + windows, windows


def attach(handle: PoolHandle | Mapping[str, Any]) -> PoolMapping:
    """Map a pool exported by `BlockPool.export()` (a PoolHandle or its `to_dict()`)."""
    if not isinstance(handle, PoolHandle):
        handle = PoolHandle.from_dict(handle)
    if handle.backend == "host":
        from gpu_pool.host import attach_host

        return attach_host(handle)
    from gpu_pool.cuda import attach_cuda

    return attach_cuda(handle)
