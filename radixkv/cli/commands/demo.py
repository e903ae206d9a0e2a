"""`radixkv demo`: the main job in one command. Starts the service on its defaults (host pool,
the per-user Unix socket), shows what it does, and stops it.

Stages: what KV costs (calculator) -> the radix tree on a synthetic chat workload -> the
service answering engines over gRPC, with bytes shared through the pool -> a load replay ->
two engine processes reusing KV -> the cache summary (`radixkv inspect`).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from radixkv.client import Client
from radixkv.protocol.env import default_socket_path
from radixkv.protocol.errors import AlreadyExists
from radixkv.server.launch import server_process, start_server

if TYPE_CHECKING:
    from rich.console import Console


def register(sub: Any) -> None:
    """Add `radixkv demo`."""
    p = sub.add_parser("demo", help="start the service on its defaults and show it working",
                       description="The main job in one command: the memory calculator, the "
                       "radix tree on a synthetic chat workload, then the service (host pool, "
                       "Unix socket) answering engines, and what the cache did.")
    p.add_argument("--requests", type=int, default=2000, help="synthetic requests (2000)")
    p.add_argument("--json", action="store_true", help="print results as JSON on stdout")
    p.add_argument("--no-engines", action="store_true",
                   help="skip the two-engine stage (needs the `hf` extra: transformers)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo's stages; 1 if a replayed block or an engine's output came back wrong."""
    return run_demo(requests=args.requests, json_out=args.json, engines=not args.no_engines)


@contextlib.contextmanager
def service_process(*flags: str, console: Console | None = None) -> Iterator[str]:
    """Run `radixkv serve` (default socket; a private temporary one if another server holds
    it) and yield its socket path; SIGTERM it at exit."""
    try:
        server = start_server(default_socket_path(), *flags)
    except AlreadyExists:
        if console:
            console.print(f"[yellow]another server holds {default_socket_path()}; "
                          "using a private socket[/]")
        with server_process(*flags) as private:
            yield private.socket
        return
    try:
        yield server.socket
    finally:
        server.stop()


def stage_calc(console: Console) -> None:
    from kvpool.calc import calculate, render
    from kvpool.layout import KVLayout

    console.rule("[bold]1. What KV costs (radixkv calc --preset llama-3-70b)")
    console.print(render(calculate(KVLayout.from_preset("llama-3-70b"))))


def stage_tree(console: Console, num_requests: int) -> dict[str, Any]:
    from radixkv.replay.simulate import replay_tree
    from radixkv.replay.workload import generate_synthetic

    console.rule("[bold]2. The radix tree alone on a synthetic chat workload")
    requests = generate_synthetic(num_requests, seed=0)
    r = replay_tree(requests, block_size=16, capacity_blocks=4096)
    console.print(f"{r.num_requests:,} requests, {r.prompt_tokens:,} prompt tokens, "
                  f"capacity 4,096 blocks x 16 tokens: token hit rate "
                  f"[bold green]{r.token_hit_rate:.1%}[/], {r.num_evicted_blocks:,} blocks evicted,"
                  f" match p50 {r.match_us.p50:.1f} us, insert p50 {r.insert_us.p50:.1f} us")
    return {"token_hit_rate": r.token_hit_rate, "requests": r.num_requests}


def stage_service(console: Console, sock: str) -> dict[str, Any]:
    import numpy as np

    console.rule("[bold]3. The service: Match -> Allocate -> write -> Insert -> Release")
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, 512, dtype="<u4")
    out: dict[str, Any] = {}
    with Client(sock) as kv:
        info = kv.pool_info()
        view = kv.pool().view()
        console.print(f"pool: {info.handle.backend}, {info.handle.num_blocks} blocks of "
                      f"{info.layout.block_size} tokens, epoch {info.epoch[:8]}, mapped "
                      f"zero-copy as {tuple(view.shape)} {view.dtype}")
        for user in range(3):
            prompt = np.concatenate([system, rng.integers(0, 32000, 100, dtype="<u4")])
            with kv.lease("demo", prompt) as lease:
                full = len(prompt) // info.layout.block_size
                new = lease.allocate(full - len(lease.block_ids))
                for b in new:  # the engine's KV would go here, in the lease's pool epoch
                    lease.view()[b].fill_(float(user + 1))
                lease.insert(prompt, lease.block_ids + new, release=True)
            console.print(f"  request {user + 1}: {len(prompt)} tokens, "
                          f"{lease.num_tokens} reused from the cache, {len(new)} blocks written")
        out["stats"] = kv.stats(check_integrity=True)
    console.print(f"integrity: {out['stats']['integrity']}")
    return out


def stage_replay(console: Console, sock: str, num_requests: int) -> dict[str, Any]:
    from radixkv.replay.runner import render_report, run_replay
    from radixkv.replay.workload import generate_synthetic

    console.rule("[bold]4. Load replay: synthetic chats from 2 engine processes, bytes verified")
    with Client(sock) as kv:
        info = kv.pool_info()
    report = run_replay(generate_synthetic(num_requests, seed=1), target=sock,
                        block_size=info.layout.block_size,
                        capacity_blocks=info.handle.num_blocks, clients=2, progress=True)
    console.print(render_report(report))
    return {"token_hit_rate": report.token_hit_rate, "optimum": report.optimum_token_hit_rate,
            "mismatches": report.mismatches}


def stage_inspect(console: Console, sock: str) -> dict[str, Any]:
    from radixkv.cli.summary import render_summary, summary

    console.rule(f"[bold]5. What the cache holds now (radixkv inspect --socket {sock})")
    with Client(sock) as kv:
        view = summary(kv)
    console.print(render_summary(view))
    return view


def stage_engines(console: Console) -> dict[str, Any]:
    from radixkv.engines import chat_demo
    from radixkv.engines.models import ModelNotAvailable

    try:
        chat_demo.prepare(notify=lambda message: console.print(f"[dim]{message}[/]"))
    except ModelNotAvailable as e:
        console.print(f"[yellow]the real model is not available: {e}\nshowing a tiny "
                      f"random-weight Llama instead[/]")
        return _stage_tiny_engines(console)
    console.rule(f"[bold]6. Two engine processes, two chats, one shared system prompt "
                 f"({chat_demo.MODEL}, CPU)")
    console.print("Each turn re-sends the whole chat and is served by the other engine process "
                  "than the turn before; every turn also runs without radixkv to compare.")

    def show(r: dict[str, Any]) -> None:
        same = "[green]yes[/]" if r["match"] else "[red]NO[/]"
        console.print(f"[bold]{r['name']}[/] (engine {r['engine']})  [cyan]user:[/] {r['user']}")
        console.print(f"  [cyan]assistant:[/] {r['answer'].strip()}", highlight=False)
        console.print(f"  reused {r['cached_tokens']} of {r['prompt_tokens']} prompt tokens, "
                      f"TTFT {r['ttft_s'] * 1e3:.0f} ms (no cache: "
                      f"{r['ttft_no_cache_s'] * 1e3:.0f} ms); identical to a no-cache run: "
                      f"{same}")

    with server_process(*chat_demo.serve_flags()) as server:  # one service per model
        result = chat_demo.run_chat_demo(server.socket, on_turn=show)
    _engine_table(console, result)
    return result


def _engine_table(console: Console, result: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table("request", "engine", "tokens", "reused", "TTFT", "no cache", "same output")
    for r in result["requests"]:
        table.add_row(r["name"], str(r["engine"]), str(r["prompt_tokens"]),
                      str(r["cached_tokens"]), f"{r['ttft_s'] * 1e3:.1f} ms",
                      f"{r['ttft_no_cache_s'] * 1e3:.1f} ms",
                      "[green]yes[/]" if r["match"] else "[red]NO[/]")
    console.print(table)
    console.print(f"TTFT saved in all: {result['ttft_saved_s'] * 1e3:.0f} ms; generated tokens "
                  f"identical to a no-cache run: {result['all_match']}")


def _stage_tiny_engines(console: Console) -> dict[str, Any]:
    from radixkv.engines.demo import demo_serve_flags, run_engine_demo

    console.rule("[bold]6. Two engine processes reuse KV (a tiny random-weight Llama, CPU)")
    with tempfile.TemporaryDirectory(prefix="radixkv-demo-model-") as directory, \
            server_process(*demo_serve_flags(directory)) as server:  # one service per model
        result = run_engine_demo(server.socket)
    _engine_table(console, result)
    return {"model": "tiny-demo", **result}


def run_demo(requests: int = 2000, json_out: bool = False, engines: bool = True) -> int:
    """Every stage in turn (the engines' last, unless `engines` is False); `json_out`: the
    results as JSON on stdout, the show on stderr."""
    from rich.console import Console

    console = Console(stderr=json_out)
    results: dict[str, Any] = {}
    stage_calc(console)
    results["tree"] = stage_tree(console, requests)
    with service_process(console=console) as sock:
        results["service"] = stage_service(console, sock)
        results["replay"] = stage_replay(console, sock, requests // 2)
        results["inspect"] = stage_inspect(console, sock)
    if engines:
        results["engines"] = stage_engines(console)
    if json_out:
        import json

        print(json.dumps(results, indent=2, default=str))
    ok = results["replay"]["mismatches"] == 0 and (not engines or
                                                   results["engines"]["all_match"])
    return 0 if ok else 1
