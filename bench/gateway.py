"""Routing one multi-turn chat workload over two real vLLM servers: radixkv's gateway against
vllm-router's cache_aware, kv_aware (fed by radixkv's KV events) and round_robin policies.

    .venv/bin/python bench/gateway.py --json                 # ~10 min on 2 cores
    .venv/bin/python bench/gateway.py --groups 1 --turns 1 --policies radixkv,round-robin

vLLM's OpenAI server A on CPU 0 and B on CPU 1 (SmolLM2-135M, bf16, block size 128, its prefix
cache on, radixkv's connector kv_both on members n0 / n1 of one etcd cluster); the engines' KV
and the members' pools hold `--capacity` of the workload's distinct prompt blocks. Before each
policy the prefix caches are reset, the members cleared and the front end started afresh:
`radixkv gateway`, or vllm-router (.venv-router) cache_aware, kv_aware (the members' events
through loopback forwarders) or round_robin. `--groups` system prompts of 500-700 tokens,
`--convs` conversations each, `--turns` user turns of 30-60 tokens with the answers streamed
back; turn t of all (in a seeded order) before turn t+1, `--concurrency` in flight. TTFT: to
the first content chunk; cached tokens: vllm:prefix_cache_hits_total (vLLM's own) and
vllm:external_prefix_cache_hits_total (radixkv's), summed over the engines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import REPO, emit, engine_python, log, percentile

sys.path.insert(0, str(REPO / "tests"))  # the gateway and forwarder launchers of the tests
from _forwarder import DIRECT, Forwarder, healthy  # noqa: E402
from _gateway import gateway, wait_ready  # noqa: E402

from radixkv.client import Client  # noqa: E402
from radixkv.cluster.local import free_port  # noqa: E402
from radixkv.protocol.errors import RadixKVError  # noqa: E402

BLOCK = 128
POLICIES = ("radixkv", "vllm-router-cache-aware", "vllm-router-kv-aware", "round-robin")
METRICS = ("prefix_cache_hits_total", "external_prefix_cache_hits_total",
           "prompt_tokens_total", "request_success_total")
GOAL_TEXT = ("radixkv's cached tokens >= vllm-router cache_aware's and >= 1.5x round-robin's; "
             "its TTFT p90 <= 0.9x cache_aware's; kv_aware's cached tokens >= cache_aware's")
ROUTER = REPO / ".venv-router" / "bin" / "vllm-router"


@dataclass
class Conversation:
    system: str
    questions: list[str]
    messages: list[dict[str, str]] = field(default_factory=list)

    def fresh(self) -> Conversation:  # before the first turn
        return Conversation(self.system, self.questions,
                            [{"role": "system", "content": self.system}])


def workload(tokenizer: Any, args: argparse.Namespace) -> list[Conversation]:
    """`args.groups` x `args.convs` conversations, groups interleaved."""
    from radixkv.engines import corpus

    rng = random.Random(args.seed)
    ids = corpus.tokens(tokenizer)

    def prose(n: int) -> str:
        start = rng.randrange(len(ids) - n)
        return str(tokenizer.decode(ids[start:start + n])).strip()

    systems = [f"You are assistant {g} of the documentation desk. Answer from these notes.\n\n"
               + prose(rng.randint(500, 700)) for g in range(args.groups)]
    convs = [[Conversation(systems[g], [f"Question {t + 1} ({g}.{c}): explain this. "
                                        + prose(rng.randint(30, 60))
                                        for t in range(args.turns)])
              for c in range(args.convs)] for g in range(args.groups)]
    return [convs[g][c] for c in range(args.convs) for g in range(args.groups)]


def working_set(tokenizer: Any, convs: list[Conversation], max_tokens: int) -> tuple[int, int]:
    """The whole blocks of every prompt (answers: `max_tokens` placeholder tokens), a prefix
    shared by several counted once; the longest prompt."""
    prompts = []
    for conv in convs:
        messages = conv.fresh().messages
        for q in conv.questions:
            ids = tokenizer.apply_chat_template([*messages, {"role": "user", "content": q}],
                                                add_generation_prompt=True, tokenize=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
            messages += [{"role": "user", "content": q},
                         {"role": "assistant", "content": " word" * max_tokens}]
    blocks = {hash(tuple(p[:k * BLOCK])) for p in prompts for k in range(1, len(p) // BLOCK + 1)}
    return len(blocks), max(map(len, prompts))


@dataclass
class Engine:
    name: str  # the member's node id
    url: str
    proc: subprocess.Popen[bytes]
    socket: str
    events: tuple[str, str]  # where vllm-router subscribes, where it asks for a replay


def start_vllm(model: str, cpu: int, socket: str, blocks: int, max_len: int,
               log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """vLLM's OpenAI server on CPU `cpu` with the connector on `socket`, in its own group."""
    port = free_port()
    connector = {"kv_connector": "RadixKVConnector",
                 "kv_connector_module_path": "radixkv.integrations.vllm", "kv_role": "kv_both",
                 "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"socket": socket, "retry_s": 0.5}}
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND=str(cpu), VLLM_SERVER_DEV_MODE="1",
               PYTHONPATH=str(REPO))
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [engine_python("vllm"), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
             "--enforce-eager", "--max-model-len", str(max_len), "--block-size", str(BLOCK),
             "--num-gpu-blocks-override", str(blocks), "--kv-transfer-config",
             json.dumps(connector)], stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def stop_group(proc: subprocess.Popen[Any], timeout: float = 60.0) -> None:
    """SIGTERM the process group `proc` leads; SIGKILL what is left after `timeout`."""
    with contextlib.suppress(ProcessLookupError):  # the group: the engine core too
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen[Any], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up (exit {proc.poll()})")
        time.sleep(1)


@contextlib.contextmanager
def engines(model: str, blocks: int, max_len: int,
            work: Path) -> Iterator[tuple[Any, list[Engine]]]:
    """etcd, members n0 / n1 (KV events into a forwarder each) and vLLM servers A / B."""
    from radixkv.cluster.local import local_cluster

    flags = ("--model-config", f"{model}/config.json", "--dtype", "bf16", "--block-size",
             str(BLOCK), "--num-blocks", str(blocks), "--log-level", "warning")
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(local_cluster(0, *flags, router=False))
        out = []
        for cpu, name in enumerate(("n0", "n1")):
            forwarder = Forwarder()
            stack.callback(forwarder.close)
            replay = f"tcp://127.0.0.1:{free_port()}"
            member = cluster.start_member(name, "--kv-events-endpoint", forwarder.inbound,
                                          "--kv-events-replay-endpoint", replay)
            proc, url = start_vllm(model, cpu, member.socket, blocks, max_len,
                                   work / f"vllm-{name}.log")
            stack.callback(stop_group, proc)
            out.append(Engine(name, url, proc, member.socket, (forwarder.outbound, replay)))
        t0 = time.monotonic()
        for e in out:
            wait_healthy(e.url, e.proc, f"vLLM {e.name} (log {work}/vllm-{e.name}.log)", 900)
        log(f"bench: both vLLM servers up in {time.monotonic() - t0:.0f} s")
        yield cluster, out


@contextlib.contextmanager
def front(policy: str, model: str, cluster: Any, pair: list[Engine],
          work: Path) -> Iterator[str]:
    """The policy's front end (the gateway or a vllm-router); yields its URL, SIGTERMs it."""
    if policy == "radixkv":
        with gateway(model, "--cluster", cluster.etcd.url,
                     *[f"--engine={e.url}={e.name}" for e in pair]) as g:
            wait_ready(g.url, len(pair), 60)
            yield g.url
        return
    port = free_port()
    args = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--prometheus-host",
            "127.0.0.1", "--prometheus-port", str(free_port()), "--worker-urls",
            *[e.url for e in pair], "--worker-startup-check-interval", "1", "--log-level",
            "warning", "--policy", policy.removeprefix("vllm-router-").replace("-", "_")]
    if policy == "vllm-router-kv-aware":
        args += ["--kv-event-model", model, "--kv-event-block-size", str(BLOCK)]
        for e in pair:
            args += ["--kv-event-source", f"{e.url}={e.events[0]}",
                     "--kv-event-replay-source", f"{e.url}={e.events[1]}"]
    with open(work / f"router-{policy}.log", "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, f"vllm-router {policy}", 120)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(proc, 15)


def counters(url: str) -> dict[str, float]:
    """The METRICS of one vLLM server, each summed over its label sets."""
    with DIRECT.open(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r"^vllm:(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M)
    return {k: sum(float(v) for name, v in found if name == k) for k in METRICS}


def reset(pair: list[Engine]) -> None:
    """Empty vLLM's prefix caches and the members' namespaces (retried while leases drain)."""
    deadline = time.monotonic() + 60
    for e in pair:
        req = urllib.request.Request(e.url + "/reset_prefix_cache", b"", method="POST")
        with Client(e.socket) as kv:
            while True:
                with contextlib.suppress(RadixKVError):
                    if json.loads(DIRECT.open(req, timeout=30).read() or b"{}").get("success", 1):
                        for ns in [n["namespace"] for n in kv.stats()["namespaces"]]:
                            kv.clear(ns)
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{e.name}: vLLM's prefix cache or the member not reset")
                time.sleep(0.5)


async def ask(session: Any, url: str, model: str, messages: list[dict[str, str]],
              max_tokens: int) -> tuple[bool, float, str]:
    """One streamed chat completion: the time to its first content chunk and its whole text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    ttft, parts = None, []
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                log(f"bench: HTTP {resp.status}: {(await resp.text())[:300]}")
                return False, time.perf_counter() - t0, ""
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                for choice in json.loads(line[5:]).get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        parts.append(content)
    except (TimeoutError, OSError, ValueError) as e:
        log(f"bench: request failed: {e!r}")
        return False, time.perf_counter() - t0, ""
    return True, time.perf_counter() - t0 if ttft is None else ttft, "".join(parts)


async def drive(url: str, model: str, convs: list[Conversation],
                args: argparse.Namespace) -> list[tuple[bool, float, str]]:
    """Every turn of every conversation, turn by turn, `args.concurrency` in flight."""
    import aiohttp

    gate = asyncio.Semaphore(args.concurrency)
    answers: list[tuple[bool, float, str]] = []

    async def turn(session: Any, conv: Conversation, t: int) -> tuple[bool, float, str]:
        async with gate:
            conv.messages.append({"role": "user", "content": conv.questions[t]})
            a = await ask(session, url, model, list(conv.messages), args.max_tokens)
            conv.messages.append({"role": "assistant", "content": a[2]})
            return a

    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for t in range(args.turns):  # all of turn t, in a seeded order, before turn t + 1
            batch = random.Random(args.seed * 1000 + t).sample(convs, len(convs))
            answers += await asyncio.gather(*(turn(session, c, t) for c in batch))
    return answers


def run_policy(policy: str, ctx: tuple[str, Any, list[Engine], Path],
               convs: list[Conversation], args: argparse.Namespace) -> dict[str, Any]:
    """Reset, start the policy's front end, drive the workload; the counters' deltas."""
    model, cluster, pair, work = ctx
    reset(pair)
    runs = [c.fresh() for c in convs]
    with front(policy, model, cluster, pair, work) as url:
        before = [counters(e.url) for e in pair]
        t0 = time.perf_counter()
        answers = asyncio.run(drive(url, model, runs, args))
        wall = time.perf_counter() - t0
        time.sleep(1.0)  # the last requests' counters
        after = [counters(e.url) for e in pair]
    delta = [{k: a[k] - b[k] for k in METRICS} for a, b in zip(after, before, strict=True)]
    vllm_hits, radixkv_hits = (sum(d[k] for d in delta) for k in METRICS[:2])
    ttfts = [ttft for ok, ttft, _ in answers if ok]
    row = {"policy": policy, "requests": len(answers), "failed": len(answers) - len(ttfts),
           "cached_prompt_tokens": int(vllm_hits + radixkv_hits),
           "vllm_cached_tokens": int(vllm_hits), "radixkv_cached_tokens": int(radixkv_hits),
           "prompt_tokens": int(sum(d["prompt_tokens_total"] for d in delta)),
           "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p90_ms": percentile(ttfts, 90) * 1e3,
           "ttft_s": ttfts, "wall_s": wall,
           "requests_per_engine": {e.name: int(d["request_success_total"])
                                   for e, d in zip(pair, delta, strict=True)}}
    log(f"bench: {policy}: " + json.dumps({k: v for k, v in row.items() if k != "ttft_s"}))
    return row


def merge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's rounds as one row: sums, TTFT percentiles over every request."""
    ttfts = [t for r in rows for t in r["ttft_s"]]
    summed = ("requests", "failed", "cached_prompt_tokens", "vllm_cached_tokens",
              "radixkv_cached_tokens", "prompt_tokens", "wall_s")
    out = {"policy": rows[0]["policy"], "rounds": len(rows),
           **{k: sum(r[k] for r in rows) for k in summed}}
    return {**out, "hit_rate": out["cached_prompt_tokens"] / max(out["prompt_tokens"], 1),
            "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p90_ms": percentile(ttfts, 90) * 1e3,
            "requests_per_engine": {k: sum(r["requests_per_engine"][k] for r in rows)
                                    for k in rows[0]["requests_per_engine"]}}


def goals(rows: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """The goals whose policies both ran (GOAL_TEXT)."""
    hit = {p: r["cached_prompt_tokens"] for p, r in rows.items()}
    p90 = {p: r["ttft_p90_ms"] for p, r in rows.items()}
    ours, ca, kv, rr = POLICIES
    checks: dict[str, tuple[str, str, Callable[[], bool]]] = {
        "hits_vs_cache_aware": (ours, ca, lambda: hit[ours] >= hit[ca]),
        "hits_vs_round_robin": (ours, rr, lambda: hit[ours] >= 1.5 * hit[rr]),
        "ttft_p90_vs_cache_aware": (ours, ca, lambda: p90[ours] <= 0.9 * p90[ca]),
        "kv_aware_vs_cache_aware": (kv, ca, lambda: hit[kv] >= hit[ca])}
    return {k: f() for k, (a, b, f) in checks.items() if a in rows and b in rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from radixkv.engines import models

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if set(policies) - set(POLICIES):
        raise SystemExit(f"bench: --policies: a subset of {POLICIES}")
    model = str(models.ensure_converted(models.get_spec(models.REAL_MODEL))[0])
    tokenizer = AutoTokenizer.from_pretrained(model)
    convs = workload(tokenizer, args)
    working, longest = working_set(tokenizer, convs, args.max_tokens)
    max_len = math.ceil((longest + 2 * args.max_tokens + BLOCK) / BLOCK) * BLOCK
    blocks = max(math.ceil(args.capacity * working), max_len // BLOCK + 1)
    log(f"bench: {len(convs) * args.turns} requests, working set {working} blocks; "
        f"engines' KV and members' pools {blocks} blocks each, max model len {max_len}")
    order = [policies[(i + r) % len(policies)] for r in range(args.rounds)
             for i in range(len(policies))]
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    with tempfile.TemporaryDirectory(prefix="rkv-gw-bench-") as directory:
        work = Path(args.logs) if args.logs else Path(directory)
        work.mkdir(parents=True, exist_ok=True)
        with engines(model, blocks, max_len, work) as (cluster, pair):
            once = argparse.Namespace(concurrency=1, turns=1, max_tokens=2, seed=0)
            for e in pair:  # a first request each, untimed
                asyncio.run(drive(e.url, model, [convs[0].fresh()], once))
            for policy in order:
                rows[policy].append(run_policy(policy, (model, cluster, pair, work), convs,
                                               args))
    merged = {p: merge(r) for p, r in rows.items()}
    keys = ("groups", "convs", "turns", "max_tokens", "concurrency", "rounds", "seed")
    return {"model": models.REAL_MODEL, "block_size": BLOCK, **{k: vars(args)[k] for k in keys},
            "order": order, "working_set_blocks": working, "kv_blocks_per_engine": blocks,
            "member_blocks": blocks, "max_model_len": max_len, "rows": list(merged.values()),
            "goals": goals(merged), "goal_text": GOAL_TEXT}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset")
    for flag, default, text in (
            ("groups", 4, "system prompts"), ("convs", 3, "conversations per group"),
            ("turns", 3, "user turns per conversation"), ("max-tokens", 16, "tokens per answer"),
            ("concurrency", 3, "requests in flight"), ("seed", 0, "the workload's seed"),
            ("rounds", 2, "runs of every policy, the order rotated each round")):
        p.add_argument(f"--{flag}", type=int, default=default, help=f"{text} ({default})")
    p.add_argument("--capacity", type=float, default=0.6, help="each engine's KV and member's "
                   "pool, as a share of the workload's distinct prompt blocks (0.6)")
    p.add_argument("--logs", help="keep the servers' logs in this folder")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cleanup runs on SIGTERM too
    out = run(args)
    log(f"bench: goals: {out['goals']}")
    emit("gateway", out, args.json)


if __name__ == "__main__":
    main()
