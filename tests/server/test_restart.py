"""A service restart, against real servers: the pool's epoch changes, and nothing of the old
pool is taken for the new one (a write into the dead pool, an insert or an event resume naming
the old epoch); PoolInfo names the process that owns the pool."""

from __future__ import annotations

import os
import tempfile

import pytest
from _server import running_server, tiny_config_path

from radixkv.client import Client
from radixkv.protocol import errors
from radixkv.server.launch import start_server


def test_restart_between_allocate_and_insert_caches_nothing():
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        sock, cfg = os.path.join(d, "s.sock"), tiny_config_path(d)
        flags = ("--model-config", cfg, "--block-size", "4", "--num-blocks", "16")
        server = start_server(sock, *flags)
        try:
            with Client(sock) as kv:
                tokens = list(range(8))
                lease = kv.lease("ns", tokens)
                new = lease.allocate(2)
                view = lease.view()
                view[list(new)] = 7.0  # the engine writes KV into the old pool
                server.stop()
                server = start_server(sock, *flags)
                with pytest.raises(errors.StalePool, match="restarted"):
                    lease.insert(tokens, new)
                assert kv.stats()["cached_blocks"] == 0
                again = kv.lease("ns", tokens)  # a new Match: the client maps the new pool
                assert again.num_tokens == 0 and again.view().shape[0] == 16
                with pytest.raises(errors.StalePool, match="match the prompt again"):
                    lease.view()  # the old lease's ids never meet the new mapping
                again.release()
        finally:
            assert server.stop() == 0

def test_insert_with_an_old_epoch_is_refused():
    with running_server() as s, Client(s.socket) as kv:
        m = kv.match("ns", list(range(8)))
        ids = kv.allocate(2, lease_id=m.lease_id).block_ids
        with pytest.raises(errors.StalePool):
            kv.insert("ns", list(range(8)), ids, m.lease_id, epoch="0" * 32)
        assert kv.insert("ns", list(range(8)), ids, m.lease_id, epoch=m.epoch).adopted == ids

def test_events_refuse_a_resume_across_epochs():
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        sock = os.path.join(d, "s.sock")
        with running_server(socket_path=sock) as s, Client(s.socket) as kv:
            old = kv.pool_info().epoch
            with kv.lease("ns", [1, 2, 3, 4]) as lease:
                lease.insert([1, 2, 3, 4], lease.allocate(1))
            first = next(iter(kv.events(from_sequence=1, timeout=5)))
            assert first.epoch == old
        with running_server(socket_path=sock) as s, Client(s.socket) as kv:
            with pytest.raises(errors.StalePool, match="restarted"):
                list(kv.events(from_sequence=2, epoch=old, timeout=5))
            new = kv.pool_info().epoch
            assert list(kv.events(epoch=new, timeout=0.3)) == []

def test_pool_info_carries_the_owner_pid():
    with running_server() as s, Client(s.socket) as kv:
        assert kv.pool_info().handle.owner_pid == s.proc.pid

def test_pool_of_maps_an_epoch_another_client_saw_first():
    """After a restart, one client (an engine's scheduler) learns the new epoch from a Match;
    another (its worker), asked for that epoch's pool, maps it. An epoch it saw replaced is
    refused with StalePool without a call, even with the service gone."""
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        sock = os.path.join(d, "s.sock")
        with running_server(socket_path=sock):
            worker = Client(sock)
            old = worker.pool().epoch
        with running_server(socket_path=sock):
            with Client(sock) as scheduler:
                m = scheduler.match("ns", [1, 2, 3, 4])
                scheduler.release(m.lease_id)
            assert m.epoch != old and worker.restarts == 0
            assert worker.pool_of(m.epoch).epoch == m.epoch
            assert worker.restarts == 1 and worker.epoch == m.epoch
            with pytest.raises(errors.StalePool, match="match the prompt again"):
                worker.pool_of(old)
        with pytest.raises(errors.StalePool, match="match the prompt again"):
            worker.pool_of(old)  # known gone: no call (there is no service to answer one)
        assert worker.pool_of(m.epoch).epoch == m.epoch  # mapped, still
        worker.close()
