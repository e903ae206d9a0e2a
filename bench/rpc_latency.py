"""RPC latency and throughput of the real service against a gRPC echo floor.

    python bench/rpc_latency.py                    # ~4 minutes on 2 cores
    python bench/rpc_latency.py --json

Starts `radixkv serve` (Unix socket + TCP on 127.0.0.1) and an echo server (same grpcio, same
thread-pool server, a handler that does nothing but reply) in subprocesses, and a "stub floor":
the generated RadixKV stubs with a Match that returns a constant MatchResponse, called through
the same typed client as radixkv, which shows what protobuf stubs and the client cost before
any cache work (8-client throughput only). For each transport:
Match p50/p99 unbatched, Allocate+Insert p50/p99, batched Match (--batch queries a call), and
1 vs N client processes. The echo floor carries the same request bytes and replies with as many
bytes as Match's reply, so the ratio isolates what the service itself costs. Cases that are
compared run interleaved, round after round (--rounds), and each ratio is the median of the
rounds' ratios: a shared machine's speed drifts by more than the differences measured here.
Every server runs on --server-cpus (default: the last CPU), radixkv's with `serve --cpus`:
a Python server is bound to about one core by its GIL, and its threads hopping between cores
cost it ~25 % of its calls/s here; the clients go where the OS puts them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import percentile_us  # noqa: E402
from _peek import run_peek  # noqa: E402

from radixkv.index.policies import DEFAULT_POLICY  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = {"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
        "hidden_size": 4, "torch_dtype": "float32"}  # 512 B blocks at block_size 16
ECHO_METHOD = "/bench.Echo/Echo"
_SEQ = itertools.count()  # per process: every cycle request's suffix is new
ECHO_WORKERS = 2  # as many call threads as `radixkv serve` runs by default (a fair floor)
CPUS_ENV = "RADIXKV_BENCH_SERVER_CPUS"  # how the floor servers learn --server-cpus


# ---- the echo floor ------------------------------------------------------------------------

def pin_from_env() -> None:
    """Floor servers run on the CPUs the radixkv servers get (--server-cpus), if any."""
    cpus = os.environ.get(CPUS_ENV)
    if cpus:
        from radixkv.rpc.process import pin_cpus

        pin_cpus(cpus)


def serve_floor(name: str, register, unix: str, tcp_port: int) -> None:  # type: ignore[no-untyped-def]
    """A floor server: `register(server)` adds its handlers; the same thread pool as the
    service's call threads, on the Unix socket and TCP; runs until SIGTERM."""
    import grpc

    pin_from_env()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=ECHO_WORKERS), options=[
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)])
    register(server)
    server.add_insecure_port(f"unix://{unix}")
    server.add_insecure_port(f"127.0.0.1:{tcp_port}")
    server.start()
    print(f"{name} ready", flush=True)
    signal.sigwait([signal.SIGTERM])
    server.stop(0)


def serve_echo(unix: str, tcp_port: int, reply_bytes: int) -> None:
    import grpc

    reply = b"\0" * reply_bytes
    handler = grpc.method_handlers_generic_handler("bench.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: reply)})
    serve_floor("echo", lambda server: server.add_generic_rpc_handlers((handler,)), unix,
                tcp_port)


def serve_stub_floor(unix: str, tcp_port: int, reply: bytes) -> None:
    """The generated service with a Match that does no work: a constant reply (and a Release
    the bench's clients call at the end)."""
    from radixkv.v1 import radixkv_pb2 as pb
    from radixkv.v1 import radixkv_pb2_grpc

    response = pb.MatchResponse.FromString(reply)

    class Constant(radixkv_pb2_grpc.RadixKVServicer):
        def Match(self, request, context):  # type: ignore[no-untyped-def]
            return response

        def Release(self, request, context):  # type: ignore[no-untyped-def]
            return pb.ReleaseResponse()

    serve_floor("stub", lambda server: radixkv_pb2_grpc.add_RadixKVServicer_to_server(
        Constant(), server), unix, tcp_port)


def serve_aio_kv(unix: str, config_path: str, block_size: int, num_blocks: int) -> None:
    """The same KVService and servicer methods under grpc.aio (async wrappers that call the
    sync methods inline; they take microseconds), to compare the two server styles."""
    import asyncio

    import grpc

    from kvpool import create_pool
    from kvpool.layout import KVLayout
    from radixkv.server.servicer import Servicer
    from radixkv.service import KVService, ServiceConfig
    from radixkv.v1 import radixkv_pb2_grpc

    pin_from_env()
    layout = KVLayout.from_hf_config(config_path, block_size=block_size)
    pool = create_pool(layout, num_blocks=num_blocks)
    sync = Servicer(KVService(pool, ServiceConfig(lease_ttl_s=600)), 1 << 20)

    def wrap(name: str):  # type: ignore[no-untyped-def]
        method = getattr(sync, name)

        async def call(_self, request, context):  # type: ignore[no-untyped-def]
            return method(request, context)
        return call

    names = ("PoolInfo", "Match", "Allocate", "Insert", "Release", "Stats")
    servicer = type("AioServicer", (radixkv_pb2_grpc.RadixKVServicer,),
                    {n: wrap(n) for n in names})()

    async def run() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        radixkv_pb2_grpc.add_RadixKVServicer_to_server(servicer, server)
        server.add_insecure_port(f"unix://{unix}")
        await server.start()
        stop = asyncio.Event()  # SIGTERM ends run(), so the pool below unlinks its memory
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print("radixkv aio ready", flush=True)
        await stop.wait()
        await server.stop(0)

    try:
        asyncio.run(run())
    finally:
        pool.close()


def start(args: list[str], ready: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(ready):
            return proc
    raise RuntimeError(f"{args[:4]} did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- workers (run in spawned processes so clients never share a GIL) ------------------------

def prompt(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 32000, n, dtype="<u4").tobytes()


def run_match(target: str, prompts: list[bytes], batch: int, seconds: float,
              barrier_at: float) -> dict[str, object]:
    from radixkv.client import Client

    kv = Client(target)
    kv.wait_ready()
    lat, leases = [], []
    n = len(prompts)  # the query lists are made before timing, as the echo's payload is
    batches = [[("bench", prompts[(k + j) % n]) for j in range(batch)] for k in range(n)]
    while time.time() < barrier_at:
        time.sleep(0.001)
    deadline = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        results = kv.match_many(batches[i % n])
        lat.append(time.perf_counter() - t0)
        leases += [r.lease_id for r in results]
        i += batch
    for k in range(0, len(leases), 1000):
        kv.release(*leases[k:k + 1000])
    kv.close()
    return {"lat": lat, "requests": len(lat) * batch}


def run_cycle(target: str, prefix: bytes, tail: bytes, trips: int, seconds: float,
              barrier_at: float) -> dict[str, object]:
    """Full request cycles: a prompt of a cached `prefix` and a new suffix (its first token
    unique per request, so every suffix block is new). trips=4: Match, Allocate, Insert,
    Release; trips=2: Match that allocates, Insert that releases. No KV is written (both
    modes alike): this is the service's share of a request."""
    import struct

    from radixkv.client import STORE_ALL, Client

    kv = Client(target)
    kv.wait_ready()
    block = 4 * kv.pool_info().layout.block_size
    tag = (os.getpid() % 65536) << 16
    lat = []
    while time.time() < barrier_at:
        time.sleep(0.001)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        tokens = prefix + struct.pack("<I", tag + next(_SEQ) % 65536) + tail
        t0 = time.perf_counter()
        m = kv.match("cycle", tokens, store_tokens=STORE_ALL if trips == 2 else 0)
        need = len(tokens) // block - len(m.block_ids)
        if need <= 0:  # a repeat of an earlier request (after 65,536 of them)
            kv.release(m.lease_id)
        elif trips == 2:
            kv.insert("cycle", tokens, m.block_ids + m.new_block_ids[:need], m.lease_id,
                      m.epoch, release=True)
        else:
            new = kv.allocate(need, lease_id=m.lease_id).block_ids
            kv.insert("cycle", tokens, m.block_ids + new, m.lease_id, m.epoch)
            kv.release(m.lease_id)
        lat.append(time.perf_counter() - t0)
    kv.close()
    return {"lat": lat, "requests": len(lat)}


def run_echo(target: str, payload: bytes, seconds: float, barrier_at: float
             ) -> dict[str, object]:
    import grpc

    ch = grpc.insecure_channel(target)
    call = ch.unary_unary(ECHO_METHOD)
    call(payload, timeout=10)
    lat = []
    while time.time() < barrier_at:
        time.sleep(0.001)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        call(payload, timeout=10)
        lat.append(time.perf_counter() - t0)
    ch.close()
    return {"lat": lat, "requests": len(lat)}


def summarize(results: list[dict[str, object]], seconds: float) -> dict[str, float]:
    lat = np.concatenate([np.asarray(r["lat"]) for r in results])
    requests = sum(int(r["requests"]) for r in results)  # type: ignore[call-overload]
    return {"p50_us": percentile_us(lat, 50), "p99_us": percentile_us(lat, 99),
            "calls_per_s": len(lat) / seconds, "requests_per_s": requests / seconds}


BARRIER_S = 0.2  # from handing a case to warm processes to their common start


def run_rounds(n: int, cases: dict[str, tuple], seconds: float,  # type: ignore[type-arg]
               rounds: int) -> dict[str, list[dict[str, float]]]:
    """Each case (fn, [args per server replica]) on `n` client processes, interleaved over
    `rounds` rounds, so that a machine that speeds up or slows down during the run affects
    every case alike. Round r uses replica r mod replicas, and starts one case later in the list
    than round r-1: both a server process's luck and a case's place in the round bias it
    (measured: identical servers spread 0.68-0.73 of the echo in a fixed order, 0.74-0.77
    rotated, and still 0.77 vs 0.81 as two processes). A first, untimed round warms the
    client processes (imports)."""
    out: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    names = list(cases)
    lead = 1.0  # the first tasks wait for the processes' imports
    with mp.get_context("spawn").Pool(n) as pool:
        for r in range(rounds + 1):
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn, replicas = cases[name]
                args = replicas[r % len(replicas)]
                barrier_at = time.time() + lead  # the processes start timing together
                lead = BARRIER_S
                results = pool.starmap(fn, [(*args, seconds, barrier_at)] * n)
                if r:
                    out[name].append(summarize(results, seconds))
    return out


def median_of(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: float(np.median([row[key] for row in rows])) for key in rows[0]}


def round_ratios(a: list[dict[str, float]], b: list[dict[str, float]], key: str) -> list[float]:
    """a[key] / b[key] for each round (each round's pair ran back to back)."""
    return [x[key] / y[key] for x, y in zip(a, b, strict=True)]


def median_ratio(a: list[dict[str, float]], b: list[dict[str, float]], key: str) -> float:
    return float(np.median(round_ratios(a, b, key)))


def populate(target: str, prompts: list[bytes], block_size: int,  # type: ignore[no-untyped-def]
             namespace: str = "bench"):
    """Cache every prompt so each Match is a full hit; returns one Match result."""
    from radixkv.client import Client

    with Client(target) as kv:
        for t in prompts:
            a = kv.allocate(len(t) // 4 // block_size, namespace=namespace)
            kv.insert(namespace, t, a.block_ids, a.lease_id)
            kv.release(a.lease_id)
        m = kv.match(namespace, prompts[0])
        kv.release(m.lease_id)
    return m


def allocate_insert(target: str, num_tokens: int, block_size: int, iters: int) -> dict[str, float]:
    from radixkv.client import Client

    kv = Client(target)
    lat, leases = [], []
    for i in range(iters):
        tokens = prompt(10_000 + i, num_tokens)
        t0 = time.perf_counter()
        a = kv.allocate(num_tokens // block_size, namespace="bench-insert")
        kv.insert("bench-insert", tokens, a.block_ids, a.lease_id)
        lat.append(time.perf_counter() - t0)
        leases.append(a.lease_id)
        if len(leases) >= 50:
            kv.release(*leases)
            leases = []
    if leases:
        kv.release(*leases)
    kv.close()
    arr = np.asarray(lat)
    return {"p50_us": percentile_us(arr, 50), "p99_us": percentile_us(arr, 99)}


# ---- main --------------------------------------------------------------------------------------

def peek_line(r: dict[str, object]) -> str:
    peek, match = r["peek_4k"], r["match_4k"]
    return (f"lookup table, 4096-token prompt: peek p50 {peek['p50_us']:.1f} us p99 "  # type: ignore[index]
            f"{peek['p99_us']:.1f} us (retries {peek['retry_pct']:.2f} %) vs Match p50 "  # type: ignore[index]
            f"{match['p50_us']:.0f} us p99 {match['p99_us']:.0f} us, inserting "  # type: ignore[index]
            f"{r['inserted_blocks_per_s']:.0f} blocks/s, {r['wrong_answers']} wrong answers")


def default_server_cpus() -> str:
    """The last CPU this process may use, or "none" on a single CPU (nothing to keep apart)."""
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[-1]) if len(cpus) > 1 else "none"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seconds", type=float, default=1.0, help="per case and round (1)")
    p.add_argument("--rounds", type=int, default=6,
                   help="interleaved rounds; ratios are medians over them (6)")
    p.add_argument("--replicas", type=int, default=3,
                   help="server processes of each kind; rounds take turns on them (3)")
    p.add_argument("--clients", type=int, default=8, help="client processes for throughput (8)")
    p.add_argument("--batch", type=int, default=32, help="queries per batched Match (32)")
    p.add_argument("--transports", default="unix,tcp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-cpus", default=default_server_cpus(),
                   help="CPUs every server of the bench runs on (radixkv `serve --cpus`, the "
                   "floors alike; default: the last CPU, where there are two or more) or "
                   "'none'; the clients go where the OS puts them")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"eviction policy of the radixkv servers ({DEFAULT_POLICY})")
    p.add_argument("--peek-only", action="store_true",
                   help="only the lookup table's case: peek_4k beside match_4k under inserts")
    p.add_argument("--json", action="store_true")
    p.add_argument("--echo-server", nargs=3, metavar=("UNIX", "PORT", "REPLY_BYTES"),
                   help=argparse.SUPPRESS)
    p.add_argument("--aio-server", nargs=2, metavar=("UNIX", "CONFIG"), help=argparse.SUPPRESS)
    p.add_argument("--stub-server", nargs=3, metavar=("UNIX", "PORT", "REPLY_HEX"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.echo_server:
        serve_echo(args.echo_server[0], int(args.echo_server[1]), int(args.echo_server[2]))
        return 0
    if args.stub_server:
        serve_stub_floor(args.stub_server[0], int(args.stub_server[1]),
                         bytes.fromhex(args.stub_server[2]))
        return 0
    if args.aio_server:
        serve_aio_kv(args.aio_server[0], args.aio_server[1], args.block_size, 65536)
        return 0

    pinned = [] if args.server_cpus == "none" else ["--cpus", args.server_cpus]
    if pinned:
        os.environ[CPUS_ENV] = args.server_cpus  # inherited by the floor servers
    tmp = tempfile.mkdtemp(prefix="rkvb-")
    cfg = os.path.join(tmp, "config.json")
    Path(cfg).write_text(json.dumps(TINY))
    procs = []
    results: dict[str, object] = {"prompt_tokens": args.prompt_tokens, "batch": args.batch,
                                  "clients": args.clients, "replicas": args.replicas,
                                  "server_cpus": args.server_cpus}

    def launch(kind: str, i: int, argv: Callable[[str, int], list[str]],
               ready: str) -> tuple[str, int]:
        """Start `python *argv(socket, port)`: one server on tmp/KIND-I.sock and a TCP port."""
        sock, port = os.path.join(tmp, f"{kind}-{i}.sock"), free_port()
        procs.append(start([sys.executable, *argv(sock, port)], ready))
        return sock, port

    try:
        kv_servers = [launch("kv", i, lambda sock, port: [
            "-m", "radixkv", "serve", "--socket", sock, "--tcp", f"127.0.0.1:{port}",
            "--insecure",
            "--model-config", cfg, "--block-size", str(args.block_size), "--num-blocks",
            "65536", "--lease-ttl", "600", "--max-leases-per-client", "100000000",
            "--policy", args.policy, "--log-level", "warning", *pinned], "radixkv serving")
            for i in range(args.replicas)]
        from radixkv.protocol.tokens import to_token_bytes
        from radixkv.v1 import radixkv_pb2 as pb

        peek_prompt = prompt(args.seed + 4096, 4096)
        if args.peek_only:
            results["unix"] = run_peek(f"unix://{kv_servers[0][0]}", peek_prompt,
                                       args.block_size, args.seconds, args.rounds)
            print(json.dumps(results, indent=2) if args.json else peek_line(results["unix"]))
            return 0

        prompts = [prompt(args.seed * 1000 + i, args.prompt_tokens) for i in range(64)]
        m = [populate(sock, prompts, args.block_size) for sock, _ in kv_servers][0]  # alike
        payload = pb.MatchRequest(client_id="x" * 40, queries=[
            pb.MatchQuery(namespace="bench", tokens=prompts[0])]).SerializeToString()
        constant = pb.MatchResponse(epoch="0" * 32, results=[pb.MatchResult(
            lease_id=2**62, num_tokens=m.num_tokens, block_ids=to_token_bytes(m.block_ids))])
        echo_servers = [launch("echo", i, lambda sock, port: [
            __file__, "--echo-server", sock, str(port), str(constant.ByteSize())], "echo ready")
            for i in range(args.replicas)]
        stub_servers = [launch("stub", i, lambda sock, port: [
            __file__, "--stub-server", sock, str(port), constant.SerializeToString().hex()],
            "stub ready") for i in range(args.replicas)]

        cycle_servers = [launch("cycle", i, lambda sock, port: [
            "-m", "radixkv", "serve", "--socket", sock, "--tcp", f"127.0.0.1:{port}",
            "--insecure",
            "--model-config", cfg, "--block-size", str(args.block_size), "--num-blocks",
            "65536", "--policy", args.policy, "--log-level", "warning", *pinned], "radixkv serving")
            for i in range(args.replicas)]
        shared = args.prompt_tokens // 2 // args.block_size * args.block_size
        cycle_prefix = prompt(args.seed + 7, shared)
        cycle_tail = prompt(args.seed + 8, args.prompt_tokens - shared - 1)
        for sock, _ in cycle_servers:
            populate(sock, [cycle_prefix], args.block_size, namespace="cycle")

        aio_sock = os.path.join(tmp, "aio.sock")
        procs.append(start([sys.executable, __file__, "--aio-server", aio_sock, cfg,
                            "--block-size", str(args.block_size)], "radixkv aio ready"))
        populate(aio_sock, prompts, args.block_size)
        aio_m = {"m": (run_match, [(f"unix://{aio_sock}", prompts, 1)])}
        aio = {"match_1": median_of(run_rounds(1, aio_m, args.seconds, args.rounds)["m"]),
               "match_n": median_of(run_rounds(args.clients, aio_m, args.seconds,
                                               args.rounds)["m"])}
        results["aio_unix"] = aio

        for transport in args.transports.split(","):
            def targets(servers: list[tuple[str, int]], transport: str = transport) -> list[str]:
                return [f"unix://{sock}" if transport == "unix" else f"127.0.0.1:{port}"
                        for sock, port in servers]

            kv_ts, echo_ts, stub_ts = (targets(kv_servers), targets(echo_servers),
                                       targets(stub_servers))
            cycle_ts = targets(cycle_servers)
            cycles = {f"cycle{trips}": (run_cycle, [(t, cycle_prefix, cycle_tail, trips)
                                                    for t in cycle_ts]) for trips in (2, 4)}
            r: dict[str, object] = {}
            s, k = args.seconds, args.rounds
            echo = (run_echo, [(t, payload) for t in echo_ts])
            match = (run_match, [(t, prompts, 1) for t in kv_ts])
            one = run_rounds(1, {"echo": echo, "match": match, "batched": (
                run_match, [(t, prompts, args.batch) for t in kv_ts]), **cycles}, s, k)
            many = run_rounds(args.clients, {"echo": echo, "match": match, "stub": (
                run_match, [(t, prompts, 1) for t in stub_ts]), **cycles}, s, k)
            for n, rounds in (("1", one), ("n", many)):
                r[f"cycle_two_{n}"] = median_of(rounds["cycle2"])
                r[f"cycle_four_{n}"] = median_of(rounds["cycle4"])
            r["echo_1"], r["match_1"] = median_of(one["echo"]), median_of(one["match"])
            r["match_batched_1"] = median_of(one["batched"])
            r["echo_n"], r["match_n"] = median_of(many["echo"]), median_of(many["match"])
            r["stub_n"] = median_of(many["stub"])
            r["allocate_insert"] = allocate_insert(kv_ts[0], args.prompt_tokens,
                                                   args.block_size, 200)
            if transport == "unix":  # the table is read the same whatever the transport
                r.update(run_peek(kv_ts[0], peek_prompt, args.block_size, args.seconds,
                                  args.rounds))
            spread = round_ratios(many["match"], many["echo"], "calls_per_s")
            r["match_n_over_echo_n_by_round"] = spread
            r["ratios"] = {
                "match_p50_over_echo_p50": median_ratio(one["match"], one["echo"], "p50_us"),
                "match_n_over_echo_n_throughput":
                    median_ratio(many["match"], many["echo"], "calls_per_s"),
                "stub_n_over_echo_n_throughput":
                    median_ratio(many["stub"], many["echo"], "calls_per_s"),
                "batched_over_unbatched_requests_per_s":
                    median_ratio(one["batched"], one["match"], "requests_per_s"),
                "cycle_two_over_four_1":
                    median_ratio(one["cycle2"], one["cycle4"], "requests_per_s"),
                "cycle_two_over_four_n":
                    median_ratio(many["cycle2"], many["cycle4"], "requests_per_s"),
            }
            results[transport] = r
            if not args.json:
                ratios = r["ratios"]
                print(f"[{transport}] {args.prompt_tokens}-token prompts: "
                      f"Match p50 {r['match_1']['p50_us']:.0f} us p99 "
                      f"{r['match_1']['p99_us']:.0f} us | echo p50 "
                      f"{r['echo_1']['p50_us']:.0f} us | ratio "
                      f"{ratios['match_p50_over_echo_p50']:.2f}x")
                print(f"[{transport}] {args.clients} clients: Match "
                      f"{r['match_n']['calls_per_s']:.0f} calls/s vs echo "
                      f"{r['echo_n']['calls_per_s']:.0f} calls/s | ratio "
                      f"{ratios['match_n_over_echo_n_throughput']:.2f} (rounds "
                      f"{min(spread):.2f}-{max(spread):.2f}; stub floor "
                      f"{r['stub_n']['calls_per_s']:.0f} calls/s = "
                      f"{ratios['stub_n_over_echo_n_throughput']:.2f} of echo)")
                print(f"[{transport}] batched x{args.batch}: "
                      f"{r['match_batched_1']['requests_per_s']:.0f} req/s vs unbatched "
                      f"{r['match_1']['requests_per_s']:.0f} req/s | "
                      f"{ratios['batched_over_unbatched_requests_per_s']:.1f}x")
                print(f"[{transport}] Allocate+Insert p50 {r['allocate_insert']['p50_us']:.0f} us"
                      f" p99 {r['allocate_insert']['p99_us']:.0f} us")
                if "peek_4k" in r:
                    print(f"[{transport}] {peek_line(r)}")
                for n, label in (("1", "1 client"), ("n", f"{args.clients} clients")):
                    two, four = r[f"cycle_two_{n}"], r[f"cycle_four_{n}"]
                    print(f"[{transport}] request cycle, {label}: two trips "
                          f"{two['requests_per_s']:.0f} req/s (p50 {two['p50_us']:.0f} us) vs "
                          f"four {four['requests_per_s']:.0f} req/s (p50 "
                          f"{four['p50_us']:.0f} us) | {ratios[f'cycle_two_over_four_{n}']:.2f}x")
        if not args.json:
            sync_u = results["unix"] if "unix" in results else None
            line = (f"[aio vs sync, unix] Match p50 {aio['match_1']['p50_us']:.0f} us, "
                    f"{args.clients} clients {aio['match_n']['calls_per_s']:.0f} calls/s")
            if sync_u:
                line += (f" | sync: {sync_u['match_1']['p50_us']:.0f} us, "  # type: ignore
                         f"{sync_u['match_n']['calls_per_s']:.0f} calls/s")  # type: ignore
            print(line)
        if args.json:
            print(json.dumps(results, indent=2))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
