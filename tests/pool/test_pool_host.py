"""The block pool contract on the host backend: free list, handle, views, and sharing across
real processes (spawn), including cleanup after SIGTERM and reclaim after SIGKILL.

torch is imported inside the tests that use it: spawned workers import this module, and
without torch they start in a fraction of a second."""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
import types
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvpool.cuda
import kvpool.host
from kvpool import (
    BlockPool,
    PoolHandle,
    attach,
    create_pool,
    install_signal_cleanup,
    num_blocks_for,
    reclaim_stale_segments,
)
from kvpool.host import SHM_DIR, HostBlockPool
from kvpool.layout import KVLayout
from radixkv.protocol.errors import (
    InvalidArgument,
    OutOfBlocks,
    RadixKVError,
    StalePool,
    Unavailable,
)

PREFIX = f"rkvt{os.getpid()}"  # every segment these tests create starts with it
SPAWN = multiprocessing.get_context("spawn")


def make_layout(dtype: str = "fp16", block_size: int = 4) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, block_size=block_size)


def make_pool(num_blocks: int = 8, dtype: str = "fp16", prefix: str = PREFIX) -> BlockPool:
    return create_pool(make_layout(dtype), num_blocks=num_blocks, name_prefix=prefix)


def segments(prefix: str = PREFIX) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def pattern(block_id: int, nbytes: int, seed: int) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.int64) * 7 + block_id * 31 + seed) % 251 + 1).astype(
        np.uint8
    )


def raw_blocks(mapping: Any) -> np.ndarray:
    """The slab's blocks as uint8 [num_blocks, bytes_per_block]."""
    return mapping.numpy_view().view(np.uint8).reshape(mapping.num_blocks, -1)


@pytest.fixture(scope="module", autouse=True)
def no_segment_left() -> Iterator[None]:
    yield
    assert segments() == [], "a test left a shared-memory segment behind"


# --- workers (run in spawned processes) -----------------------------------------------------


def _writer(handle: dict[str, Any], block_ids: list[int], seed: int) -> None:
    with attach(handle) as mapping:
        blocks = raw_blocks(mapping)
        for i in block_ids:
            blocks[i] = pattern(i, blocks.shape[1], seed)


def _reader(
    handle: dict[str, Any], written: list[int], seed: int, mine: int, attached: Any, go: Any,
    results: Any,
) -> None:
    try:
        with attach(handle) as mapping:
            blocks = raw_blocks(mapping)
            attached.set()
            go.wait(30)
            errors = []
            for i in range(mapping.num_blocks):
                if i in written:
                    want = pattern(i, blocks.shape[1], seed)
                elif i == 0:  # written by the owner after this process attached
                    want = np.full(blocks.shape[1], 0xAB, np.uint8)
                else:
                    want = np.zeros(blocks.shape[1], np.uint8)
                if not np.array_equal(blocks[i], want):
                    errors.append(f"block {i}: {int((blocks[i] != want).sum())} bytes differ")
            blocks[mine] = pattern(mine, blocks.shape[1], seed + 1)
            results.put(errors)
    except BaseException as e:  # report instead of dying silently
        results.put([repr(e)])


def _owner(prefix: str, names: Any, cleanup: bool, chain_marker: str | None) -> None:
    if chain_marker is not None:
        def host_handler(signum: int, frame: Any) -> None:
            with open(chain_marker, "w") as f:
                f.write("ran")
            os._exit(3)

        signal.signal(signal.SIGTERM, host_handler)
    if cleanup:
        install_signal_cleanup()
    pool = make_pool(4, prefix=prefix)
    names.put(pool.export().name)
    time.sleep(60)


def _run_owner(prefix: str, cleanup: bool = False, chain_marker: str | None = None) -> tuple[
    Any, str
]:
    names = SPAWN.Queue()
    proc = SPAWN.Process(target=_owner, args=(prefix, names, cleanup, chain_marker), daemon=True)
    proc.start()
    return proc, names.get(timeout=60)


# --- free list ------------------------------------------------------------------------------


def test_alloc_is_fifo_with_exact_ids() -> None:
    with make_pool(8) as pool:
        assert pool.alloc(3) == [0, 1, 2]
        assert pool.alloc(2) == [3, 4]
        pool.free([1, 0])
        assert pool.alloc(4) == [5, 6, 7, 1]  # freed blocks are reused last
        assert (pool.num_free, pool.num_used) == (1, 7)
        assert pool.is_free(0) and not pool.is_free(1)
        pool.free([])
        pool.check_integrity()


@pytest.mark.parametrize(
    ("setup", "call", "error", "message"),
    [
        ([], lambda p: p.alloc(0), InvalidArgument, "alloc needs n >= 1, got 0"),
        ([], lambda p: p.alloc(-2), InvalidArgument, "alloc needs n >= 1, got -2"),
        ([], lambda p: p.alloc(1.5), InvalidArgument, "n must be an integer, got 1.5"),
        ([], lambda p: p.alloc(9), OutOfBlocks, "asked 9 blocks, 8 free of 8"),
        ([5], lambda p: p.alloc(4), OutOfBlocks, "asked 4 blocks, 3 free of 8"),
        (
            [2], lambda p: p.free([0, 8]), InvalidArgument,
            "cannot free 2 blocks: block id 8 out of range 0..7",
        ),
        (
            [2], lambda p: p.free([-1]), InvalidArgument,
            "cannot free 1 blocks: block id -1 out of range 0..7",
        ),
        (
            [2], lambda p: p.free([1, 5]), InvalidArgument,
            "cannot free 2 blocks: block 5 is already free",
        ),
        (
            [2], lambda p: p.free([0, 1, 0]), InvalidArgument,
            "cannot free 3 blocks: block 0 given twice",
        ),
        ([], lambda p: p.is_free(8), InvalidArgument, "block id 8 out of range 0..7"),
        ([], lambda p: p.block(-1), InvalidArgument, "block id -1 out of range 0..7"),
    ],
)
def test_free_list_errors_change_nothing(
    setup: list[int], call: Any, error: type[Exception], message: str
) -> None:
    with make_pool(8) as pool:
        for n in setup:
            pool.alloc(n)
        before = list(pool._free)  # type: ignore[attr-defined]
        with pytest.raises(error, match=f"^{re.escape(message)}$"):
            call(pool)
        assert list(pool._free) == before  # type: ignore[attr-defined]
        pool.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    with make_pool(4) as pool:
        pool.alloc(2)
        pool._free.append(3)  # type: ignore[attr-defined]
        with pytest.raises(RadixKVError, match="duplicate"):
            pool.check_integrity()
        pool._free.pop()  # type: ignore[attr-defined]
        pool._free.append(0)  # type: ignore[attr-defined]
        message = "free list holds 3 ids but 2 blocks are marked free"
        with pytest.raises(RadixKVError, match=message):
            pool.check_integrity()


class FreeListMachine(RuleBasedStateMachine):
    """The pool's free list against a plain deque: exact ids, FIFO reuse, errors change nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(6)
        self.free: deque[int] = deque(range(6))

    @rule(n=st.integers(1, 8))
    def alloc(self, n: int) -> None:
        if n > len(self.free):
            with pytest.raises(OutOfBlocks, match=f"asked {n} blocks, {len(self.free)} free"):
                self.pool.alloc(n)
            return
        assert self.pool.alloc(n) == [self.free.popleft() for _ in range(n)]

    @precondition(lambda self: len(self.free) < 6)
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        used = sorted(set(range(6)) - set(self.free))
        ids = data.draw(st.lists(st.sampled_from(used), unique=True, min_size=1))
        self.pool.free(ids)
        self.free.extend(ids)

    @precondition(lambda self: len(self.free) > 0)
    @rule(data=st.data())
    def free_a_free_block(self, data: st.DataObject) -> None:
        used = sorted(set(range(6)) - set(self.free))
        ids = data.draw(st.permutations([*used, data.draw(st.sampled_from(list(self.free)))]))
        with pytest.raises(InvalidArgument, match="is already free"):
            self.pool.free(ids)

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        assert self.pool.num_free == len(self.free)
        assert list(self.pool._free) == list(self.free)  # type: ignore[attr-defined]

    def teardown(self) -> None:
        self.pool.close()


FreeListMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=20, deadline=None
)
test_free_list_machine = FreeListMachine.TestCase


# --- creation, handle, views ----------------------------------------------------------------


def test_create_pool_arguments() -> None:
    layout = make_layout()
    with pytest.raises(InvalidArgument, match="give exactly one of num_blocks or memory_bytes"):
        create_pool(layout, name_prefix=PREFIX)
    with pytest.raises(InvalidArgument, match="give exactly one of num_blocks or memory_bytes"):
        create_pool(layout, num_blocks=2, memory_bytes=10_000, name_prefix=PREFIX)
    with pytest.raises(InvalidArgument, match="backend 'tpu' is not one of host, cuda"):
        create_pool(layout, num_blocks=2, backend="tpu")
    with pytest.raises(InvalidArgument, match="num_blocks must be >= 1, got 0"):
        create_pool(layout, num_blocks=0, name_prefix=PREFIX)
    with pytest.raises(InvalidArgument, match="name_prefix 'a/b' must be"):
        create_pool(layout, num_blocks=2, name_prefix="a/b")
    assert layout.bytes_per_block == 512
    assert num_blocks_for(layout, 512 * 5 + 511) == 5
    with pytest.raises(InvalidArgument, match="memory_bytes 511 holds no block: one block is 512"):
        num_blocks_for(layout, 511)
    with create_pool(layout, memory_bytes=512 * 5 + 100, name_prefix=PREFIX) as pool:
        assert pool.num_blocks == 5
        assert pool.export().nbytes == 4096  # rounded up to a page


def test_segment_name_and_small_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    with make_pool(4) as pool:
        handle = pool.export()
        assert re.fullmatch(rf"{PREFIX}-{os.getpid()}-[0-9a-f]{{32}}", handle.name)
        assert handle.epoch in handle.name and handle.owner_pid == os.getpid()
        assert os.stat(f"{SHM_DIR}/{handle.name}").st_mode & 0o777 == 0o600
    monkeypatch.setattr(kvpool.host, "shm_free_bytes", lambda shm_dir=SHM_DIR: 60_000)
    message = (
        "/dev/shm has 60.00 kB (58.59 KiB) free, the pool needs 1.05 MB (1.00 MiB) (2048 blocks "
        "x 512 B); enlarge /dev/shm (e.g. docker --shm-size) or ask for fewer blocks"
    )
    with pytest.raises(OutOfBlocks, match=f"^{re.escape(message)}$"):
        make_pool(2048)


def test_handle_round_trips_through_json() -> None:
    with make_pool(4, dtype="bf16") as pool:
        handle = pool.export()
        data = json.loads(json.dumps(handle.to_dict()))
        assert PoolHandle.from_dict(data) == handle
    cuda = PoolHandle(
        backend="cuda", name="", nbytes=2 << 20, num_blocks=4, layout=make_layout(),
        epoch="e" * 32, ipc_handle=bytes(range(64)), device_id=1, device_uuid="GPU-x",
        owner_pid=7,
    )
    data = json.loads(json.dumps(cuda.to_dict()))
    assert isinstance(data["ipc_handle"], str)
    assert PoolHandle.from_dict(data) == cuda
    with pytest.raises(InvalidArgument, match="pool handle lacks layout, epoch"):
        PoolHandle.from_dict({"backend": "host", "nbytes": 1, "num_blocks": 1})
    message = "nbytes 100 is less than the 4 blocks' 2048 bytes"
    with pytest.raises(InvalidArgument, match=message):
        PoolHandle.from_dict({**data, "nbytes": 100})
    with pytest.raises(InvalidArgument, match="64-byte IPC handle, got 3 bytes"):
        PoolHandle.from_dict({**data, "ipc_handle": "AAAA"})


@pytest.mark.parametrize(
    ("dtype", "torch_dtype", "numpy_dtype"),
    [
        ("fp32", "float32", np.float32),
        ("fp16", "float16", np.float16),
        ("bf16", "bfloat16", np.uint16),
        ("fp8", "float8_e4m3fn", np.uint8),
        ("int8", "uint8", np.uint8),
        ("int4", "uint8", np.uint8),
    ],
)
def test_views_are_typed_and_zero_copy(dtype: str, torch_dtype: str, numpy_dtype: type) -> None:
    import torch

    with make_pool(5, dtype=dtype) as pool:
        layout = pool.layout
        view, array = pool.view(), pool.numpy_view()
        handle = pool.export()
        if layout.is_quantized:
            shape: tuple[int, ...] = (5, layout.bytes_per_block)
        else:
            shape = (5, 2, 2, 4, 2, 8)
        assert tuple(view.shape) == shape == handle.shape == array.shape
        assert view.dtype == getattr(torch, torch_dtype) and array.dtype == numpy_dtype
        assert tuple(s * view.element_size() for s in view.stride()) == handle.strides
        assert array.strides == handle.strides
        assert view.data_ptr() == array.ctypes.data  # one mapping, no copy
        assert pool.block(3).data_ptr() == view.data_ptr() + 3 * layout.bytes_per_block
        assert view.view(torch.uint8).sum() == 0  # a new segment is zeroed
        raw = array.view(np.uint8).reshape(5, -1)
        raw[3] = pattern(3, layout.bytes_per_block, 0)
        assert bytes(pool.block(3).contiguous().view(torch.uint8).reshape(-1).numpy()) == bytes(
            raw[3]
        )


def test_attach_shares_memory_in_both_directions() -> None:
    import torch

    with make_pool(4, dtype="fp32") as pool, attach(pool.export().to_dict()) as mapping:
        mine, theirs = pool.view(), mapping.view()
        assert mine.data_ptr() != theirs.data_ptr()  # a second mapping of the same pages
        mine[1, 0, 1] = 2.5  # written after attach: a copy would not see it
        assert torch.all(theirs[1, 0, 1] == 2.5)
        theirs[2].fill_(-1.0)
        assert torch.all(pool.block(2) == -1.0) and pool.block(3).abs().sum() == 0


def test_close_is_idempotent_and_views_outlive_it() -> None:
    pool = make_pool(4, dtype="fp32")
    handle = pool.export()
    mapping = attach(handle)
    view, array, theirs = pool.view(), pool.numpy_view(), mapping.view()
    view[0].fill_(1.0)
    pool.close()
    pool.close()
    assert segments() == []  # unlinked at once
    assert float(view[0].sum()) == 256.0 and float(array[0].sum()) == 256.0  # still mapped
    assert float(theirs[0].sum()) == 256.0
    with pytest.raises(InvalidArgument, match="HostBlockPool is closed"):
        pool.view()
    with pytest.raises(InvalidArgument, match="HostBlockPool is closed"):
        pool.alloc(1)
    gone = (
        f"shared-memory segment {handle.name!r} (pool epoch {handle.epoch}) is gone: its owner "
        f"(pid {os.getpid()}) closed the pool or exited; fetch the pool handle again"
    )
    with pytest.raises(StalePool, match=f"^{re.escape(gone)}$"):
        attach(handle)
    mapping.close()
    mapping.close()
    with pytest.raises(InvalidArgument, match="HostPoolMapping is closed"):
        mapping.numpy_view()
    del view, array, theirs


def test_attach_rejects_odd_names() -> None:
    with make_pool(2) as pool:
        data = pool.export().to_dict()
    with pytest.raises(InvalidArgument, match="is not a plain file name"):
        attach({**data, "name": "../etc/passwd"})


# --- across processes -----------------------------------------------------------------------


def test_processes_share_the_pool_byte_for_byte() -> None:
    with make_pool(8, dtype="bf16") as pool:
        handle = pool.export().to_dict()
        written, mine, seed = [1, 4, 6], 7, 5
        writer = SPAWN.Process(target=_writer, args=(handle, written, seed))
        writer.start()
        writer.join(60)
        assert writer.exitcode == 0
        attached, go, results = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
        reader = SPAWN.Process(
            target=_reader, args=(handle, written, seed, mine, attached, go, results)
        )
        reader.start()
        assert attached.wait(60)
        raw_blocks(pool)[0] = 0xAB  # after the reader attached: it must see this
        go.set()
        assert results.get(timeout=60) == []
        reader.join(60)
        assert reader.exitcode == 0
        blocks = raw_blocks(pool)
        assert np.array_equal(blocks[mine], pattern(mine, blocks.shape[1], seed + 1))
        for i in written:
            assert np.array_equal(blocks[i], pattern(i, blocks.shape[1], seed))
        # Attached processes exited and unlinked nothing (no resource-tracker cleanup).
        assert segments() == [handle["name"]]


def test_sigkilled_owner_segment_is_reclaimed_by_next_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefix = f"{PREFIX}-kill"
    proc, name = _run_owner(prefix)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert segments(prefix) == [name]  # nobody could clean up
    with make_pool(2, prefix=prefix) as pool:
        assert segments(prefix) == [pool.export().name]
    assert f"reclaimed stale shared-memory segment {name}" in caplog.text


def test_reclaim_spares_live_owners() -> None:
    prefix = f"{PREFIX}-live"
    done = subprocess.Popen(["true"])
    done.wait()
    dead_pid = done.pid
    path = f"{SHM_DIR}/{prefix}-{dead_pid}-{'a' * 32}"
    other = f"{SHM_DIR}/{prefix}x-{dead_pid}-{'b' * 32}"  # another prefix: never touched
    with make_pool(2, prefix=prefix) as live:
        for p in (path, other):
            with open(p, "wb"):
                pass
        try:
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a live owner in a pid namespace we cannot see
            assert reclaim_stale_segments(prefix) == []
            os.close(fd)
            assert reclaim_stale_segments(prefix) == [os.path.basename(path)]
            assert os.path.exists(other) and os.path.exists(f"{SHM_DIR}/{live.export().name}")
        finally:
            for p in (path, other):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)


@pytest.mark.parametrize("chain", [False, True])
def test_sigterm_unlinks_owner_segment(chain: bool, tmp_path: Any) -> None:
    prefix = f"{PREFIX}-term"
    marker = str(tmp_path / "host-handler-ran") if chain else None
    proc, name = _run_owner(prefix, cleanup=True, chain_marker=marker)
    assert segments(prefix) == [name]
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(30)
    assert segments(prefix) == []
    if chain:  # the program's own handler still ran, after the unlink
        assert proc.exitcode == 3 and open(marker or "").read() == "ran"
    else:  # and without one, the process still dies of SIGTERM
        assert proc.exitcode == -signal.SIGTERM


def test_owner_pool_is_not_picklable() -> None:
    import pickle

    with make_pool(2) as pool, pytest.raises(TypeError, match=r"pass pool.export\(\)"):
        pickle.dumps(pool)


def test_host_pool_class() -> None:
    with HostBlockPool(make_layout(), 3, name_prefix=PREFIX, reserve=False) as pool:
        assert pool.backend == "host" and pool.export().backend == "host"
        assert repr(pool).startswith("HostBlockPool(fp16, 3 blocks x 512 B, 3/3 free")


def test_cuda_backend_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    handle = PoolHandle(
        backend="cuda", name="", nbytes=2 << 20, num_blocks=2, layout=make_layout(),
        epoch="e" * 32, ipc_handle=bytes(64), device_id=0, device_uuid="GPU-x", owner_pid=1,
    )
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    no_cupy = r"^the cuda backend needs CuPy: pip install 'radixkv\[cuda12\]' \(or \[cuda13\]\)"
    with pytest.raises(Unavailable, match=no_cupy):
        create_pool(make_layout(), num_blocks=2, backend="cuda")
    with pytest.raises(Unavailable, match=no_cupy):
        attach(handle)
    assert not kvpool.cuda.is_available()
    no_gpu = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "cupy", no_gpu)
    message = "no CUDA GPU is visible (cupy.cuda.is_available() is False); use backend='host'"
    with pytest.raises(Unavailable, match=f"^{re.escape(message)}$"):
        create_pool(make_layout(), num_blocks=2, backend="cuda")


def test_importing_kvpool_imports_neither_torch_nor_cupy() -> None:
    code = "import sys, kvpool; print(sorted({'torch', 'cupy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_signal_cleanup_keeps_an_ignored_signal_ignored() -> None:
    before = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        install_signal_cleanup([signal.SIGUSR1])
        with make_pool(2) as pool:
            name = pool.export().name
            os.kill(os.getpid(), signal.SIGUSR1)  # handled before the next bytecode
            assert segments() == []  # unlinked; this process goes on, its pool still mapped
            assert int(pool.numpy_view().sum()) == 0
            assert name not in os.listdir(SHM_DIR)
    finally:
        signal.signal(signal.SIGUSR1, before)
        kvpool.host._installed.discard(signal.SIGUSR1)


def _rss_kib(address: int) -> int:
    """Resident KiB of this process's mapping that contains `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


@pytest.mark.parametrize("prefault", [True, False])
def test_an_attached_pool_is_mapped_in_ahead_of_use(prefault: bool) -> None:
    """An attaching process's mapping gets its pages mapped in the background (no page fault per
    4 KiB at its first copies); without prefault nothing is mapped until touched."""
    with make_pool(8192) as pool:
        handle = pool.export()
        mapping = kvpool.host.HostPoolMapping(handle, prefault=prefault)
        try:
            address = mapping.numpy_view().__array_interface__["data"][0]
            if prefault:
                assert mapping.prefault is not None
                assert mapping.prefault.done.wait(30)
                assert mapping.prefault.filled == handle.nbytes
                assert _rss_kib(address) * 1024 >= handle.nbytes - 4096
            else:
                assert mapping.prefault is None
                assert _rss_kib(address) == 0
        finally:
            mapping.close()


def test_the_owner_maps_its_pool_in_ahead_of_use() -> None:
    """The owning process's own copies into blocks (a peer fetch's recv_into, disk promotions)
    pay no page fault per 4 KiB either: its mapping is filled in the background too."""
    with make_pool(8192) as pool:
        assert pool.prefault is not None and pool.prefault.done.wait(30)
        assert pool.prefault.filled == pool.nbytes
        address = pool.numpy_view().__array_interface__["data"][0]
        assert _rss_kib(address) * 1024 >= pool.nbytes - 4096
