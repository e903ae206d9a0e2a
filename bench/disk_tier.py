"""The disk tier: demote and promote throughput against the filesystem's own, the share of the
cache a clean restart keeps, and TTFT when a prompt's prefix is on disk.

    python bench/disk_tier.py --json
    python bench/disk_tier.py --no-model          # the I/O figures only

I/O (in-process, KVService over a host pool of --preset's layout, fp32, 16-token blocks:
llama-3.2-1b's are 512 KiB; the tier file in --dir, default a temporary directory under /tmp):

    demote    prompts inserted into a full pool, from the first that evicts (so demotes) to
              the end of the writer's flush + fsync (the prompts' own KV writes and Inserts
              count too); against writing the same bytes sequentially to a file in the same
              directory (4 MiB writes, fsync)
    restart   the SIGTERM path (pool's blocks written down), a new pool on the same directory:
              the share of the blocks cached before that a Match hits after
    promote   those Matches (each brings its prompt's blocks up from disk, CRC checked, bytes
              compared after) into a pool already touched, as a running service's is;
              against two reads of the same payload bytes from a file in the same directory,
              the faster one counting: the same operation as the tier's (READERS threads,
              requests of as many blocks as the tier reads in one os.preadv for a prompt
              (radixkv/disk/tier.py run_slots), in file order, into touched buffers) and
              dd's (one thread, 4 MiB reads); every file's page cache dropped first
              (posix_fadvise DONTNEED)

TTFT (SmolLM2-135M, the real model, CPU, fp32; `radixkv serve --disk-dir` with a pool too small
to keep the prefix): a 2,000-token prompt whose first 90 % is cached, median of --repeat:
pushed to disk by other prompts (`disk`), still in the pool (`memory`), and no cache. The ratio
`ttft_ratio_disk_90` is disk / no cache.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
from _common import emit, radixkv_server

BLOCKS_PER_PROMPT = 16
CHUNK = 4 << 20


def _tokens(i: int, block_size: int) -> bytes:
    return np.arange(i * 100_000, i * 100_000 + BLOCKS_PER_PROMPT * block_size,
                     dtype="<u4").tobytes()


def _fill(pool: Any, ids: Any, prompt: int) -> None:
    for j, b in enumerate(ids):
        pool.block_bytes(b)[:] = (prompt * 31 + j) % 251


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_dd(path: str) -> tuple[int, float]:
    """One thread, CHUNK-byte reads from the start to the end: bytes, seconds."""
    _drop_cache(path)
    t0 = time.perf_counter()
    got = 0
    with open(path, "rb", buffering=0) as f:
        out = bytearray(CHUNK)
        while n := f.readinto(out):
            got += n
    return got, time.perf_counter() - t0


def _read_like_the_tier(path: str, request: int, threads: int) -> tuple[int, float]:
    """What a promotion does to its slots, on a plain file: `threads` threads take the next
    `request`-byte run in file order and os.preadv it into a buffer of their own, touched
    before the clock starts. Bytes, seconds."""
    from concurrent.futures import ThreadPoolExecutor

    size = os.path.getsize(path)
    local = threading.local()
    buffers = [bytearray(request) for _ in range(threads)]
    free = iter(buffers)

    def read(offset: int) -> int:
        if not hasattr(local, "buf"):
            local.buf = next(free)
        return os.preadv(fd, [memoryview(local.buf)[:min(request, size - offset)]], offset)

    _drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            got = sum(pool.map(read, range(0, size, request)))
            seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return got, seconds


def io_figures(directory: str, preset: str, pool_blocks: int, prompts: int) -> dict[str, Any]:
    from kvpool import create_pool
    from kvpool.layout import KVLayout
    from radixkv.disk.promotion import RUN_SLOTS
    from radixkv.disk.tier import DiskTier
    from radixkv.service import KVService, ServiceConfig

    layout = KVLayout.from_preset(preset, "fp32", 16)
    bpb, bs = layout.bytes_per_block, layout.block_size
    capacity = prompts * BLOCKS_PER_PROMPT + 16
    pool = create_pool(layout, num_blocks=pool_blocks)
    pool.numpy_view().fill(0)
    svc = KVService(pool, ServiceConfig(), tier=DiskTier(pool, directory, capacity))
    first = pool_blocks // BLOCKS_PER_PROMPT  # the prompts that fit: no demotion yet
    for i in range(prompts):
        if i == first:
            t0 = time.perf_counter()
        tokens = _tokens(i, bs)
        r = svc.allocate("b", None, "ns", BLOCKS_PER_PROMPT)  # evicts: demotes
        _fill(pool, r.block_ids, i)
        svc.insert("b", r.lease_id, "ns", tokens, r.block_ids)
        svc.release("b", [r.lease_id])
    svc._tier.flush()  # noqa: SLF001 - the writer's queue and fsync belong to the timing
    demote_s = time.perf_counter() - t0
    demoted = svc.stats().disk.demoted_blocks
    svc.close_tier(write_down=True)  # the SIGTERM path
    pool.close()

    baseline = os.path.join(directory, "fs-baseline.bin")
    buf = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
    size = demoted * bpb
    t0 = time.perf_counter()
    fd = os.open(baseline, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for off in range(0, size, CHUNK):
        os.write(fd, buf[:min(CHUNK, size - off)])
    os.fsync(fd)
    fs_write_s = time.perf_counter() - t0
    for off in range(size, prompts * BLOCKS_PER_PROMPT * bpb, CHUNK):  # (untimed) the rest of
        os.write(fd, buf[:min(CHUNK, prompts * BLOCKS_PER_PROMPT * bpb - off)])  # the promoted
    os.fsync(fd)  # bytes: the read floors read as many as the Matches promote
    os.close(fd)

    from radixkv.disk.slots import FILE_NAME

    _drop_cache(os.path.join(directory, FILE_NAME))
    pool = create_pool(layout, num_blocks=capacity)  # room for everything: promotion alone
    pool.numpy_view().fill(0)  # touched, as a running service's pool is (no first-use faults)
    svc = KVService(pool, ServiceConfig(), tier=DiskTier(pool, directory, capacity))
    loaded = svc.stats().disk.loaded_blocks
    hit_blocks, promote_s, wrong = 0, 0.0, 0
    for i in range(prompts):
        t0 = time.perf_counter()
        m = svc.match("b", "ns", _tokens(i, bs))
        promote_s += time.perf_counter() - t0
        hit_blocks += len(m.block_ids)
        wrong += sum(int(pool.block_bytes(b)[0]) != (i * 31 + j) % 251
                     for j, b in enumerate(m.block_ids))
        svc.release("b", [m.lease_id])
    promoted = svc.stats().disk.promoted_blocks
    svc.check_integrity()
    svc.close_tier(write_down=False)
    pool.close()

    os.truncate(baseline, promoted * bpb)
    tier_like = _read_like_the_tier(baseline, RUN_SLOTS * bpb, 1)
    dd = _read_dd(baseline)
    os.unlink(baseline)
    gbps = lambda n, s: n / s / 1e9  # noqa: E731
    fs_read = max(gbps(*tier_like), gbps(*dd))
    return {
        "preset": preset, "bytes_per_block": bpb, "pool_blocks": pool_blocks,
        "demoted_blocks": demoted, "demote_GBps": gbps(demoted * bpb, demote_s),
        "fs_write_GBps": gbps(size, fs_write_s),
        "demote_vs_fs_write": (demoted * bpb / demote_s) / (size / fs_write_s),
        "promoted_blocks": promoted, "promote_GBps": gbps(promoted * bpb, promote_s),
        "fs_read_GBps": fs_read, "fs_read_tier_like_GBps": gbps(*tier_like),
        "fs_read_dd_GBps": gbps(*dd),
        "fs_read_threads": 1,
        "fs_read_request_bytes": RUN_SLOTS * bpb,
        "promote_vs_fs_read": gbps(promoted * bpb, promote_s) / fs_read,
        "cached_before_restart": prompts * BLOCKS_PER_PROMPT, "loaded_after_restart": loaded,
        "warm_restart_hit_fraction": hit_blocks / (prompts * BLOCKS_PER_PROMPT),
        "wrong_blocks": wrong,
    }


def ttft_figures(repeat: int, prompt_tokens: int, share: int) -> dict[str, Any]:
    """TTFT of a prompt whose first `share` % is cached on disk, in memory, or not at all."""
    from radixkv.client import Client
    from radixkv.engines import corpus, models
    from radixkv.engines.hf import Engine

    loaded = models.load("smollm2-135m", notify=lambda m: print(m, file=sys.stderr))
    source = corpus.tokens(loaded.tokenizer)
    rng = random.Random(0)

    def text(count: int) -> list[int]:
        start = rng.randrange(len(source) - count)
        return source[start:start + count]

    n, shared = prompt_tokens, prompt_tokens * share // 100
    per_prompt = n // 16 + 1
    disk, memory, none = [], [], []
    with tempfile.TemporaryDirectory(prefix="rkv-ttft-disk-") as directory:
        os.mkdir(os.path.join(directory, "disk"))
        flags = [*loaded.serve_flags(directory), "--lease-ttl", "600", "--policy", "lru",
                 "--block-size", "16", "--num-blocks",
                 str(2 * per_prompt), "--disk-dir", os.path.join(directory, "disk"),
                 "--disk-capacity-blocks", str(8 * per_prompt * (repeat + 2))]
        with radixkv_server(directory, *flags) as sock, Client(sock) as kv:
            engine = Engine(loaded.model, sock, loaded.namespace)
            for _ in range(2):  # warm-up: allocator, kernels, the pool mapping, the channel
                engine.prefill(text(n))
                engine.prefill_no_cache(text(n))
            for _ in range(repeat):
                prefix = text(shared)
                engine.prefill(prefix + text(n - shared))  # caches the prefix
                prompt = prefix + text(n - shared)
                t0 = time.perf_counter()
                int(engine.prefill_no_cache(prompt).logits_last.argmax())
                none.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                r = engine.prefill(prompt)  # the prefix in memory
                int(r.logits_last.argmax())
                memory.append(time.perf_counter() - t0)
                before = kv.stats()["disk"]["promoted_blocks"]
                for _ in range(3):  # other prompts push it out of the (LRU) pool: to disk
                    engine.prefill(text(n))
                prompt = prefix + text(n - shared)
                t0 = time.perf_counter()
                r = engine.prefill(prompt)  # the prefix promoted from disk
                int(r.logits_last.argmax())
                disk.append(time.perf_counter() - t0)
                promoted = kv.stats()["disk"]["promoted_blocks"] - before
                assert r.cached_tokens >= shared - 16 and promoted, (r.cached_tokens, promoted)
                print(f"{share}% cached: no cache {none[-1] * 1e3:.0f} ms, memory "
                      f"{memory[-1] * 1e3:.0f} ms, disk {disk[-1] * 1e3:.0f} ms "
                      f"({promoted} blocks promoted)", file=sys.stderr, flush=True)
            engine.close()
    med = {k: statistics.median(v) for k, v in (("disk", disk), ("memory", memory),
                                                  ("none", none))}
    return {"model": "smollm2-135m", "prompt_tokens": n, "cached_pct": share,
            "repeat": repeat, "ttft_no_cache_ms": med["none"] * 1e3,
            "ttft_memory_ms": med["memory"] * 1e3, "ttft_disk_ms": med["disk"] * 1e3,
            "ttft_ratio_memory_90": med["memory"] / med["none"],
            "ttft_ratio_disk_90": med["disk"] / med["none"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", help="where the tier file goes (default: a temporary directory)")
    p.add_argument("--preset", default="llama-3.2-1b", help="the I/O figures' layout")
    p.add_argument("--pool-blocks", type=int, default=64)
    p.add_argument("--prompts", type=int, default=24, help="16-block prompts for the I/O")
    p.add_argument("--repeat", type=int, default=3, help="TTFT repeats (median)")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for the TTFT (default: torch's; 1 keeps the ratios "
                   "steadier on a machine others load, as in bench/ttft.py)")
    p.add_argument("--no-model", action="store_true", help="skip the SmolLM2 TTFT")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="rkv-disk-bench-")
    try:
        out = io_figures(directory, args.preset, args.pool_blocks, args.prompts)
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    if not args.no_model:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        out.update(ttft_figures(args.repeat, args.prompt_tokens, 90))
    emit("disk_tier", out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
