"""vllm-router's kv_aware policy routing by radixkv's KV events (radixkv/server/vllm_events.py):
two members publish BlockStored on vLLM's wire, two stub OpenAI workers stand in for their
engines, and vllm-router 0.1.17 (.venv-router, `bash scripts/bootstrap_router`) sends a prompt
cached in member A to worker A and one cached in member B (as text or as chat) to worker B,
crediting the members' CPU blocks at --kv-penalty-host; without the events reaching it, or with
host blocks given no credit, both prompts land on one worker.

What the router does with the events (its 0.1.17 source): it asks each HTTP worker for the
prompt's token ids (POST /v1/completions/render or /v1/chat/completions/render, /tokenize when
those answer 404), hashes each block's token ids itself (sha256, unchained) and walks a tree
built from the BlockStored token_ids, where block_hashes / parent_block_hash only anchor the
blocks (so radixkv's own 64-bit hashes serve); `medium` CPU is its host tier. Its subscriber
connects to tcp://HOST:PORT, so the publisher must bind, and a member binds TCP only on
tcp://*:PORT (vLLM's rule): here each member's PUB connects to a loopback forwarder (XSUB/XPUB)
the router subscribes to, which keeps everything on 127.0.0.1; the replay ROUTER binds on
127.0.0.1 itself and the router replays from it when it joins after the first events."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import count
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from _forwarder import DIRECT, Forwarder, healthy
from _server import running_server, wait_for

from radixkv.client import Client

REPO = Path(__file__).resolve().parents[2]
ROUTER = REPO / ".venv-router" / "bin" / "vllm-router"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed in "
                       ".venv-router: run `bash scripts/bootstrap_router`"),
]

BLOCK = 16  # the members' block size and the router's --kv-event-block-size (its default)
NS = "smol@router"
MODEL = "smollm2-135m"
HOST_CREDIT = 0.8  # the router's default --kv-penalty-host

TEXT_A = ("The lighthouse keeper counted the ships that passed the northern cape every night, "
          "writing their names, their flags and the hour in a leather book that his father had "
          "kept before him, and his grandfather before that, for a hundred and twenty years.")
TEXT_B = ("Sourdough bread needs a lively starter, flour with enough protein, water at the "
          "right temperature, a pinch of salt and, above all, patience: the dough rises slowly "
          "overnight in a cool kitchen before it is shaped, scored and baked in a hot oven.")
CHAT_B = [{"role": "user", "content": "Explain in three sentences why the sky looks blue at "
                                      "noon and red at sunset, for a curious ten year old."}]
_nudges = count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def whole_blocks(ids: list[int]) -> int:
    return len(ids) // BLOCK


def host_credit(ids: list[int], blocks: int, credit: float) -> int:
    """The prompt tokens the router credits for `blocks` leading blocks on its host tier, as
    its policy computes them (the credit is a ratio; remaining work is rounded up; the last
    prompt token is never credited)."""
    credited = min(blocks * credit * BLOCK, len(ids) - 1)
    return len(ids) - math.ceil(max(len(ids) - credited, 0.0))


class StubWorker:
    """An OpenAI-compatible stand-in for a vLLM engine: /health, /v1/models, the render and
    /tokenize endpoints the router asks for a prompt's token ids (rendered with the model's own
    tokenizer, as vLLM renders them), and /v1/completions and /v1/chat/completions, recorded."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name, self.tokenizer = name, tokenizer
        self.generated: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def ids(self, body: Mapping[str, Any]) -> list[int]:
        """The prompt's token ids: a completion's text with the tokenizer's special tokens
        (none for this model), a chat's messages through its chat template."""
        with self._lock:
            if "messages" in body:
                out = self.tokenizer.apply_chat_template(
                    body["messages"], add_generation_prompt=True, tokenize=True)
                return list(out["input_ids"] if isinstance(out, Mapping) else out)
            return list(self.tokenizer(body["prompt"])["input_ids"])

    def take(self) -> list[tuple[str, Any]]:
        with self._lock:
            out, self.generated = self.generated, []
        return out

    def _answer(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path == "/v1/completions/render":
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            return 200, [{"token_ids": self.ids({"prompt": p}), "features": None}
                         for p in prompts]
        if path == "/v1/chat/completions/render":
            return 200, {"token_ids": self.ids(body), "features": None}
        if path == "/tokenize":
            ids = self.ids(body)
            return 200, {"tokens": ids, "count": len(ids), "max_model_len": 8192}
        if path in ("/v1/completions", "/v1/chat/completions"):
            with self._lock:
                self.generated.append((path, body.get("prompt", body.get("messages"))))
            choice = ({"index": 0, "text": self.name, "finish_reason": "stop"}
                      if path == "/v1/completions" else
                      {"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": self.name}})
            return 200, {"id": "cmpl-stub", "object": "text_completion", "model": MODEL,
                         "choices": [choice], "usage": {"prompt_tokens": 1,
                                                        "completion_tokens": 1,
                                                        "total_tokens": 2}}
        return 404, {"error": f"no {path}"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                else:
                    self._send(404, {"error": f"no {self.path}"})

            def do_POST(self) -> None:  # noqa: N802
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size) or b"{}")
                self._send(*worker._answer(self.path, body))

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Member:
    """A `radixkv serve` publishing its events into a forwarder, with its replay ROUTER."""

    def __init__(self, server: Any, forwarder: Forwarder, replay: str) -> None:
        self.socket, self.forwarder, self.replay = server.socket, forwarder, replay

    def store(self, ids: list[int]) -> int:
        """Cache the prompt's whole blocks (a lease, then an insert); returns their count."""
        tokens = ids[:whole_blocks(ids) * BLOCK]
        with Client(self.socket) as kv, kv.lease(NS, tokens) as lease:
            lease.insert(tokens, lease.block_ids + lease.new_block_ids, release=True)
        return len(tokens) // BLOCK

    def batches(self) -> list[tuple[int, Any]]:
        """Every buffered batch, from the replay ROUTER: (sequence, the decoded batch)."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.RCVTIMEO = 10_000
        try:
            sock.connect(self.replay)
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            out = []
            while True:
                _, _, seq, payload = sock.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return out
                out.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        finally:
            sock.close(linger=0)
            ctx.term()

    def published(self, ids: list[int]) -> int:
        """The sequence of the batch whose BlockStored carries the prompt's last whole block,
        once the member has published it."""
        last = ids[(whole_blocks(ids) - 1) * BLOCK:whole_blocks(ids) * BLOCK]

        def find() -> list[int]:
            return [seq for seq, (_, events, _) in self.batches()
                    if any(ev["type"] == "BlockStored" and ev["token_ids"][-BLOCK:] == last
                           for ev in events)]

        return max(wait_for(find, 10, "the member's event"))  # type: ignore[arg-type]


class RouterProcess:
    """A running vllm-router: its URL and its log (ANSI colours stripped when read)."""

    DECISION = re.compile(r'KV prefix decision outcome="(\w+)" worker="([^"]+)" '
                          r"input_tokens=(\d+) new_prefill_tokens=(\d+) "
                          r"credited_prefix_tokens=(\d+)")
    ADVANCED = re.compile(r"kv_index (?:live|replay) sequence advanced source=(\S+) "
                          r"rank=\d+ seq=(\d+)")

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))

    def applied(self, worker_url: str) -> int:
        """The highest event sequence from `worker_url`'s source the router has applied."""
        seqs = [int(s) for src, s in self.ADVANCED.findall(self.text()) if src == worker_url]
        return max(seqs, default=-1)

    def decisions(self) -> list[tuple[str, str, int, int, int]]:
        return [(o, w, int(n), int(p), int(c)) for o, w, n, p, c in
                self.DECISION.findall(self.text())]

    def post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with DIRECT.open(req, timeout=30) as resp:
            return json.loads(resp.read())


@contextmanager
def vllm_router(workers: list[StubWorker], sources: Mapping[str, tuple[str, str | None]],
                *flags: str) -> Iterator[RouterProcess]:
    """Start vllm-router (kv_aware, the workers, `sources`: worker URL -> (event endpoint,
    replay endpoint or None)) in a process group of its own on free loopback ports; SIGTERM
    the group at exit (SIGKILL after 10 s)."""
    port = free_port()
    args = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", *[w.url for w in workers], "--policy", "kv_aware",
            "--kv-event-model", MODEL, "--kv-event-block-size", str(BLOCK),
            "--worker-startup-check-interval", "1", "--log-level", "debug", *flags]
    for url, (events, replay) in sources.items():
        args += ["--kv-event-source", f"{url}={events}"]
        if replay:
            args += ["--kv-event-replay-source", f"{url}={replay}"]
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("rust_log", "http_proxy", "https_proxy", "all_proxy")}
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="rkv-router-") as d:
        log = Path(d) / "router.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        router = RouterProcess(proc, f"http://127.0.0.1:{port}", log)
        try:
            wait_for(lambda: proc.poll() is not None or healthy(router.url), 60,
                     "vllm-router to serve")
            assert proc.poll() is None, f"vllm-router exited:\n{router.text()[-4000:]}"
            yield router
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class Cluster:
    """Two members (A, B), their forwarders, two stub workers and the prompts' token ids."""

    def __init__(self, members: list[Member], workers: list[StubWorker]) -> None:
        self.members, self.workers = members, workers
        self.published: list[int] = []  # per member: the event sequence `sync` waits for

    def store_prompts(self) -> Cluster:
        """TEXT_A cached on A, TEXT_B and CHAT_B on B."""
        members, workers = self.members, self.workers
        self.ids_a = workers[0].ids({"prompt": TEXT_A})
        self.ids_b = workers[1].ids({"prompt": TEXT_B})
        self.chat_b = workers[1].ids({"messages": CHAT_B})
        self.blocks = {"a": members[0].store(self.ids_a), "b": members[1].store(self.ids_b),
                       "chat": members[1].store(self.chat_b)}
        self.published = [members[0].published(self.ids_a),
                          max(members[1].published(self.ids_b),
                              members[1].published(self.chat_b))]
        return self

    def sources(self) -> dict[str, tuple[str, str | None]]:
        return {w.url: (m.forwarder.outbound, m.replay)
                for w, m in zip(self.workers, self.members, strict=True)}

    def sync(self, router: RouterProcess, timeout: float = 30.0) -> None:
        """Wait until the router has applied every member's events up to the prompts'. A
        router that subscribed after they went out learns of them from the next event (its
        gap starts a replay), so a fresh one-block prompt is stored once a second meanwhile."""
        deadline = time.monotonic() + timeout
        for worker, member, seq in zip(self.workers, self.members, self.published,
                                       strict=True):
            next_nudge = time.monotonic() + 1.0
            while router.applied(worker.url) < seq:
                now = time.monotonic()
                assert now < deadline, (f"the router applied no event {seq} of {worker.name}:"
                                        f"\n{router.text()[-4000:]}")
                if now >= next_nudge:
                    member.store([1_000_000 + next(_nudges)] * BLOCK)
                    next_nudge = now + 1.0
                time.sleep(0.05)

    def route(self, router: RouterProcess, path: str, body: dict[str, Any]) -> str:
        """Send one request through the router; the name of the worker that served it."""
        router.post(path, {"model": MODEL, "max_tokens": 1, **body})
        served = [w.name for w in self.workers for _ in w.take()]
        assert len(served) == 1, served
        time.sleep(0.1)  # the router's load accounting of this request is over
        return served[0]

    def route_all(self, router: RouterProcess) -> dict[str, str]:
        return {"a": self.route(router, "/v1/completions", {"prompt": TEXT_A}),
                "b": self.route(router, "/v1/completions", {"prompt": TEXT_B}),
                "chat": self.route(router, "/v1/chat/completions", {"messages": CHAT_B})}

    def expected_credits(self, credit: float) -> list[int]:
        return [host_credit(ids, self.blocks[k], credit)
                for k, ids in (("a", self.ids_a), ("b", self.ids_b), ("chat", self.chat_b))]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from transformers import AutoTokenizer

    from radixkv.engines import models

    try:
        entry, _ = models.ensure_converted(models.get_spec(models.REAL_MODEL))
    except models.ModelNotAvailable as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(str(entry))


@pytest.fixture(scope="module")
def cluster(tokenizer: Any) -> Iterator[Cluster]:
    with ExitStack() as stack:
        workers, members = [], []
        for name in ("A", "B"):
            worker = StubWorker(name, tokenizer)
            stack.callback(worker.close)
            forwarder = Forwarder()
            stack.callback(forwarder.close)
            replay = f"tcp://127.0.0.1:{free_port()}"
            server = stack.enter_context(running_server(
                "--kv-events-endpoint", forwarder.inbound, "--kv-events-replay-endpoint",
                replay, num_blocks=64, block_size=BLOCK))
            workers.append(worker)
            members.append(Member(server, forwarder, replay))
        yield Cluster(members, workers).store_prompts()


def test_prompts_go_to_the_member_that_caches_them(cluster: Cluster) -> None:
    assert min(cluster.blocks.values()) >= 2, cluster.blocks
    with vllm_router(cluster.workers, cluster.sources()) as router:
        cluster.sync(router)
        landed = cluster.route_all(router)
        decisions = router.decisions()
    assert landed == {"a": "A", "b": "B", "chat": "B"}, (landed, decisions)
    assert [(o, c) for o, _, _, _, c in decisions] == [
        ("prefix_cost", c) for c in cluster.expected_credits(HOST_CREDIT)], decisions


@pytest.mark.parametrize("credit", [0.5, 0.0])
def test_cpu_blocks_are_credited_at_the_host_penalty(cluster: Cluster, credit: float) -> None:
    """radixkv's medium CPU is the router's host tier: each cached block earns credit x
    block_size tokens; at 0 the events no longer move a prompt, which then goes where the
    other one goes (the router's tie-break)."""
    with vllm_router(cluster.workers, cluster.sources(),
                     "--kv-penalty-host", str(credit)) as router:
        cluster.sync(router)
        landed = cluster.route_all(router)
        decisions = router.decisions()
    assert [c for *_, c in decisions] == cluster.expected_credits(credit), decisions
    if credit:
        assert landed == {"a": "A", "b": "B", "chat": "B"}, (landed, decisions)
    else:
        assert len(set(landed.values())) == 1, (landed, decisions)


def test_without_the_events_both_prompts_land_on_one_worker(cluster: Cluster) -> None:
    """The same router with its event sources on ports nothing listens on: no block is
    credited, and both members' prompts go to the same worker."""
    nowhere = {w.url: (f"tcp://127.0.0.1:{free_port()}", None) for w in cluster.workers}
    with vllm_router(cluster.workers, nowhere) as router:
        time.sleep(1.0)
        landed = cluster.route_all(router)
        decisions = router.decisions()
    assert [c for *_, c in decisions] == [0, 0, 0], decisions
    assert len(set(landed.values())) == 1, (landed, decisions)


def test_blocks_on_radixkvs_disk_tier_are_credited_at_the_disk_penalty(tokenizer: Any,
                                                                      tmp_path: Path) -> None:
    """Member A with a disk tier: its prompt pushed out of the pool onto disk is announced in
    STORAGE, and the router credits it at --kv-penalty-disk (not the host's), still sending
    the prompt to A; B's prompt, in B's pool, at the host's."""
    with ExitStack() as stack:
        workers, members = [], []
        for name, disk in (("A", True), ("B", False)):
            worker = StubWorker(name, tokenizer)
            stack.callback(worker.close)
            forwarder = Forwarder()
            stack.callback(forwarder.close)
            replay = f"tcp://127.0.0.1:{free_port()}"
            flags = ("--disk-dir", str(tmp_path), "--disk-capacity-blocks", "64") if disk else ()
            server = stack.enter_context(running_server(
                "--kv-events-endpoint", forwarder.inbound, "--kv-events-replay-endpoint",
                replay, *flags, num_blocks=16, block_size=BLOCK))
            workers.append(worker)
            members.append(Member(server, forwarder, replay))
        ids_a, ids_b = workers[0].ids({"prompt": TEXT_A}), workers[1].ids({"prompt": TEXT_B})
        blocks_a, blocks_b = members[0].store(ids_a), members[1].store(ids_b)
        for i in range(16):  # 16 one-block prompts fill A's pool: TEXT_A goes to disk
            members[0].store([2_000_000 + i] * BLOCK)
        last = ids_a[(blocks_a - 1) * BLOCK:blocks_a * BLOCK]

        def demoted() -> list[int]:
            return [seq for seq, (_, events, _) in members[0].batches()
                    if any(ev["type"] == "BlockStored" and ev["medium"] == "STORAGE"
                           and ev["token_ids"] == last for ev in events)]

        on_disk = max(wait_for(demoted, 10, "A's prompt in STORAGE"))  # type: ignore[arg-type]
        cluster = Cluster(members, workers)
        cluster.published = [on_disk, members[1].published(ids_b)]
        with vllm_router(workers, cluster.sources(), "--kv-penalty-host", "0.8",
                         "--kv-penalty-disk", "0.3") as router:
            cluster.sync(router)
            landed = [cluster.route(router, "/v1/completions", {"prompt": text})
                      for text in (TEXT_A, TEXT_B)]
            decisions = router.decisions()
    assert landed == ["A", "B"], (landed, decisions)
    assert [c for *_, c in decisions] == [host_credit(ids_a, blocks_a, 0.3),
                                          host_credit(ids_b, blocks_b, 0.8)], decisions
