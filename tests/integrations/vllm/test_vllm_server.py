"""The connector in vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, the
vLLM venv), with a real radixkv server and the real model: a chat's second turn reuses the first
turn's prompt and answer; a store whose lease expires while the engine runs a long prefill
inserts nothing wrong; `radixkv gateway` in front of it passes chats through unchanged.

One API server (its own process group, on loopback and a free port) serves both tests, started
and stopped here; vLLM's own prefix cache is off (every hit is radixkv's) and prefills run in
chunks of 256 tokens. radixkv is restarted under it between the tests (the connector remaps).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _gateway import call, gateway, wait_ready

from radixkv.client import Client
from radixkv.server.launch import ServerProcess, start_server

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
BLOCK = 128
CHUNK = 256  # --max-num-batched-tokens: a long prompt prefills over several steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApiServer:
    """vLLM's OpenAI server in its own process group; `stop` checks that the group is gone."""

    def __init__(self, model: str, connector: dict[str, Any], log: Path) -> None:
        if not VLLM_PYTHON.exists():
            pytest.fail(f"{VLLM_PYTHON} is missing: run `bash scripts/bootstrap_vllm`")
        self.model, self.log, self.port = model, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND="0", PYTHONPATH=str(REPO))
        self._out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
             "--enforce-eager", "--max-model-len", "2048", "--no-enable-prefix-caching",
             "--max-num-batched-tokens", str(CHUNK),
             "--kv-transfer-config", json.dumps(connector)],
            stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                self._out.close()
                raise AssertionError(f"the API server exited {self.proc.returncode}:\n"
                                     f"{self.output()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the API server did not come up:\n{self.output()[-4000:]}")
            time.sleep(1)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return dict(json.loads(r.read()))

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        answer = self.post("/v1/chat/completions", {
            "model": self.model, "messages": messages, "max_tokens": max_tokens,
            "min_tokens": max_tokens, "temperature": 0})
        return str(answer["choices"][0]["message"]["content"])

    def complete(self, tokens: list[int], max_tokens: int = 8) -> str:
        answer = self.post("/v1/completions", {"model": self.model, "prompt": tokens,
                                               "max_tokens": max_tokens, "temperature": 0})
        return str(answer["choices"][0]["text"])

    def count(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.post("/tokenize", {"model": self.model, "messages": messages})["tokens"])

    def external_hits(self) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(m.group(1)) for m in re.finditer(
            r"^vllm:external_prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text, re.M))

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM; the server and its engine process must be gone within 60 s."""
        pgid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._out.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)
        os.killpg(pgid, signal.SIGKILL)
        raise AssertionError("the API server left processes behind after SIGTERM")


class Setup:
    def __init__(self, model: str, directory: Path) -> None:
        self.model, self.dir = model, directory
        self.socket = str(directory / "rkv.sock")
        self.server: ServerProcess | None = None
        self.api: ApiServer | None = None

    def serve(self, *flags: str) -> None:
        if self.server is not None:
            self.server.stop()
        self.server = start_server(self.socket, "--model-config",
                                   str(Path(self.model) / "config.json"), "--dtype", "bf16",
                                   "--block-size", str(BLOCK), "--num-blocks", "64", *flags)

    def stats(self) -> dict[str, Any]:
        with Client(self.socket) as c:
            return c.stats()

    def total(self, key: str) -> int:
        return int(sum(ns[key] for ns in self.stats()["namespaces"]))

    def wait_blocks(self, blocks: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.total("cached_blocks") < blocks:
            assert time.monotonic() < deadline, f"radixkv holds {self.total('cached_blocks')}"
            time.sleep(0.1)

    def block_bytes(self, tokens: list[int]) -> list[bytes]:
        """The bytes of the cached whole blocks of `tokens` (all namespaces are vLLM's one)."""
        with Client(self.socket) as c:
            namespaces = [ns["namespace"] for ns in c.stats()["namespaces"]]
            if not namespaces:
                return []
            with c.lease(namespaces[0], tokens, ttl=60.0, store_tokens=0) as lease:
                view = lease.view()
                return [view[b].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                        for b in lease.block_ids]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from radixkv.engines import models

    model = str(models.ensure_converted(models.get_spec(models.REAL_MODEL))[0])
    s = Setup(model, tmp_path_factory.mktemp("vllm-api"))
    s.serve()
    connector = {"kv_connector": "RadixKVConnector",
                 "kv_connector_module_path": "radixkv.integrations.vllm",
                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"socket": s.socket, "retry_s": 0.5}}
    try:
        s.api = ApiServer(model, connector, s.dir / "api.log")
        yield s
    finally:
        if s.api is not None:
            s.api.stop()
        if s.server is not None:
            s.server.stop()


NOTES = ("The shop opens at nine. Deliveries come on Tuesday and Friday. The blue van needs new "
         "tyres before winter. Anna keeps the keys to the back door. Invoices go out on the "
         "first day of each month, and the garden behind the shop is watered every evening. ")


def test_chat_turn_two_reuses_turn_one_prompt_and_answer(setup: Setup) -> None:
    """Turn 1's prompt ends 20 tokens before a block boundary and its answer is 40 tokens: the
    block across the boundary holds both, so turn 2 loading 3 blocks (vLLM's external hits,
    radixkv's hit counter) loads part of turn 1's answer."""
    api = setup.api
    assert api is not None
    user = {"role": "user", "content": "Which day do deliveries come? Answer in detail."}
    target = 3 * BLOCK - 20
    system = "You keep notes for a small shop. " + NOTES * 2
    while len(api.count([{"role": "system", "content": system}, user])) > target:
        system = system[:-40]
    pad = target - len(api.count([{"role": "system", "content": system}, user]))
    system += " ok" * pad  # one token each
    turn1 = [{"role": "system", "content": system}, user]
    prompt1 = api.count(turn1)
    assert len(prompt1) == target, len(prompt1)
    answer = api.chat(turn1, max_tokens=40)
    setup.wait_blocks(3)  # stored at the request's end: prompt + answer, 3 whole blocks
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And who keeps the keys?"}]
    assert api.count(turn2)[:target] == prompt1
    hits0, ext0 = setup.total("hit_tokens"), api.external_hits()
    api.chat(turn2, max_tokens=8)
    assert api.external_hits() - ext0 == 3 * BLOCK  # > len(prompt1): part of the answer too
    assert setup.total("hit_tokens") - hits0 >= 3 * BLOCK


def two_requests(api: ApiServer, first: list[int], second: list[int]) -> dict[str, str]:
    """`first` (2 tokens), then `second` (8 tokens) while `first` still prefills: `first` ends
    as `second`'s prefill starts, so the step after its end runs a chunk of `second`."""
    answers: dict[str, str] = {}
    worker = threading.Thread(target=lambda: answers.update(first=api.complete(first, 2)))
    worker.start()
    time.sleep(0.3)
    answers["second"] = api.complete(second, 8)
    worker.join(300)
    return answers


def test_lease_expiring_during_a_long_prefill_inserts_no_wrong_kv(setup: Setup) -> None:
    """radixkv with a 0.05 s lease TTL. A request's store is planned at its end from the lookup
    table and runs after the next step's forward, here a 256-token prefill chunk of another
    request: the worker's Match with allocation takes the lease then and renews it for its copy
    (with `lookup: match` the scheduler's lease outlasts its TTL instead, and the worker stores
    nothing: tests/integrations/vllm/test_vllm_table.py). Whatever radixkv stored is
    byte-identical to a clean run's (the same two requests, default TTL), and the answers are
    the clean run's."""
    api = setup.api
    assert api is not None
    first = [100 + (i * 7919) % 30000 for i in range(6 * BLOCK + 40)]
    second = [200 + (i * 104729) % 30000 for i in range(5 * BLOCK + 30)]
    setup.serve()  # a fresh radixkv with the default TTL: the clean run
    time.sleep(0.6)  # the connector's retry_s
    clean = two_requests(api, first, second)
    setup.wait_blocks(11)
    reference = {"first": setup.block_bytes(first), "second": setup.block_bytes(second)}
    assert [len(v) for v in reference.values()] == [6, 5]
    setup.serve("--lease-ttl", "0.05")  # leases of 0.05 s, swept every 0.05 s
    time.sleep(0.6)
    answers = two_requests(api, first, second)
    time.sleep(1.0)  # a store runs a step after its request's end
    assert answers == clean
    for name, tokens in (("first", first), ("second", second)):
        stored = setup.block_bytes(tokens)
        assert stored == reference[name][:len(stored)]


def test_the_gateway_passes_chats_to_the_server_unchanged(setup: Setup) -> None:
    """`radixkv gateway` in front of the API server: a chat answered through it equals the
    server's own answer, whole and streamed (the streamed chunks joined), with the engine named
    in x-radixkv-engine; /v1/models carries the server's context; a prompt past it is refused
    by the gateway with vLLM's 400."""
    api = setup.api
    assert api is not None
    messages = [{"role": "system", "content": "You keep notes for a small shop. " + NOTES},
                {"role": "user", "content": "When do deliveries come?"}]
    body = {"model": api.model, "messages": messages, "max_tokens": 12, "temperature": 0}
    direct = api.post("/v1/chat/completions", body)["choices"][0]["message"]["content"]
    with gateway(api.model, "--engine", f"{api.url}=n0") as g:
        wait_ready(g.url, 1)
        status, headers, answer = call(g.url + "/v1/chat/completions", body)
        assert status == 200 and headers["x-radixkv-engine"] == "n0"
        assert answer["choices"][0]["message"]["content"] == direct
        status, headers, events = call(g.url + "/v1/chat/completions", {**body, "stream": True})
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        chunks = [json.loads(line[6:]) for line in events.splitlines()
                  if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"]) == direct
        assert events.rstrip().endswith("data: [DONE]")
        status, _, models = call(g.url + "/v1/models")
        assert status == 200 and models["data"][0]["max_model_len"] == 2048
        long = {**body, "messages": [{"role": "user", "content": "ok " * 2100}]}
        status, _, refused = call(g.url + "/v1/chat/completions", long)
        assert status == 400 and "maximum context length is 2048" in refused["error"]["message"]
