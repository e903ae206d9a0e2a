"""Fuzz: the router's request messages (radixkv.v1.Router), built with arbitrary field values,
against a live router (a real etcd and two members, one holding cached prompts), as
tests/server/test_fuzz.py does for the service.

Requests: wild (every field over its whole type: any namespace, token bytes of any length and
size up to a max-tokens prompt, any excluded ids), coherent (a cached prompt, a prefix of one,
a prompt nobody holds; excluding a real member or not; probe or not), or coherent with one
field made wild. Answers must be OK, INVALID_ARGUMENT (bad namespace or tokens), UNAVAILABLE
(every member excluded) or RESOURCE_EXHAUSTED (gRPC's own); never INTERNAL or UNKNOWN. An OK
answer ranks healthy members by cost with whole-block cached prefixes no longer than the
prompt; a failed call or a probe changes nothing (the route count, each member's routed
count); a counted one adds one route to the member ranked first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from _fuzz_requests import BLOCKS, pack, texts, wild_namespaces, wild_plan, wild_tokens
from _server import BLOCK_SIZE, tiny_flags
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from radixkv.client import Client
from radixkv.cluster.local import local_cluster
from radixkv.cluster.routed import RouterClient
from radixkv.v1 import router_pb2 as pb
from radixkv.v1 import router_pb2_grpc

NS = "fuzz-a"
OK_CODES = {"OK", "INVALID_ARGUMENT", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}
CACHED = [BLOCKS[0] + BLOCKS[2] + BLOCKS[3], BLOCKS[1] + BLOCKS[1], BLOCKS[2]]
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> Iterator[Any]:
    flags = tiny_flags(str(tmp_path_factory.mktemp("cfg")))
    with local_cluster(2, *flags) as c:
        with Client(c.members["n0"].socket) as kv:
            for p in CACHED:
                tokens = list(p)
                with kv.lease(NS, tokens) as lease:
                    lease.insert(tokens, lease.block_ids + lease.new_block_ids, release=True)
        with RouterClient(c.router) as rc:
            rc.wait_members(2)
            for _ in range(200):  # the index has every cached block
                if rc.members()["members"][0].get("indexed_blocks") == 6:
                    break
                time.sleep(0.05)
        yield c


@pytest.fixture(scope="module")
def stub(router: Any) -> Iterator[Any]:
    with grpc.insecure_channel(router.router) as channel:
        yield router_pb2_grpc.RouterStub(channel)


# ---- requests --------------------------------------------------------------------------------

prompts = st.one_of(
    st.sampled_from(CACHED).map(list),  # cached on n0
    st.tuples(st.sampled_from(CACHED), st.integers(1, 3)).map(
        lambda t: list(t[0][:t[1] * BLOCK_SIZE + 1])),  # a prefix, maybe with a partial block
    st.lists(st.integers(0, 99), min_size=1, max_size=4 * BLOCK_SIZE))  # nobody's
excludes = st.lists(st.sampled_from(["n0", "n1", "n9", ""]), max_size=3)


def coherent_route() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"namespace": st.sampled_from([NS, "fuzz-b"]),
                                  "tokens": prompts.map(pack), "exclude": excludes,
                                  "probe": st.booleans()})


WILD_FIELD = {"namespace": wild_namespaces, "tokens": wild_tokens,
              "exclude": st.lists(st.one_of(texts, st.sampled_from(["n0", "n1"])), max_size=4),
              "probe": st.booleans()}


@st.composite
def route_requests(draw: Any) -> pb.RouteRequest:
    kind = draw(st.sampled_from(["wild", "coherent", "mutated"]))
    if kind == "wild":
        fields = draw(wild_plan(pb.RouteRequest.DESCRIPTOR))
    else:
        fields = draw(coherent_route())
        if kind == "mutated":
            name = draw(st.sampled_from(sorted(WILD_FIELD)))
            fields[name] = draw(WILD_FIELD[name])
    return pb.RouteRequest(**fields)


def call(stub: Any, name: str, request: Any) -> tuple[str, Any]:
    try:
        return "OK", getattr(stub, name)(request, timeout=10)
    except grpc.RpcError as e:
        return e.code().name, None


def counters(stub: Any) -> tuple[int, dict[str, int]]:
    m = stub.Members(pb.MembersRequest(), timeout=10)
    return m.routes, {s.node_id: s.routed for s in m.members}


def shown(request: Any) -> str:
    text = str(request).replace("\n", " ")
    return text if len(text) <= 400 else f"{text[:400]}... ({request.ByteSize()} B)"


def check_answer(request: Any, answer: Any) -> None:
    n_tokens = len(request.tokens) // 4
    assert answer.block_size == BLOCK_SIZE
    names = [m.node_id for m in answer.members]
    assert names and not set(names) & set(request.exclude), names
    assert set(names) <= {"n0", "n1"}
    assert [m.cost for m in answer.members] == sorted(m.cost for m in answer.members)
    for m in answer.members:
        assert m.cached_tokens % BLOCK_SIZE == 0 and m.cached_tokens <= n_tokens
        assert m.cost == n_tokens - m.cached_tokens + BLOCK_SIZE * m.load
    if request.namespace == NS and list(request.tokens) and "n0" in names:
        held = {m.node_id: m.cached_tokens for m in answer.members}
        tokens = list(memoryview(request.tokens).cast("I"))
        want = max((i for p in CACHED for i in range(0, len(p) + 1, BLOCK_SIZE)
                    if i <= len(tokens) and tokens[:i] == list(p[:i])), default=0)
        assert held["n0"] == want, (held, want)


# ---- the tests -------------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_every_route_gets_ok_or_a_documented_status_and_a_failed_one_changes_nothing(
        stub, data):
    problems = []
    for _ in range(data.draw(st.integers(1, 6), label="calls")):
        request = data.draw(route_requests(), label="Route")
        note(f"Route({shown(request)})")
        before = counters(stub)
        code, answer = call(stub, "Route", request)
        event(f"Route {code}")
        after = counters(stub)
        if code not in OK_CODES:
            problems.append(f"Route answered {code}: {shown(request)}")
        if code != "OK" or request.probe:
            if after != before:
                problems.append(f"Route {code} (probe {request.probe}) changed the counters "
                                f"{before} -> {after}: {shown(request)}")
            if code != "OK":
                continue
        try:
            check_answer(request, answer)
        except AssertionError as e:
            problems.append(f"Route answered {shown(answer)} to {shown(request)}: {e}")
        if not request.probe:
            first = answer.members[0].node_id
            want = (before[0] + 1, {**before[1], first: before[1][first] + 1})
            if after != want:
                problems.append(f"a counted Route moved the counters {before} -> {after}, "
                                f"not to {want}")
    assert not problems, "\n".join(problems)


@settings(max_examples=30, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=wild_plan(pb.MembersRequest.DESCRIPTOR))
def test_members_answers_any_request(stub, fields):
    code, answer = call(stub, "Members", pb.MembersRequest(**fields))
    assert code == "OK"
    assert {m.node_id for m in answer.members} == {"n0", "n1"}
