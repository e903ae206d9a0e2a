"""kvpool: one slab of memory cut into fixed-size KV blocks, shared zero-copy between the
service that owns it and the engines that attach it. Backends: `host` (POSIX shared memory) and
`cuda` (one device allocation shared with CUDA IPC; CuPy imported only when used).

    pool = create_pool(layout, num_blocks=1024)        # owner (the service)
    handle = pool.export().to_dict()                   # JSON-safe, sent to engines
    mapping = attach(handle)                           # engine: same memory, zero-copy
    k, v = mapping.read(block_ids)                     # blocks -> engine-layout K/V
    mapping.write(new_ids, k, v)                       # and back (every block format)

Modules, lowest first: `errors`, `units`, `window` (the attention pattern), `models` (presets,
Hugging Face configs), `layout` (`KVLayout`, the byte math), `sizing`, `calc` (the memory
calculator), `copy` and `quant` (the kernels), `codecs` (block formats), `handle`, `slab`,
`base` (owner and mapping), `host`, `cuda`, `factory` (`create_pool`, `attach`). `gather` and
`scatter` copy plain blocks of a view directly. This package imports nothing of `radixkv`.
Importing it imports neither CuPy nor torch.
"""

from kvpool.base import BlockPool, PoolMapping
from kvpool.copy import gather, scatter
from kvpool.errors import PoolError
from kvpool.factory import attach, create_pool
from kvpool.handle import BACKENDS, PoolHandle
from kvpool.host import install_signal_cleanup, reclaim_stale_segments
from kvpool.layout import KVLayout
from kvpool.segment import unlink_owned_segments
from kvpool.sizing import num_blocks_for, slab_shape, slab_strides

__all__ = [
    "BACKENDS",
    "BlockPool",
    "KVLayout",
    "PoolHandle",
    "PoolError",
    "PoolMapping",
    "attach",
    "create_pool",
    "gather",
    "install_signal_cleanup",
    "num_blocks_for",
    "reclaim_stale_segments",
    "scatter",
    "slab_shape",
    "slab_strides",
    "unlink_owned_segments",
]
