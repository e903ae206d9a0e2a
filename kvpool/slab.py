"""The slab: one region of memory cut into fixed-size KV blocks, and its typed zero-copy views,
shared by the owner (`BlockPool`, kvpool/base.py) and the attaching side (`PoolMapping`).

    slab (block-major, contiguous; block b starts at b * bytes_per_block)
    +-----------+-----------+-----+-------------+--------------+
    | block 0   | block 1   | ... | sink region | page / 2 MiB |  <- padding to the backend's
    +-----------+-----------+-----+-------------+--------------+     allocation granule
    one block = [layers, 2 (K, V), block_size, kv_heads, head_dim] in the layout's dtype, or
    uint8 [bytes_per_block] of values and scales for int8/int4 (kvpool/codecs.py)

A sliding-window layout's pool holds two regions in one id space, each block a plain layout of
its own layers (`KVLayout.full_part()`, `window_part()`), so the codecs work on either:

    ids 0 .. F-1        full parts    [F, L_full, 2, B, H, D]   full_bytes_per_block each
    ids F .. F+W-1      window parts  [W, L_win, 2, B, H, D]    window_bytes_per_block each

A full part is a cached block position's KV of the full-attention layers, a window part the
same position's KV of the windowed layers; the two are allocated and freed apart (`alloc`,
`alloc_window`). All-windowed layouts (Mistral-7B-v0.1) have 0-byte full parts: their F ids
still name block positions but take no memory. How many of each a memory budget buys:
kvpool/sizing.py.

The engine-facing API is `read`/`write` (full parts, or every block of a pool without a
window) and `read_window`/`write_window`: engine-layout K/V in and out for every block format,
through the region's codec. Views (`view()`, `numpy_view()`, `block(i)`) alias the slab. A view
keeps the mapping alive (`close()` drops the slab's own reference; the memory goes when the last
view does), so a view never dangles, but it also pins the memory: drop views you no longer need.

torch is imported only when a torch view is asked for, so a service process can own a pool
without importing torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from kvpool.codecs import BlockCodec, codec_for
from kvpool.errors import InvalidArgument, as_index
from kvpool.layout import KVLayout

if TYPE_CHECKING:
    import torch


class Slab(ABC):
    """Typed zero-copy views over a slab; shared by the owner and the attaching side."""

    layout: KVLayout
    num_blocks: int
    num_sink_blocks: int
    num_window_blocks: int
    num_full_blocks: int  # the ids `view()` and `read` cover (and sink blocks): all but windows
    full_layout: KVLayout  # what a block of `view()` is: `layout`, or its full part
    window_layout: KVLayout | None  # what a block of `window_view()` is (windowed pools)
    codec: BlockCodec  # the format of `full_layout`'s blocks
    window_codec: BlockCodec | None  # of `window_layout`'s
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
        self.codec = codec_for(self.full_layout)
        self.window_codec = codec_for(self.window_layout) if self.window_layout else None

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
        if cached is not None:  # built once: a request path asks several times
            return cached
        view = self._typed(0, self.num_regular_blocks, self.codec)
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
        if self.window_codec is None:
            raise InvalidArgument(self._no_window())
        start = self.num_full_blocks * self.full_layout.bytes_per_block
        view = self._typed(start, self.num_window_blocks, self.window_codec)
        self.__dict__["_window_view"] = view
        return view

    def _typed(self, start: int, n: int, codec: BlockCodec) -> torch.Tensor:
        """`n` blocks of `codec`'s format from byte `start`, typed as `view()` describes."""
        return codec.view(self._torch_bytes()[start:start + n * codec.layout.bytes_per_block], n)

    def _drop_views(self) -> None:
        """Forget the cached views (at close: the mapping may go once callers drop theirs)."""
        self.__dict__.pop("_view", None)
        self.__dict__.pop("_window_view", None)
        self.__dict__.pop("_sink_view", None)

    def sink_view(self) -> torch.Tensor:
        """The sink region as uint8 [num_sink_blocks, sink_bytes_per_block]: block id
        num_regular_blocks + i is row i (the quantized codecs read both regions)."""
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

    def block_bytes(self, block_id: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """One full block's bytes in the pool's format, zero-copy (host pools only): a uint8
        array of bytes_per_block, or sink_bytes_per_block for a block of the sink region (its
        quantized part, then its sink tokens). What a disk tier copies out and back."""
        self._check_open()
        i = as_index(block_id, "block id")
        if not 0 <= i < self.num_full_blocks:
            raise InvalidArgument(f"block id {i} out of range 0..{self.num_full_blocks - 1}")
        bpb, regular = self.full_layout.bytes_per_block, self.num_regular_blocks
        if i < regular:
            return self._numpy_bytes()[i * bpb:(i + 1) * bpb]
        sbpb = self.layout.sink_bytes_per_block
        start = regular * bpb + (i - regular) * sbpb
        return self._numpy_bytes()[start:start + sbpb]

    def numpy_view(self) -> np.ndarray[Any, Any]:
        """The whole slab as a numpy array, zero-copy (host pools only): same shape as `view()`;
        float32/float16 for fp32/fp16, raw bits for the rest (uint16 for bf16, uint8 for fp8,
        uint8 [num_blocks, bytes_per_block] for int8/int4)."""
        self._check_open()
        n = self.num_regular_blocks
        return self.codec.numpy_view(self._numpy_bytes()[: n * self.full_layout.bytes_per_block],
                                     n)

    def read(self, block_ids: Sequence[int], *,
             out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks `block_ids` as engine-layout (k, v), each [layers, tokens, kv_heads, head_dim]
        in the model dtype: a copy, dequantized for int8/int4 pools (the region's codec). A
        windowed pool: full parts, layers = the full layers (0 for an all-windowed layout: empty
        tensors); window parts are `read_window`'s. `out=(k, v)`: contiguous tensors of that
        shape to fill instead of allocating."""
        try:
            return self.codec.gather(self.view(), self.sink_view(), block_ids, out=out)
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
            self.codec.scatter(view, self.sink_view(), block_ids, k, v)
        except InvalidArgument:
            if self.num_window_blocks:
                self._full_ids(block_ids, "write")
            raise

    def read_window(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Window parts `block_ids` (ids num_full_blocks .. num_blocks - 1) as `read` gives
        full parts: (k, v), each [windowed layers, tokens, kv_heads, head_dim] in the model
        dtype, in the order of `window_layers`."""
        view, ids = self.window_view(), self._window_ids(block_ids, "read_window")
        assert self.window_codec is not None
        return self.window_codec.gather(view, view[:0], ids)

    def write_window(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write engine-layout k, v ([windowed layers, tokens, kv_heads, head_dim]) into the
        distinct window parts `block_ids`, as `write` does full parts."""
        view, ids = self.window_view(), self._window_ids(block_ids, "write_window")
        assert self.window_codec is not None
        self.window_codec.scatter(view, view[:0], ids, k, v)

    def _no_window(self) -> str:
        return (f"this pool has no window parts (its layout {self.layout!r} has no sliding "
                "window)" if not self.layout.is_windowed else
                "this pool has no window parts (one region of whole blocks)")

    def _full_ids(self, block_ids: Sequence[int], what: str) -> None:
        """InvalidArgument naming the first of `block_ids` that is not a full part."""
        first = self.num_full_blocks
        for i in block_ids:
            i = as_index(i, "block id")
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
            i = as_index(i, "block id")
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
        i = as_index(block_id, "block id")
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

