"""vLLM's time to first token through radixkv, across two vLLM processes, for prompts sharing
0 / 50 / 90 % of their tokens; against no cache, vLLM's own prefix cache and ExampleConnector.

    .venv/bin/python bench/vllm_ttft.py --json    # long on 2 cores: docs/vllm.md says how long
    .venv/bin/python bench/vllm_ttft.py --peer --shares 50,90 --repeat 2 --json
                                    # B on another member than A: peer fetch (bench/_vllm_peer.py)
    .venv/bin/python bench/vllm_ttft.py --lmcache --shares 50,90 --json
                                    # beside LMCache's own server (bench/_vllm_lmcache.py)

The engines are vLLM (CPU, `vllm.LLM`) processes of radixkv.integrations.vllm.driver, run with
.venv-vllm's python (`scripts/bootstrap_vllm` runs first if that venv is missing), on SmolLM2
(bf16, block size 128), all pinned to one CPU (`--cpu`) and timed one at a time; prompts are
slices of English prose (the pydoc corpus). TTFT is vLLM's own per-request metric (arrival to
first token). For each share and repeat, with a fresh shared prefix P and fresh suffixes sA, sB,
sC (prompts of `--prompt-tokens`):

    A   radixkv connector        P+sA, stored in radixkv at its end (all of A's prompts first,
                                 then A exits)
    B   radixkv connector        P+sB: loads P's whole blocks that A stored  -> TTFT radixkv
    N   no connector, vLLM's     P+sC (N never saw P)                        -> TTFT no cache
        prefix cache on          P+sB: P's blocks from N's own prefix cache  -> TTFT vLLM cache
    E   ExampleConnector         P+sA (stored on disk, untimed; `sync`), P+sB -> TTFT Example
        (vLLM's disk connector)  (it keys a whole prompt: a shared prefix is a miss, its hit
                                 tokens show it), then P+sA again           -> its hit, for scale

A, B and E run without vLLM's own prefix cache. The connector's own cost is read from B's
`stats_file` (radixkv.integrations.vllm): the lookup (the scheduler's read of radixkv's lookup
table and the worker's pin, or with `--lookup match` the scheduler's Match; the scheduler's part
alone is `scheduler_us_p50` / `_p99`) plus the time the engine's thread waits for the load (copy
into vLLM's pages and Release), as a share of B's TTFT (`connector_share`). E runs
ExampleConnector timed (bench/_vllm_timed_example.py): its lookup, the files it loads before the
forward and the files it writes during it (it stores a prompt inside the forward), so the two
connectors' own costs compare (`connector_vs_example_connector`) without the prefill's run-to-
run spread, which at 0 % shared is all the TTFT ratio shows. Loads are copied layer by layer on
a thread beside the forward (on the CPUs the engines are not pinned to, `--load-cpus`), whose
own CPU time gives `connector_cpu_share`; `--whole-loads` copies them before the forward
instead. Storing (Match with allocation, copy, Insert) runs after the first token and is
reported apart. Greedy outputs (`--max-tokens`) are compared with E's run of P+sB, a full
prefill where E missed (`outputs_identical`), and with vLLM's own prefix cache on the same
prompt (`outputs_identical_to_vllm_prefix_cache`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import emit, engine_python, log, radixkv_server

BLOCK = 128  # vLLM's CPU block size; radixkv serves the same
GOALS = "90 % shared: <= 0.25x no cache and <= 1.15x vLLM's prefix cache; 50 %: < no cache; " \
        "connector <= 5 % of TTFT; faster than ExampleConnector at every share (TTFT, and the " \
        "connector's own cost); the connector's time on vLLM's scheduler thread <= 100 us p99"


class Stats:
    """A connector's stats file (JSON lines), read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.loader_cpus: list[Any] = []  # the loader thread's CPUs, as the loads report them

    def new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            text = f.read()
        end = text.rfind("\n") + 1  # whole lines only
        self.offset += len(text[:end].encode())
        lines = [json.loads(line) for line in text[:end].splitlines() if line]
        for x in lines:
            if "loader_cpus" in x and x["loader_cpus"] not in self.loader_cpus:
                self.loader_cpus.append(x["loader_cpus"])
        return lines

    def until_saved(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The new lines, once the request's store has run (a "save" line, or a store Match
        with nothing new), at most `timeout` s."""
        lines: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines += self.new()
            if any(x["op"] == "save" or (x["op"] in ("store_match", "store_peek")
                                         and x["new_blocks"] <= 0) for x in lines):
                break
            time.sleep(0.02)
        return lines


def prose(model: str) -> list[int]:
    """English prose as the model's token ids (the pydoc corpus, radixkv.engines.corpus)."""
    from transformers import AutoTokenizer

    from radixkv.engines import corpus

    return corpus.tokens(AutoTokenizer.from_pretrained(model))


def ttft(answer: dict[str, Any]) -> float:
    """vLLM's TTFT of the one request, else the call's wall time (seconds)."""
    value = answer["ttft"][0]
    return float(value if value is not None else answer["s"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    from radixkv.engines import models
    from radixkv.integrations.vllm.driver import Driver

    python = engine_python("vllm")
    model = str(models.ensure_converted(models.get_spec(models.REAL_MODEL))[0])
    rng = random.Random(args.seed)
    n = args.prompt_tokens
    shares = [int(s) for s in args.shares.split(",")]

    source = prose(model)

    def text(count: int) -> list[int]:
        start = rng.randrange(len(source) - count)
        return source[start:start + count]

    # (share, P+sA, P+sB, P+sC) per repeat; the first is a warm-up (not reported)
    cases: list[tuple[int, list[int], list[int], list[int]]] = []
    for share in [shares[-1]] + [s for s in shares for _ in range(args.repeat)]:
        prefix, rest = text(n * share // 100), n - n * share // 100
        pa, pb, pc = (prefix + text(rest) for _ in range(3))
        cases.append((share, pa, pb, pc))
    per_prompt = (n + args.max_tokens) // BLOCK + 1
    num_blocks = 2 * per_prompt * len(cases) + 16  # A's and B's, none evicted
    logs = Path(args.logs) if args.logs else None
    with tempfile.TemporaryDirectory(prefix="rkv-vllm-bench-") as directory:
        work = Path(directory)
        logs = logs or work
        logs.mkdir(parents=True, exist_ok=True)
        flags = ["--model-config", f"{model}/config.json", "--dtype", "bf16",
                 "--block-size", str(BLOCK), "--num-blocks", str(num_blocks)]

        def radixkv(sock: str, name: str) -> dict[str, Any]:
            return {"kv_connector": "RadixKVConnector",
                    "kv_connector_module_path": "radixkv.integrations.vllm",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"socket": sock,
                                                  "stats_file": str(work / name),
                                                  "layerwise": not args.whole_loads,
                                                  "load_cpus": args.load_cpus,
                                                  "lookup": args.lookup}}

        def engine(name: str, connector: dict[str, Any] | None, *extra: str,
                   venv: str = python) -> Driver:
            t0 = time.perf_counter()
            d = Driver(venv, model, logs / f"{name}.log", connector, args.cpu,
                       ("--max-model-len", str(n + 512), *extra))
            log(f"bench: engine {name} up in {time.perf_counter() - t0:.0f} s")
            return d

        def store_on_a(sock: str) -> None:
            a = engine("A", radixkv(sock, "a.jsonl"), "--no-prefix-cache")
            try:
                a_stats = Stats(work / "a.jsonl")
                for _, pa, _, _ in cases:
                    a.generate(pa, max_tokens=args.max_tokens)
                    a_stats.until_saved()
            finally:
                a.close()

        b_stats = Stats(work / "b.jsonl")
        engines: list[Driver] = []
        if args.peer:
            from _vllm_peer import measure_peer, two_members

            with two_members(directory, *flags) as (sock_a, sock_b):
                store_on_a(sock_a)
                try:
                    b = engine("B", radixkv(sock_b, "b.jsonl"), "--no-prefix-cache")
                    engines.append(b)
                    nc = engine("N", None)
                    engines.append(nc)
                    rows = measure_peer(args, shares, cases, b, nc, sock_b, text, ttft)
                finally:
                    for d in engines:
                        d.close()
            return {"mode": "peer", "model": models.REAL_MODEL, "prompt_tokens": n,
                    "block_size": BLOCK, "repeat": args.repeat, "max_tokens": args.max_tokens,
                    "cpu": args.cpu, "load_average": os.getloadavg(), "seed": args.seed,
                    "rows": rows, "goals": peer_goals(rows), "goal_text": PEER_GOALS}
        if args.lmcache:
            from _vllm_lmcache import (
                CHUNK,
                LMCACHE_GOALS,
                lmcache_connector,
                lmcache_goals,
                lmcache_server,
                measure_lmcache,
            )

            lm, server_log = engine_python("lmcache"), logs / "lmcache-server.log"
            with radixkv_server(directory, *flags) as sock, \
                    lmcache_server(lm, server_log) as ports:
                store_on_a(sock)
                la = engine("LA", lmcache_connector(ports["port"]), "--no-prefix-cache", venv=lm)
                try:
                    for _, pa, _, _ in cases:
                        la.generate(pa, max_tokens=args.max_tokens)
                    time.sleep(2)  # its last stores reach the server
                finally:
                    la.close()
                try:
                    b = engine("B", radixkv(sock, "b.jsonl"), "--no-prefix-cache")
                    engines.append(b)
                    lb = engine("LB", lmcache_connector(ports["port"]), "--no-prefix-cache",
                                venv=lm)
                    engines.append(lb)
                    nc = engine("N", None)
                    engines.append(nc)
                    rows = measure_lmcache(args, shares, cases, (b, lb, nc), b_stats, server_log,
                                           text, ttft)
                finally:
                    for d in engines:
                        d.close()
            return {"mode": "lmcache", "model": models.REAL_MODEL, "prompt_tokens": n,
                    "block_size": BLOCK, "lmcache_chunk_size": CHUNK, "lmcache": "0.5.6",
                    "repeat": args.repeat, "max_tokens": args.max_tokens, "cpu": args.cpu,
                    "load_average": os.getloadavg(), "seed": args.seed, "rows": rows,
                    "goals": lmcache_goals(rows),
                    "goal_text": LMCACHE_GOALS}
        with radixkv_server(directory, *flags) as sock:
            store_on_a(sock)
            try:
                b = engine("B", radixkv(sock, "b.jsonl"), "--no-prefix-cache")
                engines.append(b)
                nc = engine("N", None)
                engines.append(nc)
                example = {"kv_connector": "TimedExampleConnector",
                           "kv_connector_module_path": "bench._vllm_timed_example",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {
                               "shared_storage_path": str(work / "example"),
                               "stats_file": str(work / "e.jsonl")}}
                e = engine("E", example, "--no-prefix-cache")
                engines.append(e)
                rows = measure(args, shares, cases, b, nc, e, b_stats, Stats(work / "e.jsonl"),
                               text)
            finally:
                for d in engines:
                    d.close()
    return {"model": models.REAL_MODEL, "prompt_tokens": n, "block_size": BLOCK,
            "repeat": args.repeat, "max_tokens": args.max_tokens, "cpu": args.cpu,
            "loads": "whole" if args.whole_loads else "layerwise", "load_cpus": args.load_cpus,
            "lookup": args.lookup,
            "load_average": os.getloadavg(), "loader_cpus_seen": b_stats.loader_cpus,
            "seed": args.seed, "rows": rows, "goals": goals(rows), "goal_text": GOALS}


def measure(args: argparse.Namespace, shares: list[int],
            cases: list[tuple[int, list[int], list[int], list[int]]], b: Any, nc: Any, e: Any,
            b_stats: Stats, e_stats: Stats, text: Any) -> list[dict[str, Any]]:
    """Each timed request comes right after a short one on the same engine (32 fresh tokens,
    untimed), and B and N take turns to go first: the engines share one CPU, and the first
    engine timed after the previous repeat measured 5-15 % slower on the same work."""
    mt = args.max_tokens
    keys = ("radixkv", "no_cache", "vllm_prefix_cache", "example", "example_same_prompt",
            "match", "scheduler", "load", "load_cpu", "load_copy", "store", "prefill_radixkv",
            "prefill_vllm_prefix_cache", "example_own", "example_save", "example_hit_load")
    t: dict[int, dict[str, list[float]]] = {s: {k: [] for k in keys} for s in shares}
    same: dict[int, list[bool]] = {s: [] for s in shares}
    hits: dict[int, dict[str, list[int]]] = {s: {"radixkv": [], "pc": [], "example": []}
                                             for s in shares}

    def timed(engine: Any, prompt: list[int]) -> dict[str, Any]:
        engine.generate(text(32), max_tokens=1)
        if engine is e:
            e_stats.new()  # not the short request's (ExampleConnector stores it too)
        return dict(engine.generate(prompt, max_tokens=mt))

    def example_cost(lines: list[dict[str, Any]]) -> tuple[float, float, float]:
        """ExampleConnector's own time on one request: (all, writing files, loading files)."""
        match = sum(x["s"] for x in lines if x["op"] == "match")
        save = sum(x["save_s"] for x in lines if x["op"] == "step")
        load = sum(x["load_s"] for x in lines if x["op"] == "step")
        return match + save + load, save, load

    for i, (share, pa, pb, pc) in enumerate(cases):
        if i % 2:  # B first in every other repeat: whichever engine runs first runs slower
            rb = timed(b, pb)  # radixkv: P's blocks from A
            lines = b_stats.until_saved()
        rn = timed(nc, pc)  # no cache: N never saw P
        rp = timed(nc, pb)  # vLLM's prefix cache: P from P+sC
        if not i % 2:
            rb = timed(b, pb)
            lines = b_stats.until_saved()
        e.generate(pa, max_tokens=mt)  # ExampleConnector stores P+sA on disk
        os.sync()  # its files written back now, not during the next timed request
        re_ = timed(e, pb)  # ExampleConnector: a miss unless P covers its whole-prompt key
        e_own, e_save, _ = example_cost(e_stats.new())
        rs = e.generate(pa, max_tokens=mt)  # ExampleConnector on the prompt it stored
        _, _, e_hit_load = example_cost(e_stats.new())
        os.sync()
        log(f"bench: {share}% shared{' (warm-up)' if i == 0 else ''}: radixkv "
            f"{ttft(rb) * 1e3:.0f} ms (hit {rb['cached'][0]}), no cache {ttft(rn) * 1e3:.0f}, "
            f"vLLM cache {ttft(rp) * 1e3:.0f} (hit {rp['cached'][0]}), Example "
            f"{ttft(re_) * 1e3:.0f} (hit {re_['cached'][0]})")
        if i == 0:
            continue
        row = t[share]
        for key, answer in (("radixkv", rb), ("no_cache", rn), ("vllm_prefix_cache", rp),
                            ("example", re_), ("example_same_prompt", rs)):
            row[key].append(ttft(answer))
        row["prefill_radixkv"].append(rb["prefill"][0] or 0.0)
        row["prefill_vllm_prefix_cache"].append(rp["prefill"][0] or 0.0)
        # the lookup (the scheduler's table read, or its Match) and the worker's pin
        row["match"].append(sum(x["s"] for x in lines if x["op"] in ("match", "peek", "pin")))
        row["scheduler"] += [x["s"] for x in lines if x["op"] in ("match", "peek")
                             and x.get("side") == "scheduler"]
        loads = [x for x in lines if x["op"] == "load"]
        row["load"].append(sum(x["s"] for x in loads))  # the engine's thread waiting
        # the copy's own time (layer-wise: on the loader thread, beside the forward)
        row["load_cpu"].append(sum(x.get("cpu_s", x["s"]) for x in loads))
        row["load_copy"].append(sum(x.get("copy_s", x["s"]) for x in loads))
        row["store"].append(sum(x["s"] for x in lines if x["op"] in ("store_match", "save")))
        row["example_own"].append(e_own)
        row["example_save"].append(e_save)
        row["example_hit_load"].append(e_hit_load)
        # the reference: ExampleConnector's run of P+sB, computed in full unless it hit
        same[share] += [rb["outputs"] == re_["outputs"], rp["outputs"] == re_["outputs"],
                        rb["outputs"] == rp["outputs"]]
        for key, answer in (("radixkv", rb), ("pc", rp), ("example", re_)):
            hits[share][key].append(answer["cached"][0])
    return [row_of(args, share, t[share], same[share], hits[share]) for share in shares]


def row_of(args: argparse.Namespace, share: int, t: dict[str, list[float]], same: list[bool],
           hits: dict[str, list[int]]) -> dict[str, Any]:
    med, ratio = median_ms(t), ratio_of(t)
    own = [m + ld for m, ld in zip(t["match"], t["load"], strict=True)]  # radixkv's connector
    shares_of_ttft = [o / r for o, r in zip(own, t["radixkv"], strict=True)]
    cpu_shares = [(m + ld) / r for m, ld, r in zip(t["match"], t["load_cpu"], t["radixkv"],
                                                   strict=True)]
    return {
        "shared_pct": share, "shared_tokens": args.prompt_tokens * share // 100,
        "radixkv_hit_tokens": min(hits["radixkv"]),
        "vllm_prefix_cache_hit_tokens": min(hits["pc"]),
        "example_connector_hit_tokens": max(hits["example"]),
        "ttft_radixkv_ms": med("radixkv"), "ttft_no_cache_ms": med("no_cache"),
        "ttft_vllm_prefix_cache_ms": med("vllm_prefix_cache"),
        "ttft_example_connector_ms": med("example"),
        "ttft_example_connector_same_prompt_ms": med("example_same_prompt"),
        "ratio_vs_no_cache": ratio("no_cache"),
        "ratio_vs_vllm_prefix_cache": ratio("vllm_prefix_cache"),
        "ratio_vs_example_connector": ratio("example"),
        # the load as the engine's thread sees it (its waits for the copy), and the copy's own
        # wall and CPU time (layer-wise loads copy on a thread beside the forward)
        "match_ms": med("match"), "load_wait_ms": med("load"), "load_copy_ms": med("load_copy"),
        # the connector's time on vLLM's scheduler thread per new request (its lookup)
        "scheduler_us_p50": statistics.median(t["scheduler"]) * 1e6,
        "scheduler_us_p99": float(np.percentile(t["scheduler"], 99)) * 1e6,
        "load_cpu_ms": med("load_cpu"),
        "connector_share": statistics.median(shares_of_ttft),
        "connector_cpu_share": statistics.median(cpu_shares),
        "store_after_first_token_ms": med("store"),
        # ExampleConnector's own time on the same prompt (lookup, files loaded before the
        # forward, every layer written to files during it), against radixkv's (Match + wait)
        "connector_ms": statistics.median(own) * 1e3,
        "example_connector_ms": med("example_own"),
        "example_connector_save_ms": med("example_save"),
        "example_connector_share": statistics.median(
            x / y for x, y in zip(t["example_own"], t["example"], strict=True)),
        "connector_vs_example_connector": statistics.median(
            x / y for x, y in zip(own, t["example_own"], strict=True)),
        "example_connector_hit_load_ms": med("example_hit_load"),
        # vLLM's scheduled -> first token (the worker's load, the forward, sampling)
        "prefill_radixkv_ms": med("prefill_radixkv"),
        "prefill_vllm_prefix_cache_ms": med("prefill_vllm_prefix_cache"),
        "outputs_identical": all(same[0::3]),
        "vllm_prefix_cache_outputs_identical": all(same[1::3]),
        "outputs_identical_to_vllm_prefix_cache": all(same[2::3]),
        "ttft_radixkv_each_ms": [x * 1e3 for x in t["radixkv"]],
        "ttft_no_cache_each_ms": [x * 1e3 for x in t["no_cache"]],
        "ttft_vllm_prefix_cache_each_ms": [x * 1e3 for x in t["vllm_prefix_cache"]]}


def median_ms(t: dict[str, list[float]]) -> Any:
    return lambda key: statistics.median(t[key]) * 1e3


def ratio_of(t: dict[str, list[float]]) -> Any:
    """Median over repeats of radixkv's TTFT over another's (measured back to back)."""
    return lambda key: statistics.median(
        x / y for x, y in zip(t["radixkv"], t[key], strict=True))


PEER_GOALS = "90 % shared, B's prefix fetched from A's member: <= 0.3x no cache; outputs " \
    "identical to vLLM's prefix cache"


def peer_goals(rows: list[dict[str, Any]]) -> dict[str, bool]:
    by = {r["shared_pct"]: r for r in rows}
    out: dict[str, bool] = {}
    if 90 in by:
        out["90pct_ratio_vs_no_cache<=0.3"] = by[90]["ratio_vs_no_cache"] <= 0.3
    out["outputs_identical_to_vllm_prefix_cache"] = all(
        r["outputs_identical_to_vllm_prefix_cache"] for r in rows)
    return out


def goals(rows: list[dict[str, Any]]) -> dict[str, bool]:
    by = {r["shared_pct"]: r for r in rows}
    out: dict[str, bool] = {}
    if 90 in by:
        out["90pct_ratio_vs_no_cache<=0.25"] = by[90]["ratio_vs_no_cache"] <= 0.25
        out["90pct_ratio_vs_vllm_prefix_cache<=1.15"] = \
            by[90]["ratio_vs_vllm_prefix_cache"] <= 1.15
    if 50 in by:
        out["50pct_below_no_cache"] = by[50]["ratio_vs_no_cache"] < 0.9
    out["connector_share<=0.05"] = all(r["connector_share"] <= 0.05 for r in rows)
    out["faster_than_example_connector"] = all(r["ratio_vs_example_connector"] < 1
                                               for r in rows)
    out["connector_cheaper_than_example_connector"] = all(
        r["connector_vs_example_connector"] < 1 for r in rows)
    out["outputs_identical"] = all(r["outputs_identical"] for r in rows)
    out["scheduler_us_p99<=100"] = all(r["scheduler_us_p99"] <= 100 for r in rows)
    out["outputs_identical_to_vllm_prefix_cache"] = all(
        r["outputs_identical_to_vllm_prefix_cache"] for r in rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens per prompt")
    p.add_argument("--shares", default="0,50,90", help="shared prefix, %% of the prompt")
    p.add_argument("--repeat", type=int, default=3,
                   help="measured prompts per share (after one warm-up prompt)")
    p.add_argument("--max-tokens", type=int, default=8,
                   help="greedy tokens per request (compared for outputs_identical)")
    p.add_argument("--cpu", default="0", help="the CPU(s) every vLLM engine is pinned to "
                   "(VLLM_CPU_OMP_THREADS_BIND)")
    p.add_argument("--load-cpus", default="auto", help="the connector's loader thread's CPUs "
                   "(its load_cpus: 'auto', those the engines are not pinned to; 'engine'; "
                   "or a list such as '1')")
    p.add_argument("--whole-loads", action="store_true", help="copy loads whole before the "
                   "forward (the connector's layerwise false) instead of layer by layer")
    p.add_argument("--lookup", choices=("table", "match"), default="table",
                   help="how the connector's scheduler side looks a prompt up: radixkv's "
                   "lookup table in shared memory (table, the default; the worker pins), or a "
                   "Match on the scheduler thread (match: the path before the table)")
    p.add_argument("--peer", action="store_true", help="B's member is another than A's: two "
                   "members (etcd, TCP with a token, serve --peer-fetch), B's prefix comes by "
                   "peer fetch; no ExampleConnector (bench/_vllm_peer.py)")
    p.add_argument("--lmcache", action="store_true", help="beside radixkv, the same two-instance "
                   "run with LMCache's own server (`lmcache server`, LMCacheMPConnector; "
                   ".venv-lmcache from scripts/bootstrap_lmcache), interleaved; no "
                   "ExampleConnector (bench/_vllm_lmcache.py)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts' token ids")
    p.add_argument("--logs", default=None, help="keep the engines' logs in this folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    t0 = time.perf_counter()
    report = run(args)
    report["wall_s"] = time.perf_counter() - t0
    if args.json:
        emit("vllm_ttft", report, True)
        return
    rows = report["rows"]
    keys: tuple[str, ...] = (
        "ratio_vs_no_cache", "ratio_vs_vllm_prefix_cache", "ratio_vs_example_connector",
        "connector_share", "connector_vs_example_connector", "ttft_radixkv_ms",
        "ttft_no_cache_ms", "outputs_identical")
    if args.lmcache:
        keys = ("ratio_radixkv_vs_lmcache", "radixkv_hit_tokens", "lmcache_hit_tokens",
                "ttft_radixkv_ms", "ttft_lmcache_ms", "outputs_identical_to_vllm_prefix_cache",
                "outputs_identical_lmcache")
    elif args.peer:
        keys = ("ratio_vs_no_cache", "ratio_vs_vllm_prefix_cache", "peer_fetch_ms",
                "ttft_peer_ms", "ttft_no_cache_ms", "outputs_identical_to_vllm_prefix_cache")
    emit("vllm_ttft", {k: {r["shared_pct"]: r[k] for r in rows} for k in keys}, False)


if __name__ == "__main__":
    main()
