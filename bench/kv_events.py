"""KV events on vLLM's wire (serve --kv-events-endpoint): how soon a block stored is on the wire,
and how many events a burst sends per second.

Latency: a server publishes on an ipc endpoint; this process subscribes (ZMQ SUB), decodes each
batch (msgpack) and stores one prompt at a time: from its Insert's call to the batch with its
BlockStored at the subscriber, the Insert's own round trip included (p50 / p99 over --prompts;
the batch may reach the subscriber before the Insert's answer reaches the caller). Burst: the
publisher alone (in this process) on an event log holding --burst BlockStored events (one block
each) when it starts: events per second at the subscriber, from its start to the last event (the
service's own insert rate, measured in docs/benchmarks.md's rpc section, is below this).

    .venv/bin/python bench/kv_events.py --json
    .venv/bin/python bench/kv_events.py --prompts 50 --burst 500 --json      # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import msgspec
import zmq
from _common import emit, log, radixkv_server

from radixkv.client import Client

BLOCK = 16
NS = "bench@events"


def tiny_config(directory: str) -> str:
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump({"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
                   "head_dim": 16, "hidden_size": 16, "torch_dtype": "float16"}, f)
    return path


def prompt(head: int, blocks: int) -> list[int]:
    return [head * 100_000 + i for i in range(blocks * BLOCK)]


class Subscriber:
    """A SUB socket on the member's events, read on a thread: each BlockStored's first token and
    when it arrived; the events counted (`count_only`: without decoding them)."""

    def __init__(self, endpoint: str, count_only: bool = False) -> None:
        self.decoder = msgspec.msgpack.Decoder(
            tuple[float, list[msgspec.Raw], int] if count_only else Any)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.RCVTIMEO = 200
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.seen: dict[int, float] = {}  # first token of a stored run -> arrival
        self.events = 0
        self.last = 0.0
        self.cond = threading.Condition()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            try:
                _, _, payload = self.sock.recv_multipart()
            except zmq.Again:
                continue
            now = time.perf_counter()
            batch = self.decoder.decode(payload)
            with self.cond:
                self.events += len(batch[1])
                for ev in batch[1]:
                    if isinstance(ev, dict) and ev["type"] == "BlockStored":
                        self.seen[ev["token_ids"][0]] = now
                self.last = now
                self.cond.notify_all()

    def wait(self, check: Any, timeout: float = 30) -> None:
        with self.cond:
            if not self.cond.wait_for(check, timeout):
                raise SystemExit("the subscriber did not get the events in time")

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


def burst_s(endpoint: str, n: int) -> float:
    """Seconds from the publisher's start to the subscriber's last event, with `n` one-block
    BlockStored events waiting in its log."""
    import numpy as np

    from radixkv.index.results import BlockStored
    from radixkv.server.vllm_events import VllmEventPublisher, VllmEventsConfig
    from radixkv.service.events import EventLog

    events = EventLog(BLOCK, capacity=n + 1)
    tokens = np.arange(n * BLOCK, dtype="<u4").reshape(n, BLOCK)
    for i in range(n):
        events.publish(NS, [BlockStored((i,), None, tokens[i].tobytes())])
    publisher = VllmEventPublisher(events, VllmEventsConfig(endpoint), "CPU")
    sub = Subscriber(endpoint, count_only=True)  # a consumer's decoding is its own cost
    try:
        time.sleep(0.5)  # subscribed before the first batch goes out
        t0 = time.perf_counter()
        publisher.start()
        sub.wait(lambda: sub.events >= n, timeout=120)
        return sub.last - t0
    finally:
        publisher.stop()
        sub.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rkv-evb-") as d:
        endpoint = f"ipc://{d}/ev"
        flags = ("--model-config", tiny_config(d), "--block-size", str(BLOCK), "--num-blocks",
                 str(args.prompts * args.blocks + 64),
                 "--kv-events-endpoint", endpoint, "--log-level", "warning")
        with radixkv_server(d, *flags) as sock, Client(sock) as kv:
            sub = Subscriber(endpoint)
            try:
                time.sleep(0.5)  # the subscription reaches the publisher (ZMQ's slow joiner)
                lat = []
                for i in range(args.prompts):
                    tokens = prompt(i, args.blocks)
                    with kv.lease(NS, tokens) as lease:
                        called = time.perf_counter()
                        lease.insert(tokens, lease.new_block_ids, release=True)
                    sub.wait(lambda t=tokens[0]: t in sub.seen)
                    lat.append(sub.seen[tokens[0]] - called)
                log(f"latency: p50 {statistics.median(lat) * 1e3:.2f} ms over {len(lat)}")
            finally:
                sub.close()
        seconds = burst_s(f"ipc://{d}/burst", args.burst)
    q = statistics.quantiles(lat, n=100)
    events = args.burst
    return {"prompts": args.prompts, "blocks_per_prompt": args.blocks,
            "publish_p50_ms": statistics.median(lat) * 1e3, "publish_p99_ms": q[98] * 1e3,
            "burst_events": events, "burst_s": seconds, "events_per_s": events / seconds,
            "goals": {"publish_p99_ms<=5": q[98] * 1e3 <= 5,
                      "events_per_s>=100k": events / seconds >= 100_000}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=500, help="prompts timed one at a time (500)")
    p.add_argument("--blocks", type=int, default=4, help="blocks per prompt (4)")
    p.add_argument("--burst", type=int, default=200_000,
                   help="events waiting when the publisher starts (200,000)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    emit("kv_events", run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
