"""The cuda backend on a real GPU: CUDA IPC export/attach across spawned processes, zero-copy
torch views, gather/scatter on the device, the owner's own handle. Skipped cleanly without CuPy
or a GPU (the Unavailable errors themselves are tested in test_pool_host.py)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

from kvpool import BlockPool, attach, create_pool, gather, scatter  # noqa: E402
from kvpool.cuda import SLAB_ALIGN, device_uuid, is_available  # noqa: E402
from kvpool.layout import KVLayout  # noqa: E402
from radixkv.protocol.errors import InvalidArgument, StalePool, Unavailable  # noqa: E402

if not is_available() or not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU visible to CuPy and torch", allow_module_level=True)

SPAWN = multiprocessing.get_context("spawn")


def make_layout(dtype: str = "bf16", block_size: int = 4) -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype, block_size=block_size)


def pattern(nbytes: int, seed: int, device: Any) -> Any:
    return ((torch.arange(nbytes, device=device, dtype=torch.int64) * 7 + seed) % 251 + 1).to(
        torch.uint8
    )


def raw(view: Any) -> Any:
    """The view's bytes as uint8 [num_blocks, bytes_per_block]."""
    return view.reshape(view.shape[0], -1).view(torch.uint8)


@pytest.fixture
def pool() -> Iterator[BlockPool]:
    with create_pool(make_layout(), num_blocks=8, backend="cuda") as p:
        yield p


# --- workers (spawned) ----------------------------------------------------------------------


def _cuda_reader(handle: dict[str, Any], seed: int, mine: int, results: Any) -> None:
    try:
        with attach(handle) as mapping:
            blocks = raw(mapping.view())
            want = pattern(blocks.numel(), seed, blocks.device).view(blocks.shape)
            want[mine] = 0  # the owner left this block zeroed
            same = bool(torch.equal(blocks, want))
            blocks[mine] = pattern(blocks.shape[1], seed + 1, blocks.device)
            torch.cuda.synchronize()  # written before we say so
            results.put((same, mapping.view().device.type, mapping.handle.device_uuid))
            del blocks, want
    except BaseException as e:
        results.put(repr(e))


def _cuda_owner(handles: Any, done: Any) -> None:
    with create_pool(make_layout(), num_blocks=4, backend="cuda") as p:
        handles.put(p.export().to_dict())
        done.wait(60)


# --- tests ----------------------------------------------------------------------------------


def test_handle_open_in_a_second_process(pool: BlockPool) -> None:
    """The first thing to know on a new machine: does CUDA IPC work between two processes."""
    handle = pool.export()
    assert handle.backend == "cuda" and len(handle.ipc_handle) == 64
    assert handle.nbytes % SLAB_ALIGN == 0 and handle.device_uuid.startswith("GPU-")
    blocks = raw(pool.view())
    mine = 5
    blocks.copy_(pattern(blocks.numel(), 3, blocks.device).view(blocks.shape))
    blocks[mine] = 0
    torch.cuda.synchronize()
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=_cuda_reader, args=(handle.to_dict(), 3, mine, results))
    proc.start()
    got = results.get(timeout=120)
    proc.join(60)
    assert got == (True, "cuda", handle.device_uuid), got
    assert proc.exitcode == 0
    assert torch.equal(blocks[mine], pattern(blocks.shape[1], 4, blocks.device))


def test_views_are_zero_copy_on_the_device(pool: BlockPool) -> None:
    view = pool.view()
    assert view.device.type == "cuda" and view.dtype == torch.bfloat16
    assert tuple(view.shape) == (8, 3, 2, 4, 2, 16) == pool.export().shape
    assert tuple(s * view.element_size() for s in view.stride()) == pool.export().strides
    assert pool.block(2).data_ptr() == view.data_ptr() + 2 * pool.layout.bytes_per_block
    assert int(view.view(torch.uint8).sum()) == 0  # zeroed at creation
    view[1].fill_(1.5)
    assert bool((pool.view()[1] == 1.5).all())  # the same memory, not a copy
    with pytest.raises(InvalidArgument, match="numpy_view\\(\\) needs a host pool"):
        pool.numpy_view()


def test_own_handle_maps_the_owners_memory(pool: BlockPool) -> None:
    handle = pool.export()
    with attach(handle.to_dict()) as mapping:  # CUDA cannot open its own handle: no IPC here
        assert mapping.view().data_ptr() == pool.view().data_ptr()
    pool.close()
    with pytest.raises(StalePool, match="owned by this process and is closed"):
        attach(handle)


def test_unknown_device_is_refused(pool: BlockPool) -> None:
    data = pool.export().to_dict()
    data["owner_pid"] = 1  # not us, so attach goes through IPC
    data["device_uuid"] = "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(Unavailable, match="is not visible in this process"):
        attach(data)


def test_handle_of_an_exited_owner_is_stale() -> None:
    handles, done = SPAWN.Queue(), SPAWN.Event()
    proc = SPAWN.Process(target=_cuda_owner, args=(handles, done))
    proc.start()
    handle = handles.get(timeout=120)
    done.set()
    proc.join(60)
    with pytest.raises(StalePool, match="the owner has exited"):
        attach(handle)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("layer", [None, 2])
def test_gather_scatter_on_the_device(dtype: str, layer: int | None) -> None:
    with create_pool(make_layout(dtype), num_blocks=8, backend="cuda") as p:
        view = p.view()
        gen = torch.Generator(device="cuda").manual_seed(0)
        view.view(torch.uint8).random_(0, 256, generator=gen)
        ids = [6, 1, 3]
        k, v = gather(view, ids, layer)
        assert k.device == view.device
        cpu = view.cpu()
        for kv, got in ((0, k), (1, v)):
            if layer is None:
                ref = torch.stack([torch.cat([cpu[b, li, kv] for b in ids]) for li in range(3)])
            else:
                ref = torch.cat([cpu[b, layer, kv] for b in ids])
            assert torch.equal(got.cpu().view(torch.uint8), ref.view(torch.uint8))
        scatter(view, [0, 2, 7], k, v, layer, check=False)
        k2, v2 = gather(view, torch.tensor([0, 2, 7], device="cuda"), layer)
        assert torch.equal(k2.view(torch.uint8), k.view(torch.uint8))
        assert torch.equal(v2.view(torch.uint8), v.view(torch.uint8))
        del view, k, v, k2, v2


def test_device_uuid_matches_torch() -> None:
    ours = device_uuid(0)
    theirs = str(torch.cuda.get_device_properties(0).uuid)
    assert ours.removeprefix("GPU-") == theirs.removeprefix("GPU-"), (ours, theirs)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_blocks_on_the_device_match_the_cpu_codec(kv_dtype: str) -> None:
    """The same torch ops on the GPU: write/read a quantized cuda pool (a sink block first):
    sink tokens bit-exact, the rest what the CPU codec gives within one quantization step
    (device rounding may differ at a step's edge)."""
    from kvpool import quant

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=kv_dtype, block_size=8,
                      model_dtype="bf16", sink_tokens=2)
    with create_pool(layout, num_blocks=8, backend="cuda", sink_fraction=0.25) as p:
        gen = torch.Generator().manual_seed(0)
        k = torch.randn((3, 16, 2, 16), generator=gen).to(torch.bfloat16)
        v = torch.randn((3, 16, 2, 16), generator=gen).to(torch.bfloat16)
        ids = [6, 1]  # a sink block at position 0, then a regular one
        p.write(ids, k.cuda(), v.cuda())
        got_k, got_v = p.read(ids)
        assert got_k.device.type == "cuda" and got_k.dtype == torch.bfloat16
        with create_pool(layout, num_blocks=8, sink_fraction=0.25) as host:
            host.write(ids, k, v)
            want_k, want_v = host.read(ids)
            exact = slice(layout.bytes_per_block, None)
            assert torch.equal(p.sink_view()[0, exact].cpu(), host.sink_view()[0, exact])
        assert torch.equal(got_k[:, :2].cpu(), k[:, :2]) and torch.equal(got_v[:, :2].cpu(),
                                                                           v[:, :2])
        step = 0.05 if kv_dtype == "int8" else 0.7
        assert float((got_k.cpu().float() - want_k.float()).abs().max()) <= step
        assert float((got_v.cpu().float() - want_v.float()).abs().max()) <= step
        assert quant.model_dtype(layout) == torch.bfloat16
        del got_k, got_v
