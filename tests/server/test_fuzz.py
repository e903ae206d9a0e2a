"""Fuzz: every RadixKV request message, built with arbitrary field values, against a live server.

Requests go through the raw generated stubs, so any field can hold anything its type allows;
tests/_fuzz_requests.py draws them (wild, coherent with what earlier answers told, or coherent
with one field made wild), for every RPC in the proto. After each example the leases it learned
are released and the server must still serve and pass its integrity check.

    RADIXKV_FUZZ_PROFILE=thorough .venv/bin/python -m pytest -q tests/server/test_fuzz.py  # 2,000
    ... --hypothesis-show-statistics   # which method answered which status, how often

The two fuzz tests run against a plain pool and against a sliding-window pool (window parts
beside the full blocks: Match, Allocate and Insert carry window ids there).

Answers must be OK or a documented status: the codes of radixkv/protocol/errors.py's table, plus
RESOURCE_EXHAUSTED (gRPC's own, for an oversized message), plus DEADLINE_EXCEEDED for the Events
stream, which the fuzzer reads with a short deadline. INTERNAL or UNKNOWN is a failure.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from _fuzz_requests import (
    BLOCKS,
    MAX_MESSAGE,
    MAX_TOKENS,
    NUM_BLOCKS,
    NUM_WINDOWS,
    SERVICE,
    Known,
    learn,
    materialize,
    methods,
    pack,
    requests,
    unpack,
)
from _server import BLOCK_SIZE, running_server
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from radixkv.protocol.errors import ALL_ERRORS
from radixkv.protocol.wire import RETRY_KEY
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

VOCAB = 100_000
DOCUMENTED = {cls.code for cls in ALL_ERRORS} | {"RESOURCE_EXHAUSTED"}
THOROUGH = "thorough" in (os.environ.get("RADIXKV_FUZZ_PROFILE", ""),
                          os.environ.get("HYPOTHESIS_PROFILE", ""))
FUZZ = settings(max_examples=2000 if THOROUGH else 150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    with running_server("--vocab-size", str(VOCAB), "--max-tokens", str(MAX_TOKENS),
                        "--max-message-bytes", str(MAX_MESSAGE), "--event-buffer", "64",
                        num_blocks=NUM_BLOCKS, lease_ttl=3600) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server: Any) -> Iterator[Any]:
    with grpc.insecure_channel(f"unix://{server.socket}") as channel:
        yield radixkv_pb2_grpc.RadixKVStub(channel)


WINDOW = ("--sliding-window", "9", "--window-layers", "0",  # window_blocks 2
          "--num-window-blocks", str(NUM_WINDOWS))


@pytest.fixture(scope="module", params=["full", "window"])
def fuzzed(request: Any, server: Any, stub: Any) -> Iterator[tuple[Any, Any, bool]]:
    """(server, stub, windowed): the plain server above, or one with a sliding-window pool."""
    if request.param == "full":
        yield server, stub, False
        return
    with running_server("--vocab-size", str(VOCAB), "--max-tokens", str(MAX_TOKENS),
                        "--max-message-bytes", str(MAX_MESSAGE), "--event-buffer", "64",
                        *WINDOW, num_blocks=NUM_BLOCKS, lease_ttl=3600) as s, \
            grpc.insecure_channel(f"unix://{s.socket}") as channel:
        yield s, radixkv_pb2_grpc.RadixKVStub(channel), True


# ---- one call --------------------------------------------------------------------------------


def call(stub: Any, method: Any, request: Any) -> tuple[str, list[Any]]:
    """Send `request`; (status code name, answers). The Events stream is read for 50 ms."""
    fn = getattr(stub, method.name)
    try:
        if method.server_streaming:
            answers = []
            stream = fn(request, timeout=0.05)
            with contextlib.suppress(grpc.RpcError):  # its code is read below
                for answer in stream:
                    answers.append(answer)
                    if len(answers) >= 4:
                        break
            stream.cancel()
            code = stream.code()
            if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "OK", answers
            return code.name, answers
        return "OK", [fn(request, timeout=10)]
    except grpc.RpcError as e:
        return e.code().name, []


def shown(request: Any) -> str:
    """The request for a failure report, long byte strings cut short."""
    text = str(request).replace("\n", " ")
    return text if len(text) <= 600 else f"{text[:600]}... ({request.ByteSize()} B)"


def check_answer(method: str, request: Any, answer: Any, epoch: str,
                 windowed: bool = False) -> None:
    """Shape checks of OK answers that every well-formed call must meet."""
    if method == "Match":
        assert answer.epoch == epoch
        assert len(answer.results) == len(request.queries)
        for r in answer.results:
            assert r.lease_id and r.num_tokens % BLOCK_SIZE == 0
            assert len(r.block_ids) // 4 == r.num_tokens // BLOCK_SIZE
    elif method == "Allocate":
        assert answer.epoch == epoch and answer.lease_id
        ids = unpack(answer.block_ids)
        assert len(ids) == request.num_blocks == len(set(ids))
        assert all(0 <= b < NUM_BLOCKS for b in ids)
        wins = unpack(answer.window_ids)
        assert len(wins) == (request.num_window_blocks if windowed else 0) == len(set(wins))
        assert all(NUM_BLOCKS <= w < NUM_BLOCKS + NUM_WINDOWS for w in wins)
    elif method == "Insert":
        assert len(answer.results) == len(request.items)


def cleanup(stub: Any, known: Known) -> None:
    """Release every lease learned in the example, each by its owner, one by one (an id that
    is already gone fails a whole Release)."""
    release = SERVICE.methods_by_name["Release"]
    for lease_id, lease in known.leases.items():
        call(stub, release, pb.ReleaseRequest(client_id=lease.owner, lease_ids=[lease_id]))


def check_server(server: Any, stub: Any) -> Any:
    assert server.alive(), server.output()
    stats = stats_of(stub)
    assert stats.integrity == "ok", stats.integrity
    assert stats.window_blocks in (0, NUM_WINDOWS)
    assert (stats.free_blocks + stats.leased_blocks + stats.cached_blocks + stats.free_window_blocks
            + stats.cached_window_blocks) == NUM_BLOCKS + stats.window_blocks
    return stats


# ---- the tests -------------------------------------------------------------------------------
#
# A failure is recorded and the example runs to its end: what an example draws must not depend
# on the server's answers (hypothesis replays and shrinks by the draws). Each example starts by
# clearing every namespace nothing pins, so a failing one replays against the same state.


def reset(stub: Any) -> None:
    for ns in stub.Stats(pb.StatsRequest(), timeout=10).namespaces:
        call(stub, SERVICE.methods_by_name["Clear"], pb.ClearRequest(namespace=ns.namespace))


def draw_call(data: Any, known: Known) -> tuple[Any, Any]:
    method = data.draw(methods, label="method")
    plan = data.draw(requests(method), label=method.name)(known)
    request = materialize(method.input_type, plan, known)
    note(f"{method.name}({shown(request)})")
    return method, request


@FUZZ
@given(data=st.data())
def test_every_request_gets_ok_or_a_documented_status(fuzzed, data):
    server, stub, windowed = fuzzed
    reset(stub)
    known, problems = Known(windowed=windowed), []
    epoch = stub.PoolInfo(pb.PoolInfoRequest(), timeout=10).epoch
    try:
        for _ in range(data.draw(st.integers(1, 10), label="calls")):
            method, request = draw_call(data, known)
            code, answers = call(stub, method, request)
            event(f"{method.name} {code}")
            if code != "OK" and code not in DOCUMENTED:
                problems.append(f"{method.name} answered {code}: {shown(request)}")
            for answer in answers:
                if method.server_streaming:
                    continue
                try:
                    check_answer(method.name, request, answer, epoch, windowed)
                except AssertionError:
                    problems.append(f"{method.name} answered {shown(answer)} to "
                                    f"{shown(request)}")
                else:
                    learn(known, method.name, request, answer)
    finally:
        cleanup(stub, known)
    assert not problems, "\n".join(problems)
    check_server(server, stub)


STATE = ("free_blocks", "leased_blocks", "cached_blocks", "pinned_blocks", "live_leases",
         "requests", "query_tokens", "hit_tokens", "free_window_blocks", "cached_window_blocks")


def state(stub: Any) -> tuple[Any, ...]:
    s = stub.Stats(pb.StatsRequest(), timeout=10)
    spaces = tuple((n.namespace, n.cached_blocks, n.nodes) for n in s.namespaces)
    return (*(getattr(s, k) for k in STATE), spaces)


def describe(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    names = (*STATE, "namespaces")
    return ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in zip(names, before, after, strict=True)
                     if a != b)


@FUZZ
@given(data=st.data())
def test_failed_calls_change_nothing(fuzzed, data):
    """A call that fails leaves the service as it was: no lease opened (a failed Allocate), no
    part of a Match or Insert batch applied, no namespace made. Leases learned from answers
    are the only ones an example may leave, and cleanup releases them all."""
    server, stub, windowed = fuzzed
    reset(stub)
    known, problems = Known(windowed=windowed), []
    leases_before = stub.Stats(pb.StatsRequest(), timeout=10).live_leases
    try:
        for _ in range(data.draw(st.integers(1, 8), label="calls")):
            method, request = draw_call(data, known)
            before = state(stub)
            code, answers = call(stub, method, request)
            if code != "OK" and code not in DOCUMENTED:
                problems.append(f"{method.name} answered {code}: {shown(request)}")
            for answer in answers:
                if not method.server_streaming:
                    learn(known, method.name, request, answer)
            after = state(stub) if code != "OK" else before
            if after != before:
                problems.append(f"{method.name} failed with {code} but changed "
                                f"{describe(before, after)}: {shown(request)}")
    finally:
        cleanup(stub, known)
    stats = check_server(server, stub)
    if stats.live_leases != leases_before:
        problems.append(f"{stats.live_leases - leases_before} lease(s) no answer named left open")
    assert not problems, "\n".join(problems)


# ---- the failures the fuzzer looks for, each in its smallest form -----------------------------


def stats_of(stub: Any) -> Any:
    """Stats with the integrity check, asked again after the wait the rate limit names."""
    for _ in range(100):
        try:
            return stub.Stats(pb.StatsRequest(check_integrity=True), timeout=10)
        except grpc.RpcError as e:
            retry = dict(e.trailing_metadata() or ()).get(RETRY_KEY)
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or retry is None:
                raise
            time.sleep(float(retry))
    raise AssertionError("the integrity check was refused 100 times")


def code_of(fn: Any, request: Any) -> str:
    try:
        fn(request, timeout=10)
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


def test_failed_allocate_opens_no_lease(stub):
    """Allocate with lease_id 0 that fails (no room) must not leave the new lease behind."""
    hog = stub.Allocate(pb.AllocateRequest(client_id="c", namespace="fuzz-a",
                                           num_blocks=NUM_BLOCKS), timeout=10)
    try:
        before = stats_of(stub).live_leases
        assert code_of(stub.Allocate, pb.AllocateRequest(
            client_id="c", namespace="fuzz-a", num_blocks=1)) == "RESOURCE_EXHAUSTED"
        assert stats_of(stub).live_leases == before
    finally:
        stub.Release(pb.ReleaseRequest(client_id="c", lease_ids=[hog.lease_id]), timeout=10)


def test_failed_insert_batch_changes_nothing(stub):
    """Insert [a good item, a bad item]: the call fails and the good item is not applied."""
    tokens = pack(BLOCKS[2] + BLOCKS[3] + BLOCKS[2])
    m = stub.Match(pb.MatchRequest(client_id="c", queries=[
        pb.MatchQuery(namespace="fuzz-batch", tokens=tokens)]), timeout=10).results[0]
    try:
        ids = stub.Allocate(pb.AllocateRequest(client_id="c", lease_id=m.lease_id,
                                               num_blocks=3 - m.num_tokens // BLOCK_SIZE),
                            timeout=10).block_ids
        before = stats_of(stub)
        good = pb.InsertItem(lease_id=m.lease_id, namespace="fuzz-batch", tokens=tokens,
                             block_ids=m.block_ids + ids)
        bad = pb.InsertItem(lease_id=m.lease_id, namespace="fuzz-batch", tokens=tokens,
                            block_ids=pack([NUM_BLOCKS + 1] * 3))
        assert code_of(stub.Insert, pb.InsertRequest(client_id="c", items=[good, bad])) == \
            "INVALID_ARGUMENT"
        after = stats_of(stub)
        assert (after.cached_blocks, after.leased_blocks) == (before.cached_blocks,
                                                              before.leased_blocks)
    finally:
        stub.Release(pb.ReleaseRequest(client_id="c", lease_ids=[m.lease_id]), timeout=10)


def test_failed_insert_makes_no_namespace(stub):
    """An Insert refused for its block ids must not create the namespace it named (the lease's
    own namespace exists while the lease lives; the refused one must not appear)."""
    lease = stub.Allocate(pb.AllocateRequest(client_id="c", namespace="fuzz-new",
                                             num_blocks=1), timeout=10)
    try:
        before = {n.namespace for n in stats_of(stub).namespaces}
        assert "fuzz-other" not in before
        free = next(b for b in range(NUM_BLOCKS) if b not in unpack(lease.block_ids))
        assert code_of(stub.Insert, pb.InsertRequest(client_id="c", items=[pb.InsertItem(
            lease_id=lease.lease_id, namespace="fuzz-new", tokens=pack(BLOCKS[0]),
            block_ids=pack([free]))])) in ("PERMISSION_DENIED", "ALREADY_EXISTS")
        assert code_of(stub.Insert, pb.InsertRequest(client_id="c", items=[pb.InsertItem(
            lease_id=lease.lease_id, namespace="fuzz-other", tokens=pack(BLOCKS[0]),
            block_ids=lease.block_ids)])) == "PERMISSION_DENIED"
        assert {n.namespace for n in stats_of(stub).namespaces} == before
    finally:
        stub.Release(pb.ReleaseRequest(client_id="c", lease_ids=[lease.lease_id]), timeout=10)


def test_failed_match_batch_opens_no_lease():
    """A Match batch that fails part-way (here: the namespace limit, 1024) opens no lease and
    makes no namespace. Its own server: the batch fills the namespace table."""
    with running_server(num_blocks=8) as s, grpc.insecure_channel(f"unix://{s.socket}") as ch:
        stub = radixkv_pb2_grpc.RadixKVStub(ch)
        queries = [pb.MatchQuery(namespace=f"n{i}", tokens=pack(BLOCKS[0])) for i in range(1100)]
        assert code_of(stub.Match, pb.MatchRequest(client_id="c", queries=queries)) == \
            "RESOURCE_EXHAUSTED"
        stats = stats_of(stub)
        assert (stats.live_leases, len(stats.namespaces)) == (0, 0)
