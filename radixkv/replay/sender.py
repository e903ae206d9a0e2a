"""One `radixkv replay` client process: take jobs from the shared queue in trace order, send each
request to its service (radixkv.replay.routing picks the member over a cluster), and put one
dict of per-request arrays on the result queue."""

from __future__ import annotations

import functools
import time
import traceback
from typing import Any

import numpy as np

from radixkv.replay.client import ClientArgs, Verification, request
from radixkv.replay.routing import Members, OneService


def client_main(args: ClientArgs, jobs: Any, results: Any, done: Any, barrier: Any,
                 start: Any) -> None:
    """One client process: take jobs until None; put one dict of per-request arrays."""
    try:
        members: Members | OneService = Members(args) if args.router else OneService(args)
    except BaseException:
        barrier.abort()
        results.put({"error": traceback.format_exc()})
        return
    try:
        barrier.wait()
        while not start.value:  # set by the main process once every client is ready
            time.sleep(0.001)
        results.put(client_loop(args, members, jobs, done, start.value))
    except BaseException:
        results.put({"error": traceback.format_exc()})
    finally:
        members.close()


def client_loop(args: ClientArgs, members: Any, jobs: Any, done: Any,
                 t0: float) -> dict[str, Any]:
    cols: dict[str, list[int]] = {k: [] for k in (
        "index", "hit_tokens", "match_ns", "allocate_ns", "insert_ns", "release_ns",
        "dropped", "peek_blocks", "route_ns", "node")}
    check = Verification()
    while (job := jobs.get()) is not None:
        index, namespace, tokens, due_ms, key_bytes, hint = job
        if args.speed and due_ms is not None:
            delay = t0 + due_ms / 1e3 / args.speed - time.time()
            if delay > 0:
                time.sleep(delay)
        keys = np.frombuffer(key_bytes, dtype="<u8")
        send = functools.partial(request, args, check=check, index=index,
                                 namespace=namespace, tokens=tokens, keys=keys, hint=hint)
        row, route_ns, node = members.run(index, namespace, tokens, keys, send)
        row.update(index=index, route_ns=route_ns, node=node)
        for key, value in row.items():
            cols[key].append(value)
        with done.get_lock():
            done.value += 1
    out: dict[str, Any] = {k: np.asarray(v, dtype=np.int64) for k, v in cols.items()}
    out.update(verified=check.verified, mismatches=check.mismatches, examples=check.examples,
               finished=time.time(), node_names=list(members.names))
    return out
