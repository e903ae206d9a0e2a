"""radixkv as SGLang's HiCache storage backend: pages per second through SGLang's own
HiCacheController on CPU, backup (write_storage -> batch_set_v1) and prefetch (prefetch ->
batch_exists -> batch_get_v1) of the pages just backed up, in 64-page batches (radixkv's
prefetch thus first waits for what is left of the backup's unwaited Insert); against SGLang's
file backend (--hicache-storage-backend file, on a temporary directory) through the same
controller, and a plain memcpy of the same bytes, in the same run.

    .venv/bin/python bench/hicache_bench.py --json      # ~3 min on 2 cores

The controller runs in .venv-sglang (`scripts/bootstrap_sglang` runs first if that venv is
missing; bench/_hicache_worker.py), with a page_first host pool; radixkv serves a pool of the
same geometry. Each page size is a model geometry (layers, kv heads, head_dim, fp16, page size
16 tokens); per backend and page size, one process times ROUNDS batches after one warm-up.
Rows: op (set/get), page_bytes, radixkv_pages_per_s, file_backend_pages_per_s,
memcpy_pages_per_s, vs_file_backend and vs_memcpy (radixkv's pages/s over theirs), and GB/s.

radixkv runs three times. Cold (the radixkv_pages_per_s, vs_* columns): a pool with room for
every batch, so each timed batch is written into pool memory no process has touched yet, and
pays its first-touch page faults. Warm (radixkv_warm_pages_per_s, vs_*_warm): a pool of two
batches, so each timed batch after the first reuses evicted blocks, as a full cache does. The
third run, cold again with `lookup: match` (radixkv_match_pages_per_s; table_vs_match is the
cold run's pages/s over it), asks batch_exists with a Match as the backend did before radixkv's
lookup table. The memcpy copies between two tensors of the batch's size with torch's default
threads (as radixkv's copies run), its destination already written in the warm-up: it compares
like-for-like with the warm figure.

The ceiling (ceiling_pages_per_s, ceiling_vs_file_backend, ceiling_vs_memcpy; vs_ceiling and
vs_ceiling_warm are radixkv's over it): a backend with no IPC at all, each page a copy in the
worker's own memory (pre-touched), copied with the routine radixkv's backend uses
(bench/_hicache_ceiling.py), driven through the same controller. No backend can pass it through
SGLang's controller on this machine: it pays only the controller's work and the copies. The
controller's own floor (controller_pages_per_s, controller_vs_memcpy): the same backend copying
nothing; a backend reaches a share of memcpy above memcpy_bound_vs_memcpy (a memcpy's time
over the controller's plus the memcpy's) only if its copy is faster than a memcpy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from _common import REPO, emit, engine_python, log, radixkv_server

WORKER = Path(__file__).resolve().parent / "_hicache_worker.py"
PAGE = 16
# (layers, kv heads, head_dim): pages of 16 fp16 tokens of 16 KiB, 128 KiB and 1 MiB
GEOMETRIES = [(2, 2, 64), (8, 4, 64), (16, 8, 128)]
GOALS = ">= 3x the file backend's pages/s both ways; >= 0.5x memcpy for pages >= 64 KiB"


def run_worker(backend: str, geometry: dict[str, Any], batch: int, rounds: int,
               socket: str | None, env: dict[str, str]) -> dict[str, Any]:
    cmd = [engine_python("sglang"), str(WORKER), backend, "page_first", json.dumps(geometry),
           str(batch), str(rounds), *([socket] if socket else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env={**os.environ, "PYTHONPATH": str(REPO), **env})
    if out.returncode:
        raise SystemExit(f"bench worker ({backend}) failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def model_config(path: Path, layers: int, heads: int, dim: int) -> str:
    path.write_text(json.dumps({"num_hidden_layers": layers, "num_attention_heads": heads,
                                "num_key_value_heads": heads, "hidden_size": heads * dim,
                                "torch_dtype": "float16"}))
    return str(path)


def measure(layers: int, heads: int, dim: int, batch: int, rounds: int,
            profile: bool = False) -> list[dict[str, Any]]:
    geometry = {"layers": layers, "heads": heads, "head_dim": dim, "page_size": PAGE,
                "dtype": "float16", "host_pages": 2 * batch + 8}
    with tempfile.TemporaryDirectory(prefix="rkv-hicache-") as d:
        config = model_config(Path(d) / "config.json", layers, heads, dim)
        runs = {}
        # cold: room for every batch, so each one is written into pool memory never touched
        # before (first-touch page faults); warm: room for two batches, so from the third on
        # a batch reuses the blocks of the one before last (evicted), as in a full cache
        # (and cold again with `lookup: match`: batch_exists through a Match, as before the
        # lookup table)
        for name, blocks, lookup in (("cold", batch * (rounds + 1) + 8, "table"),
                                     ("warm", 2 * batch, "table"),
                                     ("match", batch * (rounds + 1) + 8, "match")):
            with radixkv_server(d, "--model-config", config, "--dtype", "fp16",
                                "--block-size", str(PAGE), "--num-blocks",
                                str(blocks)) as socket:
                env = {"RADIXKV_BENCH_LOOKUP": lookup}
                runs[name] = run_worker("radixkv", geometry, batch, rounds, socket,
                                        {"RADIXKV_BENCH_PROFILE": "1", **env} if profile
                                        else env)
        rkv, warm, match = runs["cold"], runs["warm"], runs["match"]
        files = Path(d) / "files"
        files.mkdir()
        fb = run_worker("file", geometry, batch, rounds, None,
                        {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(files)})
        top = run_worker("ceiling", geometry, batch, rounds, None, {})
        floor = run_worker("controller", geometry, batch, rounds, None, {})
    page_bytes = rkv["page_bytes"]
    memcpy = batch / statistics.median(rkv["memcpy_s"])
    rows = []
    for op in ("set", "get"):
        mine = batch / statistics.median(rkv[f"{op}_s"])
        mine_warm = batch / statistics.median(warm[f"{op}_s"][1:])  # from the third batch
        by_match = batch / statistics.median(match[f"{op}_s"])
        theirs = batch / statistics.median(fb[f"{op}_s"])
        ceiling = batch / statistics.median(top[f"{op}_s"])
        bare = batch / statistics.median(floor[f"{op}_s"])
        rows.append({"op": op, "page_bytes": page_bytes, "batch_pages": batch,
                     "radixkv_pages_per_s": round(mine, 1),
                     "file_backend_pages_per_s": round(theirs, 1),
                     "memcpy_pages_per_s": round(memcpy, 1),
                     "vs_file_backend": round(mine / theirs, 2),
                     "vs_memcpy": round(mine / memcpy, 3),
                     "radixkv_warm_pages_per_s": round(mine_warm, 1),
                     "radixkv_match_pages_per_s": round(by_match, 1),
                     "table_vs_match": round(mine / by_match, 2),
                     "vs_file_backend_warm": round(mine_warm / theirs, 2),
                     "vs_memcpy_warm": round(mine_warm / memcpy, 3),
                     "ceiling_pages_per_s": round(ceiling, 1),
                     "ceiling_vs_file_backend": round(ceiling / theirs, 2),
                     "ceiling_vs_memcpy": round(ceiling / memcpy, 3),
                     "vs_ceiling": round(mine / ceiling, 3),
                     "vs_ceiling_warm": round(mine_warm / ceiling, 3),
                     "controller_pages_per_s": round(bare, 1),
                     "controller_vs_memcpy": round(bare / memcpy, 3),
                     # at most this share of memcpy: the controller's time plus a memcpy's
                     "memcpy_bound_vs_memcpy": round(1 / (1 + memcpy / bare), 3),
                     "radixkv_gb_per_s": round(mine * page_bytes / 1e9, 3),
                     "file_backend_gb_per_s": round(theirs * page_bytes / 1e9, 3),
                     **({"profile_cold": rkv["profile"], "profile_warm": warm["profile"]}
                        if profile else {})})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--batch", type=int, default=64, help="pages per batch (default 64)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed batches per backend and page size (default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--profile", action="store_true",
                        help="also time each RPC, copy and backend call of radixkv's batches "
                        "(calls per batch, median ms: profile_cold, profile_warm)")
    args = parser.parse_args(argv)
    rows = []
    for layers, heads, dim in GEOMETRIES:
        log(f"bench: {layers} layers x {heads} kv heads x {dim}, page {PAGE} tokens")
        rows += measure(layers, heads, dim, args.batch, args.rounds, args.profile)
    emit("hicache_bench", {"rows": rows, "goals": GOALS}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
