"""gpu_pool: one slab of memory cut into fixed-size KV blocks, shared zero-copy between the
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

from gpu_pool.base import BlockPool, PoolMapping
from gpu_pool.copy import gather, scatter
from gpu_pool.errors import PoolError
from gpu_pool.factory import attach, create_pool
from gpu_pool.handle import BACKENDS, PoolHandle
from gpu_pool.host import install_signal_cleanup, reclaim_stale_segments, unlink_owned_segments
from gpu_pool.layout import KVLayout
from gpu_pool.sizing import num_blocks_for, slab_shape, slab_strides

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
