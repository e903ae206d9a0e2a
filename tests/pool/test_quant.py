"""Quantized KV blocks: the codec's error and exact parts, the pool's byte layout against the
calculator, the sink region, and the whole path through a real server in two processes."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
from typing import Any

import pytest
import torch
from _server import running_server

from kvpool import create_pool, quant
from kvpool.calc import calculate
from kvpool.layout import KVLayout
from radixkv.client import Client, pool_info_from_pb
from radixkv.protocol.errors import InvalidArgument, OutOfBlocks

L, H, D, B = 2, 2, 8, 8  # the test server's tiny model (tests/_server.py) at block size 8
FORMATS = {
    "int8": dict(dtype="int8"),
    "int4": dict(dtype="int4"),
    "int4-token-g4": dict(dtype="int4", key_scales="token", group_size=4),
}


def layout(name: str = "int4", sinks: int = 2, head_dim: int = D, **kw: Any) -> KVLayout:
    fields: dict[str, Any] = dict(num_layers=L, num_kv_heads=H, head_dim=head_dim,
                                  block_size=B, model_dtype="fp32", sink_tokens=sinks)
    fields.update(FORMATS[name], **kw)
    return KVLayout(**fields)


def blocks(n: int, head_dim: int = D, seed: int = 0) -> torch.Tensor:
    """Random KV [n, layers, 2, block, heads, dim] with key channels offset like real keys."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((n, L, 2, B, H, head_dim), generator=g)
    kv[:, :, 0] += torch.linspace(-8, 8, head_dim)  # outlier channels in K
    return kv


def snr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return 10 * math.log10(float((x ** 2).sum() / ((x - y) ** 2).sum()))


@pytest.mark.parametrize("name", FORMATS)
def test_rows_are_exactly_the_layouts_bytes(name):
    lay = layout(name)
    kv = blocks(3)
    rows = quant.to_rows(lay, kv, num_sink=1)
    assert tuple(rows.shape) == (3, lay.sink_bytes_per_block)
    assert tuple(quant.to_rows(lay, kv).shape) == (3, lay.bytes_per_block)
    views = quant.segment_views(lay, rows)
    assert sum(t.numel() * t.element_size() for t in views.values()) == 3 * lay.bytes_per_block


def test_int8_and_int4_error_and_the_techniques():
    kv = blocks(8)
    # int8: symmetric per token and head, max error half a step of each row's scale
    int8 = layout("int8", sinks=0)
    back = quant.roundtrip(int8, kv)
    step = kv.abs().amax(-1, keepdim=True) / 127
    assert bool(((back - kv).abs() <= step / 2 + 1e-3).all())
    assert snr_db(kv, back) > 38
    # int4: per-channel keys beat per-token keys on channel outliers; groups help values
    naive = layout("int4", sinks=0, key_scales="token")
    chan = layout("int4", sinks=0)
    grouped = layout("int4", sinks=0, group_size=4)
    k = kv[:, :, 0]
    assert snr_db(k, quant.roundtrip(chan, kv)[:, :, 0]) > snr_db(
        k, quant.roundtrip(naive, kv)[:, :, 0]) + 3
    v = kv[:, :, 1]
    assert snr_db(v, quant.roundtrip(grouped, kv)[:, :, 1]) > snr_db(
        v, quant.roundtrip(chan, kv)[:, :, 1]) + 1


def test_int4_matches_a_plain_reference():
    """Asymmetric 4-bit: per channel over the block's tokens for K, per token group for V."""
    lay = layout("int4", sinks=0, group_size=4)
    kv = blocks(3)
    back = quant.roundtrip(lay, kv)

    def fake_quant(x: torch.Tensor, dim: int) -> torch.Tensor:
        lo = x.amin(dim, keepdim=True).half().float()
        scale = ((x.amax(dim, keepdim=True) - lo) / 15).half().float()
        return ((x - lo) / scale).round().clamp(0, 15) * scale + lo

    want_k = fake_quant(kv[:, :, 0], dim=2)  # [n, L, B, H, D]: over B
    v = kv[:, :, 1]
    want_v = fake_quant(v.reshape(*v.shape[:-1], 2, 4), dim=-1).reshape(v.shape)
    assert torch.allclose(back[:, :, 0], want_k, atol=1e-3)
    assert torch.allclose(back[:, :, 1], want_v, atol=1e-3)


def test_sink_tokens_come_back_bit_exact_and_do_not_widen_key_ranges():
    lay = layout("int4", sinks=2)
    kv = blocks(2)
    kv[0, :, :, :2] *= 50  # huge sink activations, as real models have at position 0
    back = quant.roundtrip(lay, kv, sinks=True)
    assert torch.equal(back[0, :, :, :2], kv[0, :, :, :2])
    without = quant.roundtrip(dataclasses.replace(lay, sink_tokens=0), kv)
    rest = kv[0, :, :, 2:]
    assert snr_db(rest, back[0, :, :, 2:]) > snr_db(rest, without[0, :, :, 2:]) + 10


@pytest.mark.parametrize("no_kernel", ["0", "1"])  # the CPU kernel, the torch ops
def test_nan_and_inf_are_refused_and_nothing_is_written(monkeypatch, no_kernel):
    monkeypatch.setenv("RADIXKV_NO_KERNEL", no_kernel)
    lay = layout("int8", sinks=2)
    with create_pool(lay, num_blocks=4, sink_fraction=0.5) as pool:
        before = pool.view().clone(), pool.sink_view().clone()
        k = torch.zeros((L, 2 * B, H, D))
        v = k.clone()
        v[1, 3, 0, 0] = float("nan")
        with pytest.raises(InvalidArgument, match="NaN or Inf"):
            pool.write([0, 2], k, v)
        k[0, 0, 0, 0] = float("inf")
        with pytest.raises(InvalidArgument, match="NaN or Inf"):
            pool.write([1], k[:, :B], v[:, :B].nan_to_num())
        assert torch.equal(pool.view(), before[0]) and torch.equal(pool.sink_view(), before[1])


@pytest.mark.parametrize("no_kernel", ["0", "1"])
@pytest.mark.parametrize("name", FORMATS)
def test_pool_and_calc_agree_byte_for_byte(monkeypatch, name, no_kernel):
    monkeypatch.setenv("RADIXKV_NO_KERNEL", no_kernel)
    lay = layout(name)
    row = next(r for r in calculate(lay).rows if r.dtype == lay.dtype)
    with create_pool(lay, num_blocks=8, sink_fraction=0.25) as pool:
        assert pool.num_sink_blocks == 2
        assert tuple(pool.view().shape) == (6, row.bytes_per_block)
        assert tuple(pool.sink_view().shape) == (2, lay.sink_bytes_per_block)
        assert pool.slab_bytes == 6 * row.bytes_per_block + 2 * lay.sink_bytes_per_block
        kv = blocks(4)
        k = kv[:, :, 0].transpose(0, 1).reshape(L, -1, H, D)
        v = kv[:, :, 1].transpose(0, 1).reshape(L, -1, H, D)
        ids = [6, 0, 1, 7]  # a sink block first (position 0), then regular and another sink
        pool.write(ids, k, v)
        got_k, got_v = pool.read(ids)
        for i in (0, 3):  # sink blocks, read back as written (their sink tokens exact)
            want = quant.roundtrip(lay, kv[[i]], sinks=True)[0]
            assert torch.equal(got_k[:, i * B:(i + 1) * B], want[:, 0])
            assert torch.equal(got_v[:, i * B:(i + 1) * B], want[:, 1])
        want = quant.roundtrip(lay, kv[[1, 2]], sinks=False)  # regular blocks
        assert torch.equal(got_k[:, B:3 * B], want[:, :, 0].transpose(0, 1).reshape(L, -1, H, D))


def test_sink_region_allocation():
    lay = layout("int8", sinks=2)
    with create_pool(lay, num_blocks=4, sink_fraction=0.25) as pool:
        assert pool.alloc(1, sinks=1) == [3]
        with pytest.raises(OutOfBlocks, match="asked 1 sink blocks"):
            pool.alloc(1, sinks=1)
        assert pool.alloc(3) == [0, 1, 2]
        pool.free([3, 1])
        assert pool.alloc(2) == [1, 3]  # regular first, then a sink block stands in
        pool.check_integrity()
    with pytest.raises(InvalidArgument, match="needs a sink region"):
        create_pool(lay, num_blocks=4, sink_fraction=0.25).__class__(lay, 4, 0)


def test_memory_budget_counts_the_sink_region():
    lay = layout("int4", sinks=2)
    budget = 100 * lay.bytes_per_block
    with create_pool(lay, memory_bytes=budget) as pool:
        assert pool.slab_bytes <= budget
        assert pool.slab_bytes + lay.sink_bytes_per_block > budget
        assert pool.num_sink_blocks == round(pool.num_blocks * 0.125)


def test_client_refuses_a_layout_it_does_not_understand():
    from radixkv.protocol.wire import layout_pb
    from radixkv.v1 import radixkv_pb2 as pb

    lay = layout("int4")
    msg = pb.PoolInfoResponse(layout=layout_pb(lay), backend="host", num_blocks=4, epoch="e",
                              shm_name="x", nbytes=1 << 20, num_sink_blocks=1)
    assert pool_info_from_pb(msg).layout == lay
    msg.layout.bytes_per_block += 16  # a block format this client does not know
    with pytest.raises(InvalidArgument, match="does not understand the service's pool layout"):
        pool_info_from_pb(msg)
    msg.layout.key_scales = "hadamard"
    with pytest.raises(InvalidArgument, match="does not understand"):
        pool_info_from_pb(msg)


# ---- through the real server, written in one process and read in another -------------------

def _write_prompt(sock: str, tokens: list[int], seed: int) -> list[int]:
    client = Client(f"unix://{sock}")
    try:
        kv = blocks(len(tokens) // B, seed=seed)
        with client.lease("ns", tokens) as lease:
            ids = lease.allocate(len(tokens) // B)
            pool = lease.pool()
            k = kv[:, :, 0].transpose(0, 1).reshape(L, -1, H, D)
            v = kv[:, :, 1].transpose(0, 1).reshape(L, -1, H, D)
            pool.write(ids, k, v)
            lease.insert(tokens, ids, release=True)
            return list(ids)
    finally:
        client.close()


@pytest.mark.parametrize("four_trips", [False, True])
def test_quantized_blocks_through_the_server_in_two_processes(four_trips):
    flags = ["--kv-dtype", "int4", "--kv-sink-tokens", "2", "--kv-sink-fraction", "0.25"]
    with running_server(*flags, num_blocks=16, block_size=B) as server:
        tokens = list(range(100, 100 + 3 * B))
        ctx = multiprocessing.get_context("spawn")
        if four_trips:  # Allocate after a plain Match, as an engine without store_tokens does
            client = Client(f"unix://{server.socket}")
            m = client.match("ns", tokens)
            first = client.allocate(3, lease_id=m.lease_id, starts_sequence=True).block_ids
            with pytest.raises(InvalidArgument, match="holds position 0 but is not a sink"):
                client.insert("ns", tokens, (first[1], first[0], first[2]), m.lease_id)
            client.release(m.lease_id)
            client.close()
        with ctx.Pool(1) as workers:
            written = workers.apply(_write_prompt, (server.socket, tokens, 7))
        client = Client(f"unix://{server.socket}")
        try:
            info = client.pool_info()
            assert info.layout.dtype == "int4" and info.layout.sink_tokens == 2
            assert info.handle.num_sink_blocks == 4
            assert written[0] >= 12  # position 0 came from the sink region (ids 12..15)
            with client.lease("ns", tokens) as lease:
                assert list(lease.block_ids) == written
                k, v = lease.pool().read(lease.block_ids)
            want = quant.roundtrip(info.layout, blocks(3, seed=7), sinks=True)
            assert torch.equal(k, want[:, :, 0].transpose(0, 1).reshape(L, -1, H, D))
            assert torch.equal(v, want[:, :, 1].transpose(0, 1).reshape(L, -1, H, D))
        finally:
            client.close()


def test_sink_blocks_run_out_with_a_precise_error():
    flags = ["--kv-dtype", "int8", "--kv-sink-tokens", "2", "--kv-sink-fraction", "0.125"]
    with running_server(*flags, num_blocks=8, block_size=B) as server:
        client = Client(f"unix://{server.socket}")
        try:
            held = client.allocate(1, namespace="ns", starts_sequence=True)  # the only sink
            with pytest.raises(OutOfBlocks, match="no sink block for a sequence's first block"):
                client.allocate(1, namespace="ns", starts_sequence=True)
            second = client.allocate(2, namespace="ns")  # any block can go further in
            assert len(second.block_ids) == 2
            client.release(held.lease_id)
            client.release(second.lease_id)
            assert client.stats(check_integrity=True)["integrity"] == "ok"
        finally:
            client.close()
