"""The export handle: everything another process needs to map a pool (`PoolHandle`), small and
JSON-serialisable, and whether its owner still lives (`pid_alive`)."""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.errors import InvalidArgument, as_index
from kvpool.layout import KVLayout
from kvpool.sizing import check_window_region, slab_bytes, slab_shape, slab_strides

BACKENDS = ("host", "cuda")


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
            nbytes=as_index(data["nbytes"], "nbytes"),
            num_blocks=as_index(data["num_blocks"], "num_blocks"),
            layout=layout if isinstance(layout, KVLayout) else KVLayout.from_dict(layout),
            epoch=str(data["epoch"]),
            ipc_handle=ipc,
            device_id=as_index(data.get("device_id", -1), "device_id"),
            device_uuid=str(data.get("device_uuid", "")),
            owner_pid=as_index(data.get("owner_pid", 0), "owner_pid"),
            num_sink_blocks=as_index(data.get("num_sink_blocks", 0), "num_sink_blocks"),
            num_window_blocks=as_index(data.get("num_window_blocks", 0), "num_window_blocks"),
        )
