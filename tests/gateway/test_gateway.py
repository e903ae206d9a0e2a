"""`radixkv gateway` in a subprocess in front of stub engine servers (tests/gateway/
_stub_engine.py): routing by the members' cached prefixes (real members and etcd), failover,
OpenAI-shaped errors, token auth, streaming passed through unbuffered, and a clean SIGTERM."""

from __future__ import annotations

import http.client
import json
import shutil
import time
from urllib.parse import urlsplit

import pytest
from _gateway import call, gateway, stub_engines, wait_ready
from _server import tiny_flags

from radixkv.client import Client
from radixkv.cluster.local import local_cluster

NS = "vllm:test-model@main/bf16"


def words(start: int, n: int) -> str:
    return " ".join(f"w{start + i}" for i in range(n))


def chat(system: str, *turns: str) -> list[dict[str, str]]:
    """A system message, then user / assistant turns alternating."""
    roles = ["user", "assistant"]
    return [{"role": "system", "content": system},
            *({"role": roles[i % 2], "content": t} for i, t in enumerate(turns))]


needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None,
                                reason="etcd is not installed (apt-get install etcd-server; "
                                "scripts/bootstrap --tests does it)")


@pytest.mark.slow
@needs_etcd
def test_a_conversation_goes_to_the_engine_whose_member_holds_its_prefix(tmp_path,
                                                                         tokenizer_dir):
    """Members a and b advertise their engines in etcd (serve --engine-url); a's member holds
    conversation 1's first turn and b's conversation 2's: each second turn goes to the engine
    beside the member holding its first, whatever the order, and the metrics say why."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    first = {1: chat(words(0, 40), words(100, 20)), 2: chat(words(500, 40), words(600, 20))}
    with stub_engines("a", "b") as stubs, \
            local_cluster(0, *tiny_flags(str(tmp_path), 64), router=False) as c:
        for node, conv in (("a", 1), ("b", 2)):
            c.start_member(node, "--engine-url", stubs[node].url)
            ids = tok.apply_chat_template(first[conv], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            with Client(c.socket_of(node)) as kv, kv.lease(NS, ids) as lease:
                lease.insert(ids, lease.new_block_ids, release=True)
        with gateway(tokenizer_dir, "--cluster", c.etcd.url, "--namespace", NS) as g:
            wait_ready(g.url, 2)
            served = {}
            for conv in (2, 1, 2, 1):
                messages = [*first[conv], {"role": "assistant", "content": words(900, 8)},
                            {"role": "user", "content": words(950 + conv, 10)}]
                deadline = time.monotonic() + 20  # until the index has both members' events
                while True:
                    status, headers, body = call(g.url + "/v1/chat/completions",
                                                 {"model": "stub-model", "messages": messages})
                    assert status == 200, body
                    served[conv] = headers["x-radixkv-engine"]
                    if served[conv] == {1: "a", 2: "b"}[conv] or time.monotonic() > deadline:
                        break
                    time.sleep(0.3)
                assert served[conv] == {1: "a", 2: "b"}[conv]
            _, _, metrics = call(g.url + "/metrics")
    assert 'radixkv_gateway_route_decisions_total{engine="a",reason="prefix"}' in metrics
    assert 'radixkv_gateway_route_decisions_total{engine="b",reason="prefix"}' in metrics


def test_a_dead_engine_mid_stream_fails_that_request_and_the_next_goes_elsewhere(
        tokenizer_dir):
    with stub_engines("a", "b") as stubs, gateway(
            tokenizer_dir, "--engine", f"{stubs['a'].url}=a", "--engine",
            f"{stubs['b'].url}=b") as g:
        wait_ready(g.url, 2)
        # no member holds anything: a tie, broken by the URL
        first, other = sorted(stubs, key=lambda n: stubs[n].url)
        status, headers, _ = call(g.url + "/v1/completions", {"prompt": "w1 w2"})
        assert status == 200 and headers["x-radixkv-engine"] == first
        status, headers, text = call(g.url + "/v1/completions",
                                     {"prompt": "w1 die", "stream": True})
        assert status == 200 and headers["x-radixkv-engine"] == first
        events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
        assert events[0]["engine"] == first
        assert events[-1]["error"]["code"] == 502 and "mid-stream" in \
            events[-1]["error"]["message"]
        assert "[DONE]" not in text
        for _ in range(3):
            status, headers, body = call(g.url + "/v1/completions", {"prompt": "w1 w2"})
            assert status == 200 and headers["x-radixkv-engine"] == other, body
        _, _, metrics = call(g.url + "/metrics")
        assert f'radixkv_gateway_upstream_errors_total{{engine="{first}"}} 1.0' in metrics
        status, _, health = call(g.url + "/health")
        assert status == 200 and health == {"engines": 2, "engines_up": 1}


def test_an_engine_that_refuses_connections_is_skipped_for_the_next(tokenizer_dir):
    with stub_engines("b") as stubs:
        dead = "http://127.0.0.1:9"  # discard port: nothing listens
        with gateway(tokenizer_dir, "--engine", f"{dead}=a", "--engine",
                     f"{stubs['b'].url}=b") as g:
            wait_ready(g.url, 1)
            for _ in range(3):
                status, headers, _ = call(g.url + "/v1/completions", {"prompt": "w1"})
                assert status == 200 and headers["x-radixkv-engine"] == "b"


def test_bad_requests_get_openai_shaped_errors(tokenizer_dir, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("gw-s3cret-0123456789\n")
    with stub_engines("a", max_model_len=64) as stubs, gateway(
            tokenizer_dir, "--engine", f"{stubs['a'].url}=a", "--auth-token-file",
            str(token_file)) as g:
        tok = "gw-s3cret-0123456789"
        status, _, _ = call(g.url + "/health")
        assert status in (200, 503)  # open without the token
        wait_ready(g.url, 1)
        url = g.url + "/v1/completions"
        cases = [
            (call(url, {"prompt": "w1"}), 401, "AuthenticationError"),
            (call(url, {"prompt": "w1"}, token="wrong"), 401, "AuthenticationError"),
            (call(url, raw=b"{not json", token=tok), 400, "BadRequestError"),
            (call(url, [1, 2], token=tok), 400, "BadRequestError"),
            (call(url, {"prompt": ""}, token=tok), 400, "BadRequestError"),
            (call(url, {"prompt": words(0, 64)}, token=tok), 400, "BadRequestError"),
            (call(url, {"model": "nope", "prompt": "w1"}, token=tok), 404, "NotFoundError"),
            (call(g.url + "/v1/chat/completions", {"messages": "hi"}, token=tok), 400,
             "BadRequestError"),
            (call(g.url + "/v1/models"), 401, "AuthenticationError"),
        ]
        for (status, _, body), want_status, kind in cases:
            assert status == want_status, (want_status, kind, body)
            assert body["error"]["type"] == kind and body["error"]["code"] == want_status
            assert body["error"]["message"]
        assert "maximum context length is 64" in cases[5][0][2]["error"]["message"]
        status, _, body = call(url, {"model": "stub-model", "prompt": words(0, 63)}, token=tok)
        assert status == 200, body
        status, _, models = call(g.url + "/v1/models", token=tok)
        assert status == 200 and [m["id"] for m in models["data"]] == ["stub-model"]
        assert models["data"][0]["max_model_len"] == 64
        _, _, metrics = call(g.url + "/metrics", token=tok)
        assert 'radixkv_gateway_requests_total{path="/v1/completions",status="401"} 2.0' \
            in metrics


def held_stream(url: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed completion the stub engine holds after its first event."""
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "w1 hold", "stream": True}),
                 {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_streaming_is_passed_through_unbuffered(tokenizer_dir):
    """The engine sends its first event and waits: the caller reads that event through the
    gateway while the engine still holds the rest."""
    with stub_engines("a") as stubs, gateway(tokenizer_dir, "--engine",
                                             f"{stubs['a'].url}=a") as g:
        wait_ready(g.url, 1)
        conn, response = held_stream(g.url)
        assert response.status == 200
        assert response.getheader("Content-Type").startswith("text/event-stream")
        first = response.readline()  # the first event's line, before the engine goes on
        assert first.startswith(b"data: {") and b'"engine": "a"' in first
        status, _, _ = call(stubs["a"].url + "/release", raw=b"", method="POST")
        assert status == 200
        rest = response.read()
        assert rest.rstrip().endswith(b"data: [DONE]")
        conn.close()


def test_sigterm_stops_the_gateway_cleanly_with_a_stream_open(tokenizer_dir):
    """SIGTERM with an answer under way: the gateway gives it its grace, cuts it and exits 0."""
    with stub_engines("a") as stubs:
        with gateway(tokenizer_dir, "--engine", f"{stubs['a'].url}=a") as g:
            wait_ready(g.url, 1)
            conn, response = held_stream(g.url)
            assert response.readline().startswith(b"data: {")
            started = time.monotonic()
            assert g.stop() == 0
            assert time.monotonic() - started < 15
            conn.close()
