"""The disk tier against real servers (radixkv serve --disk-dir): blocks the pool evicts are
demoted and Matched back from a second process byte for byte; a full tier drops its oldest; a
bad directory exits 2 with the reason; a clean stop and start keeps the cache (a new epoch);
SIGKILL during demotion never leads to a failed start or a wrong block; flipped bytes in the
slot file are a counted miss."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from _disk import BS, put, read_in_other_process
from _disk import prompt as p
from _server import REPO, tiny_config_path

from radixkv.client import Client
from radixkv.disk.slots import FILE_HEADER, FILE_NAME, Geometry
from radixkv.server.launch import ServerProcess, start_server

KILLS = int(os.environ.get("RADIXKV_DISK_KILLS", "10"))  # SIGKILL rounds (more in long runs)


@pytest.fixture
def workdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="rkv-")
    os.mkdir(os.path.join(d, "disk"), 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def serve(d: str, num_blocks: int, disk_blocks: int, *flags: str) -> ServerProcess:
    return start_server(os.path.join(d, "s.sock"), "--model-config", tiny_config_path(d),
                        "--block-size", str(BS), "--num-blocks", str(num_blocks),
                        "--disk-dir", os.path.join(d, "disk"),
                        "--disk-capacity-blocks", str(disk_blocks), *flags)


def stopped(server: ServerProcess) -> None:
    rc = server.stop()
    assert rc == 0, server.output()
    assert not os.path.exists(server.socket)


def test_pool_evictions_demote_and_match_back_from_another_process(workdir):
    server = serve(workdir, 8, 32)
    try:
        prompts = [p(i) for i in range(10)]  # 20 blocks through an 8-block pool
        with Client(server.socket) as kv:
            assert [put(kv, "ns", t) for t in prompts] == [0] * 10
            s = kv.stats(check_integrity=True)
            assert s["integrity"] == "ok"
            d = s["disk"]
            assert d["demoted_blocks"] == 12 and d["blocks"] == 12 and d["capacity_blocks"] == 32
            assert s["cached_blocks"] == 8 and d["bytes"] == 12 * s["layout"]["bytes_per_block"]
        assert read_in_other_process(server.socket, "ns", prompts) == [2 * BS] * 10
        with Client(server.socket) as kv:
            s = kv.stats(check_integrity=True)
            assert s["integrity"] == "ok" and s["disk"]["verify_failures"] == 0
            assert s["disk"]["promoted_blocks"] >= 12
            assert s["disk"]["hit_tokens"] == s["disk"]["promoted_blocks"] * BS
            assert s["hit_tokens"] == 10 * 2 * BS
    finally:
        stopped(server)


def test_prometheus_and_the_inspector_show_each_tier(workdir):
    import json
    import socket
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = serve(workdir, 8, 32, "--metrics-port", str(port))
    try:
        prompts = [p(i) for i in range(6)]  # 12 blocks: 4 demoted
        with Client(server.socket) as kv:
            for t in prompts:
                put(kv, "ns", t)
        read_in_other_process(server.socket, "ns", prompts[:1])  # 2 blocks promoted
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        m = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in text_string_to_metric_families(text) for s in f.samples}
        assert m[("radixkv_tier_hits_total", (("tier", "disk"),))] == 2 * BS
        assert m[("radixkv_tier_hits_total", (("tier", "memory"),))] == 0
        assert m[("radixkv_tier_blocks", (("tier", "memory"),))] == 8
        assert m[("radixkv_tier_blocks", (("tier", "disk"),))] == 4
        assert m[("radixkv_demoted_blocks_total", ())] == 6  # 4, then 2 for the promotion
        assert m[("radixkv_promoted_blocks_total", ())] == 2
        assert m[("radixkv_disk_up", ())] == 1 and m[("radixkv_disk_write_errors_total", ())] == 0
        out = subprocess.run([sys.executable, "-m", "radixkv", "inspect", "--socket",
                              server.socket, "--json"], capture_output=True, text=True,
                             timeout=60, cwd=REPO)
        tiers = json.loads(out.stdout)["tiers"]
        assert tiers["disk"]["blocks"] == 4 and tiers["disk"]["hit_tokens"] == 2 * BS
        assert tiers["memory"]["blocks"] == 8 and tiers["disk"]["capacity_blocks"] == 32
        assert (tiers["disk"]["state"], tiers["disk"]["last_error"]) == ("ok", "")
        text = subprocess.run([sys.executable, "-m", "radixkv", "inspect", "--socket",
                               server.socket], capture_output=True, text=True, timeout=60,
                              cwd=REPO, env={**os.environ, "COLUMNS": "400"}).stdout
        assert "failed their checksum; writes ok" in " ".join(text.split())
    finally:
        stopped(server)


def test_full_disk_tier_drops_the_least_recently_demoted(workdir):
    server = serve(workdir, 4, 4)
    try:
        prompts = [p(i) for i in range(6)]  # 12 blocks: 4 in the pool, 4 on disk, 4 dropped
        with Client(server.socket) as kv:
            for t in prompts:
                put(kv, "ns", t)
            d = kv.stats()["disk"]
            assert (d["blocks"], d["demoted_blocks"], d["evicted_blocks"]) == (4, 8, 4)
        assert read_in_other_process(server.socket, "ns", prompts[4:]) == [8, 8]  # memory
        # from disk (a promotion demotes, and the full tier drops the older p2 for it); the
        # first two were dropped
        assert read_in_other_process(server.socket, "ns", [prompts[3], *prompts[:2]]) == [
            8, 0, 0]
    finally:
        stopped(server)


def _where_events_put_blocks(kv: Client, where: dict[int, str], after: int) -> int:
    """Follow the events after sequence `after` as a router would: each block hash in the
    pool, on disk (BlockRemoved tier "disk") or gone (removed with no tier). Returns the last
    sequence read."""
    last = kv.stats()["event_sequence"]
    if last <= after:
        return after
    for ev in kv.events(from_sequence=after + 1, timeout=10):
        kind = ev.WhichOneof("kind")
        if kind == "stored":
            where.update(dict.fromkeys(ev.stored.block_hashes, "pool"))
        elif kind == "removed":
            for h in ev.removed.block_hashes:
                if ev.removed.tier == "disk":
                    where[h] = "disk"
                else:
                    del where[h]
        if ev.sequence >= last:
            break
    return last


def test_the_events_follow_every_block_the_disk_tier_drops(workdir):
    """A 4-block pool over a 4-block tier, 8 prompts of 2 blocks: 12 demoted, 8 of them dropped
    by the full tier; then prompts Matched back (promotions demote others, and drop more):
    after each, the blocks the events leave on disk are the tier's, and those in the pool the
    pool's (a drop is a BlockRemoved with no pool ids and no tier: gone)."""
    server = serve(workdir, 4, 4)
    try:
        where: dict[int, str] = {}
        with Client(server.socket) as kv:
            for i in range(8):
                put(kv, "ns", p(i))
            after = _where_events_put_blocks(kv, where, 0)
            s = kv.stats(check_integrity=True)
            assert s["disk"]["evicted_blocks"] == 8 and s["integrity"] == "ok"
            held = {"pool": s["cached_blocks"], "disk": s["disk"]["blocks"]}
            assert Counter(where.values()) == held
            assert [put(kv, "ns", p(i)) for i in (5, 0, 6)] == [2 * BS, 0, 2 * BS]
            _where_events_put_blocks(kv, where, after)
            s = kv.stats()
            assert s["disk"]["promoted_blocks"] == 4
            held = {"pool": s["cached_blocks"], "disk": s["disk"]["blocks"]}
            assert Counter(where.values()) == held
    finally:
        stopped(server)


def _serve_fails(d: str, disk_dir: str, *flags: str, wrap: tuple[str, ...] = ()) -> str:
    args = [*wrap, sys.executable, "-m", "radixkv", "serve", "--socket",
            os.path.join(d, "s.sock"), "--model-config", tiny_config_path(d), "--block-size",
            str(BS), "--num-blocks", "8", "--disk-dir", disk_dir, *flags]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.startswith("radixkv serve: --disk-dir"), out.stderr
    assert not os.path.exists(os.path.join(d, "s.sock"))
    return out.stderr


def test_bad_disk_dir_exits_2_with_the_reason(workdir):
    cap = ("--disk-capacity-blocks", "8")
    assert "does not exist" in _serve_fails(workdir, os.path.join(workdir, "nope"), *cap)
    afile = os.path.join(workdir, "afile")
    open(afile, "w").close()
    assert "is not a directory" in _serve_fails(workdir, afile, *cap)
    theirs = os.path.join(workdir, "theirs")
    os.mkdir(theirs)
    if os.geteuid() == 0:  # root can give a directory away; others have /
        os.chown(theirs, 65534, 65534)
    else:
        theirs = "/"
    assert "is owned by uid" in _serve_fails(workdir, theirs, *cap)
    locked = os.path.join(workdir, "locked")
    os.mkdir(locked, 0o500)
    assert "is not writable" in _serve_fails(workdir, locked, *cap)
    err = _serve_fails(workdir, os.path.join(workdir, "disk"), "--disk-capacity", "1000TiB")
    assert "the tier needs 1099.51 TB (1000.00 TiB) and its filesystem has" in err


def _in_mount_namespace(mount_opts: str, target: str) -> tuple[str, ...]:
    """A wrapper that runs a command in a new mount namespace with a tmpfs on `target`."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private tmpfs")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"no user+mount namespaces here: {probe.stderr.decode().strip()}")
    return ("unshare", "-rm", "sh", "-c",
            f'mount -t tmpfs -o {mount_opts} none {target} && exec "$@"', "sh")


def test_disk_dir_on_a_read_only_or_full_filesystem_exits_2(workdir):
    target = os.path.join(workdir, "disk")
    wrap = _in_mount_namespace("ro,size=1m", target)
    assert "read-only filesystem" in _serve_fails(workdir, target, "--disk-capacity-blocks",
                                                  "8", wrap=wrap)
    wrap = _in_mount_namespace("size=1m,mode=700", target)  # (a tmpfs is 1777 by default)
    err = _serve_fails(workdir, target, "--disk-capacity-blocks", "1000", wrap=wrap)
    assert "and its filesystem has" in err and "free" in err


def test_warm_restart_serves_what_was_cached_with_a_new_epoch(workdir):
    prompts = [p(i) for i in range(12)]  # 24 blocks: 8 in the pool, 16 on disk
    server = serve(workdir, 8, 64)
    try:
        with Client(server.socket) as kv:
            for t in prompts:
                put(kv, "ns", t)
            first = kv.stats()
            assert first["cached_blocks"] + first["disk"]["blocks"] == 24
    finally:
        stopped(server)  # SIGTERM: the pool's 8 cached blocks are written down
    server = serve(workdir, 8, 64)
    try:
        with Client(server.socket) as kv:
            s = kv.stats()
            assert s["epoch"] != first["epoch"] and s["disk"]["loaded_blocks"] == 24
            assert s["disk"]["generation"] == first["disk"]["generation"] + 1
        hits = read_in_other_process(server.socket, "ns", prompts)
        assert sum(hits) / (24 * BS) >= 0.99 and hits == [2 * BS] * 12
        with Client(server.socket) as kv:
            s = kv.stats(check_integrity=True)
            assert s["integrity"] == "ok" and s["disk"]["verify_failures"] == 0
    finally:
        stopped(server)


def test_a_tier_file_of_the_earlier_format_is_reused_empty(workdir):
    """A file written with CRC-32 payload checks (RKVDISK1): the server starts, says so, and
    serves none of its blocks (their checks would not verify under the current format)."""
    server = serve(workdir, 8, 64)
    try:
        with Client(server.socket) as kv:
            for i in range(12):
                put(kv, "ns", p(i))
    finally:
        stopped(server)
    path = os.path.join(workdir, "disk", FILE_NAME)
    with open(path, "r+b") as f:
        f.write(b"RKVDISK1")  # the earlier magic (its header checksum is over bytes 12..)
    server = serve(workdir, 8, 64)
    try:
        with Client(server.socket) as kv:
            s = kv.stats(check_integrity=True)
            assert s["disk"]["loaded_blocks"] == 0 and s["disk"]["blocks"] == 0
            assert s["integrity"] == "ok"
        assert read_in_other_process(server.socket, "ns", [p(i) for i in range(12)]) == [0] * 12
    finally:
        stopped(server)
    assert "earlier slot format" in server.output()


def _load(sock: str, stop: threading.Event, errors: list[BaseException], rng: random.Random,
          prompts: list[list[int]]) -> None:
    """Requests until `stop` (every hit's bytes checked); what fails before `stop` is kept."""
    try:
        with Client(sock) as kv:
            while not stop.is_set():
                put(kv, "ns", rng.choice(prompts))
    except Exception as e:  # the server was killed under it: expected, unless a wrong block
        errors.append(e)


def test_sigkill_during_demotion_never_breaks_a_start_or_serves_wrong_kv(workdir):
    rng = random.Random(31)
    prompts = [p(i, blocks=3) for i in range(40)]  # 120 blocks through 8 + 48
    served = 0
    for _ in range(KILLS):
        server = serve(workdir, 8, 48)
        with Client(server.socket) as kv:  # whatever an earlier round left verifies
            s = kv.stats(check_integrity=True)
            assert s["integrity"] == "ok", s["integrity"]
        stop = threading.Event()
        errors: list[BaseException] = []
        worker = threading.Thread(target=_load, args=(server.socket, stop, errors, rng, prompts))
        worker.start()
        time.sleep(rng.uniform(0.05, 0.6))
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        stop.set()
        worker.join(30)
        assert not [e for e in errors if isinstance(e, AssertionError)], errors
        os.unlink(server.socket)  # what SIGKILL leaves (a later start replaces it anyway)
    server = serve(workdir, 8, 48)
    try:
        hits = read_in_other_process(server.socket, "ns", prompts)  # checked byte for byte
        served = sum(hits)
        with Client(server.socket) as kv:
            s = kv.stats(check_integrity=True)
            assert s["integrity"] == "ok"
            assert s["disk"]["loaded_blocks"] + s["disk"]["dropped_at_load"] <= 48
    finally:
        stopped(server)
    assert served > 0  # something survived the kills


def test_flipped_bytes_in_the_slot_file_are_a_counted_miss(workdir):
    prompts = [p(i) for i in range(4)]
    server = serve(workdir, 8, 16)
    try:
        with Client(server.socket) as kv:
            for t in prompts:
                put(kv, "ns", t)
    finally:
        stopped(server)  # all 8 blocks written down, to slots 0..7
    path = os.path.join(workdir, "disk", FILE_NAME)
    geometry = Geometry.of(start_layout(workdir))
    with open(path, "r+b") as f:  # one payload byte of slot 3, one header byte of slot 5
        for slot, where in ((3, geometry.meta_bytes + 100), (5, 40)):
            f.seek(FILE_HEADER + slot * geometry.slot_bytes + where)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    server = serve(workdir, 8, 16)
    try:
        with Client(server.socket) as kv:
            assert kv.stats()["disk"]["dropped_at_load"] == 1  # the header: dropped at start
        hits = read_in_other_process(server.socket, "ns", prompts)  # every hit byte-checked
        assert sum(hits) == 8 * BS - 2 * BS - BS  # three blocks short: the two bad slots'
        with Client(server.socket) as kv:  # and a child of one of them
            s = kv.stats(check_integrity=True)
            assert s["disk"]["verify_failures"] == 1 and s["integrity"] == "ok"
    finally:
        stopped(server)


def start_layout(d: str):  # noqa: ANN201 - the tiny layout the servers above run
    from kvpool.layout import KVLayout
    from radixkv.cli.flags import layout_from_args
    from radixkv.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--model-config", tiny_config_path(d),
                                      "--block-size", str(BS)])
    layout: KVLayout = layout_from_args(args)
    return layout


def test_replay_with_a_disk_tier_reports_hits_per_tier(workdir):
    out = subprocess.run(
        [sys.executable, "-m", "radixkv", "replay", "--requests", "400", "--capacity-blocks",
         "64", "--disk-capacity-blocks", "512", "--disk-dir", os.path.join(workdir, "disk"),
         "--clients", "2", "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    import json

    r = json.loads(out.stdout)
    tiers = r["hit_rate_by_tier"]
    assert r["verify_mismatches"] == 0 and r["integrity"] == "ok"
    assert tiers["disk"] > 0 and r["disk"]["demoted_blocks"] > 0
    assert abs(tiers["memory"] + tiers["disk"] - r["token_hit_rate"]) < 1e-9
    saved = r["prefill_saved"]  # disk hits priced: llama-3-8b bf16 KV read at 2 GB/s
    read_s = r["disk"]["hit_tokens"] * 131072 / 2e9
    assert r["disk"]["read_bytes_per_token"] == 131072
    assert abs(saved["seconds_net_of_disk_reads"] - (saved["seconds_at_rate"] - read_s)) < 1e-6


def test_key_keyed_namespaces_stay_in_memory_beside_the_tier(workdir):
    """Blocks named by keys (no token ids) are evicted, not demoted, and a restart does not
    bring their namespace back as a token-keyed one; the events say which removed blocks went
    to disk (BlockRemoved.tier "disk") and which are gone ("")."""
    keys = [bytes([i]) * 32 for i in range(1, 11)]  # one chain of 10 keys through an 8-block pool
    server = serve(workdir, 8, 32)
    try:
        with Client(server.socket) as kv:
            m = kv.match_keys("keyed", keys[:5], store=True)
            kv.insert_keys("keyed", keys[:5], m.new_block_ids, m.lease_id, epoch=m.epoch,
                           release=True)
            assert [put(kv, "ns", t) for t in (p(1), p(2), p(3), p(4))] == [0] * 4
            s = kv.stats(check_integrity=True)
            assert s["integrity"] == "ok"
            cached = {n["namespace"]: n["cached_blocks"] for n in s["namespaces"]}
            assert cached.get("keyed", 0) < 5  # some key blocks were evicted...
            # ...and dropped: the disk holds only the token blocks the pool evicted
            assert s["disk"]["blocks"] == 8 - cached.get("ns", 0)
            again = kv.match_keys("keyed", keys[:5])
            kv.release(again.lease_id)
            assert len(again.block_ids) < 5
            # the events say where evicted blocks went: the token blocks to disk, the key
            # blocks nowhere
            assert [put(kv, "ns", t) for t in (p(5), p(6), p(7), p(8))] == [0] * 4
            s = kv.stats()
            removed: dict[str, list[str]] = {"ns": [], "keyed": []}
            for ev in kv.events(from_sequence=1, timeout=2):
                if ev.WhichOneof("kind") == "removed":
                    removed[ev.namespace] += [ev.removed.tier] * len(ev.removed.block_ids)
            assert removed["ns"] == ["disk"] * s["disk"]["demoted_blocks"] and removed["ns"]
            assert removed["keyed"] == [""] * (5 - cached.get("keyed", 0))
    finally:
        stopped(server)
    server = serve(workdir, 8, 32)
    try:
        with Client(server.socket) as kv:
            m = kv.match_keys("keyed", keys[:5])  # still a key namespace: no FailedPrecondition
            assert m.block_ids == ()
            kv.release(m.lease_id)
            assert kv.stats(check_integrity=True)["integrity"] == "ok"
    finally:
        stopped(server)
