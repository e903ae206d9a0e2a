"""The cluster, end to end: a real etcd (started here on loopback, temp data dir), members
(`radixkv serve --cluster`) and routers (`radixkv router`) in subprocesses, driven through the
public surface (Client, RouterClient, RoutedClient, the CLI)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from _server import BLOCK_SIZE, wait_for

from radixkv.client import Client
from radixkv.cluster.follower import snapshot_hashes
from radixkv.cluster.local import local_cluster
from radixkv.cluster.routed import RoutedClient, RouterClient
from radixkv.protocol.errors import InvalidArgument, Unavailable
from radixkv.rpc.etcd import Etcd, EtcdTarget
from radixkv.rpc.membership import member_key

TTL = 2  # the members' --cluster-ttl
NS = "chat@rev1"


@pytest.fixture
def cluster(flags):
    with local_cluster(3, *flags, cluster_ttl=TTL) as c:
        with RouterClient(c.router) as rc:
            rc.wait_members(3)
        yield c


def prompt(head: int, blocks: int = 3) -> list[int]:
    return [head * 1000 + i for i in range(blocks * BLOCK_SIZE)]


def store(socket: str, tokens: list[int], namespace: str = NS) -> None:
    with Client(socket) as kv, kv.lease(namespace, tokens) as lease:
        lease.insert(tokens, lease.block_ids + lease.new_block_ids, release=True)


def routes(rc: RouterClient, tokens: list[int], namespace: str = NS) -> list[tuple[str, int]]:
    return [(m.node_id, m.cached_tokens)
            for m in rc.route(namespace, tokens, probe=True).members]


def members(rc: RouterClient) -> dict[str, dict]:
    return {m["node_id"]: m for m in rc.members()["members"]}


def index_agrees(rc: RouterClient, c) -> bool:
    """The router's index holds for each member exactly the blocks of its DumpTree."""
    status = members(rc)
    for node, server in c.members.items():
        if not server.alive():
            continue
        with Client(server.socket) as kv:
            spaces = [n["namespace"] for n in kv.stats()["namespaces"]]
            want = sum(len(snapshot_hashes(ns, kv.dump_tree(ns)[0], BLOCK_SIZE))
                       for ns in spaces)
        if status[node]["state"] != "indexed" or status[node]["indexed_blocks"] != want:
            return False
    return True


def test_routing_follows_cached_prefixes_and_two_routers_agree(cluster):
    c = cluster
    store(c.members["n1"].socket, prompt(1))
    store(c.members["n2"].socket, prompt(2))
    store(c.members["n2"].socket, prompt(1)[:2 * BLOCK_SIZE])  # n2 holds 2 of its 3 blocks
    with RouterClient(c.router) as rc:
        wait_for(lambda: index_agrees(rc, c), what="the index to catch up")
        asked = prompt(1) + [7, 8]  # 3 cached blocks + a partial one
        assert routes(rc, asked) == [("n1", 12), ("n2", 8), ("n0", 0)]
        assert routes(rc, prompt(2))[0] == ("n2", 12)
        answer = rc.route(NS, asked, probe=True)
        assert answer.namespace_known and answer.block_size == BLOCK_SIZE
        assert [m.cost for m in answer.members] == [2.0, 6.0, 14.0]  # uncached, load 0
        # a router started now builds the same index from DumpTree alone
        second = c.start_router()
        with RouterClient(second.address) as rc2:
            rc2.wait_members(3)
            wait_for(lambda: index_agrees(rc2, c), what="the second router's index")
            for tokens in (asked, prompt(2), prompt(3)):
                assert routes(rc2, tokens) == routes(rc, tokens)
        # the routed client: ask the router, then Match on the member itself
        with RoutedClient(c.router) as routed:
            node, kv = routed.choose(NS, asked)
            assert node == "n1"
            assert kv.match(NS, asked).num_tokens == 12


def test_a_killed_member_is_dropped_within_ttl_and_requests_keep_flowing(cluster):
    c = cluster
    store(c.members["n0"].socket, prompt(5))
    with RouterClient(c.router) as rc, RoutedClient(c.router) as routed:
        wait_for(lambda: routes(rc, prompt(5))[0] == ("n0", 12), what="n0 indexed")
        c.members["n0"].stop(signal.SIGKILL)
        # the bound: dropped within the TTL + 1 s
        wait_for(lambda: "n0" not in members(rc), timeout=TTL + 1.0, what="n0 dropped")
        for _ in range(6):  # requests go on, to the others
            node, kv = routed.choose(NS, prompt(5))
            assert node in ("n1", "n2")
            store(c.members[node].socket, prompt(5))
        assert {n for n, _ in routes(rc, prompt(5))} == {"n1", "n2"}


def test_clean_stop_deregisters_at_once_and_a_restart_is_reindexed(cluster):
    c = cluster
    etcd = Etcd(EtcdTarget.parse(c.etcd.url))
    store(c.members["n2"].socket, prompt(7))
    with RouterClient(c.router) as rc:
        wait_for(lambda: routes(rc, prompt(7))[0] == ("n2", 12), what="n2 indexed")
        old_epoch = members(rc)["n2"]["epoch"]
        assert c.members["n2"].stop() == 0
        assert etcd.get(member_key(EtcdTarget.parse(c.etcd.url), "n2")) is None
        wait_for(lambda: "n2" not in members(rc), what="n2 gone")
        c.start_member("n2")  # same socket, new pool: a new epoch, nothing cached
        store(c.members["n2"].socket, prompt(8))
        wait_for(lambda: members(rc).get("n2", {}).get("state") == "indexed"
                 and members(rc)["n2"]["epoch"] != old_epoch, what="n2 back")
        wait_for(lambda: index_agrees(rc, c), what="n2 re-indexed")
        assert dict(routes(rc, prompt(7)))["n2"] == 0  # the old epoch's blocks are gone
        assert routes(rc, prompt(8))[0] == ("n2", 12)
    etcd.close()


def test_a_router_that_missed_events_resyncs_and_agrees_with_dumptree(flags):
    big = tuple(f if f != "32" else "64" for f in flags)  # room for 60-block prompts
    with local_cluster(2, *big, "--event-buffer", "2", cluster_ttl=TTL) as c:
        with RouterClient(c.router) as rc:
            rc.wait_members(2)
            router = c.routers[0].proc
            heads = []
            for _ in range(5):
                # stopped, the router reads nothing; once the stream's transport buffers are
                # full the member's buffer of 2 events moves past what the router has read
                router.send_signal(signal.SIGSTOP)
                try:
                    for _ in range(100):
                        heads.append(200 + len(heads))
                        store(c.members["n0"].socket, prompt(heads[-1], 60))
                finally:
                    router.send_signal(signal.SIGCONT)
                if wait_for(lambda: members(rc)["n0"]["resyncs"] > 1 or
                            members(rc)["n0"]["events_applied"] >= 2 * len(heads) - 1,
                            what="the router to read on") and members(rc)["n0"]["resyncs"] > 1:
                    break
            assert members(rc)["n0"]["resyncs"] > 1, "the router never lagged"
            wait_for(lambda: index_agrees(rc, c), what="the index to agree with DumpTree")
            with Client(c.members["n0"].socket) as kv:
                for head in heads[-20:]:
                    tokens = prompt(head, 60)
                    held = kv.match(NS, tokens)
                    kv.release(held.lease_id)
                    assert dict(routes(rc, tokens))["n0"] == held.num_tokens


def test_etcd_restarted_empty_under_a_running_cluster(cluster):
    c = cluster
    store(c.members["n1"].socket, prompt(9))
    with RouterClient(c.router) as rc:
        wait_for(lambda: routes(rc, prompt(9))[0] == ("n1", 12), what="n1 indexed")
        before = routes(rc, prompt(9))
        c.etcd.restart(wipe=True)  # every key and lease gone
        # before the members register again the router keeps them and their index
        assert routes(rc, prompt(9)) == before
        etcd = Etcd(EtcdTarget.parse(c.etcd.url))
        prefix = EtcdTarget.parse(c.etcd.url).members_prefix
        wait_for(lambda: len(etcd.get_prefix(prefix)[0]) == 3, what="members re-registered")
        etcd.close()
        wait_for(lambda: len(members(rc)) == 3
                 and all(m["state"] == "indexed" for m in members(rc).values()),
                 what="the router to see them all")
        assert routes(rc, prompt(9)) == before
        assert all(m["resyncs"] == 1 for m in members(rc).values())  # nothing was rebuilt
        assert all(s.alive() for s in c.members.values())


def test_bad_input_gets_precise_statuses(cluster, flags):
    c = cluster
    with RouterClient(c.router) as rc:
        unknown = rc.route("never-used", prompt(1), probe=True)
        assert not unknown.namespace_known
        assert {m.cached_tokens for m in unknown.members} == {0}
        with pytest.raises(InvalidArgument, match="must not be empty"):
            rc.route(NS, [], probe=True)
        with pytest.raises(InvalidArgument, match="printable"):
            rc.route("has space", prompt(1), probe=True)
        with pytest.raises(InvalidArgument, match="namespace must not be empty"):
            rc.route("", prompt(1), probe=True)
        with pytest.raises(Unavailable, match="no member to route to"):
            rc.route(NS, prompt(1), exclude=["n0", "n1", "n2"], probe=True)
        # a member that advertises an address nobody can reach: listed, never routed to
        c.start_member("ghost", "--advertise", "unix:///nonexistent-rkv/ghost.sock")
        ghost = wait_for(lambda: members(rc).get("ghost", {}).get("state") == "unreachable"
                         and members(rc)["ghost"], what="ghost unreachable")
        assert "nonexistent-rkv" in ghost["error"]
        assert "ghost" not in {m.node_id for m in rc.route(NS, prompt(1), probe=True).members}
        with pytest.raises(Unavailable, match="ghost unreachable"):
            rc.route(NS, prompt(1), exclude=["n0", "n1", "n2"], probe=True)
    # serve: --cluster without --node-id, and an etcd nobody runs
    base = [sys.executable, "-m", "radixkv", "serve", *flags]
    out = subprocess.run([*base, "--socket", os.path.join(c.directory, "x.sock"),
                          "--cluster", c.etcd.url], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--cluster needs --node-id" in out.stderr
    out = subprocess.run([*base, "--socket", os.path.join(c.directory, "y.sock"),
                          "--cluster", "etcd://127.0.0.1:1", "--node-id", "y"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "etcd at 127.0.0.1:1" in out.stderr
    assert not os.path.exists(os.path.join(c.directory, "y.sock"))


def test_cli_route_and_inspect_router(cluster):
    c = cluster
    store(c.members["n0"].socket, prompt(4))
    cli = [sys.executable, "-m", "radixkv"]
    with RouterClient(c.router) as rc:
        wait_for(lambda: routes(rc, prompt(4))[0] == ("n0", 12), what="n0 indexed")
    out = subprocess.run([*cli, "route", "--router", c.router, NS, *map(str, prompt(4)),
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["members"][0]["node_id"] == "n0"
    assert answer["members"][0]["cached_tokens"] == 12
    out = subprocess.run([*cli, "inspect", "--router", c.router, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    status = {m["node_id"]: m for m in json.loads(out.stdout)["members"]}
    assert set(status) == {"n0", "n1", "n2"}
    assert status["n0"]["indexed_blocks"] == 3 and status["n0"]["state"] == "indexed"
    out = subprocess.run([*cli, "inspect", "--router", c.router], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0 and "indexed" in out.stdout


def test_replay_over_a_cluster_survives_a_killed_member():
    cli = [sys.executable, "-m", "radixkv", "replay", "--requests", "300", "--nodes", "3",
           "--capacity-blocks", "300", "--clients", "2", "--kill-member-after", "100", "--json"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout)
    assert d["mismatches"] == 0 and d["verified_blocks"] > 0
    assert d["num_requests"] == 300 and d["cluster"]["killed"] == ["n0"]
    assert sum(d["requests_per_node"].values()) == 300
    assert d["route_p50_us"] > 0 and d["match_p50_us"] > 0
    assert d["token_hit_rate"] > 0


def test_etcd_starts_on_other_ports_when_a_free_one_was_taken_meanwhile(monkeypatch):
    """A port found free can be taken before etcd binds it (another test's etcd, any
    process): etcd_process starts again on fresh ports instead of failing."""
    import socket

    from radixkv.cluster import local

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        real, handed = local.free_port, iter([port])
        monkeypatch.setattr(local, "free_port", lambda: next(handed, None) or real())
        with local.etcd_process() as e:
            assert e.client_port != port
            etcd = Etcd(EtcdTarget.parse(e.url), timeout=5.0)
            try:
                etcd.put(b"/radixkv/t", b"1")
                assert etcd.get(b"/radixkv/t") == b"1"
            finally:
                etcd.close()


def test_round_robin_replay_with_peer_fetch_survives_a_killed_member():
    """Round-robin over 3 members with --peer-fetch: members pull each other's prefixes (and
    one is SIGKILLed mid-run, mid-fetch perhaps): every hit's bytes still verify."""
    cli = [sys.executable, "-m", "radixkv", "replay", "--requests", "300", "--nodes", "3",
           "--capacity-blocks", "300", "--clients", "2", "--routing", "round-robin",
           "--peer-fetch", "--kill-member-after", "150", "--json"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout)
    assert d["mismatches"] == 0 and d["verified_blocks"] > 0
    assert d["num_requests"] == 300 and d["cluster"]["killed"] == ["n0"]
    assert d["peer_fetched_blocks"] > 0 and d["peer_fetch_bytes"] > 0
