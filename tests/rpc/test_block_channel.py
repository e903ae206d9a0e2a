"""The peer fetch's data channel (radixkv/rpc/block_channel.py) between two threads over real
TCP loopback: the ticket gate, blocks and their checksums, and the ways a read stops."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from radixkv.rpc import block_channel

BLOCK = 64 << 10


def blocks(n: int, seed: int = 0) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()) for _ in range(n)]


def serve(views: list[memoryview], corrupt: int = -1, stop_at: int = -1) -> tuple[int, bytes]:
    """A holder in a thread: listens, accepts the ticket, sends `views` as blocks 3.."""
    listener = block_channel.listen("127.0.0.1")
    ticket = block_channel.new_ticket()

    def run() -> None:
        with listener:
            conn = block_channel.accept(listener, ticket, None, lambda: True)
        if conn is not None:
            with conn:
                block_channel.send_blocks(conn, 3, views, lambda i: i != stop_at, corrupt)

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()[1], ticket


def read(port: int, ticket: bytes, n: int) -> tuple[list[bytes], bool | None]:
    """Blocks 3.. as the requester reads them, and how the read ended."""
    got: list[bytes] = []
    end = time.monotonic() + 10
    with block_channel.connect("127.0.0.1", port, ticket, None, 10) as conn:
        for i in range(n):
            buf = bytearray(BLOCK)
            ok = block_channel.recv_block(conn, 3 + i, memoryview(buf), end)
            if not ok:
                return got, ok
            got.append(bytes(buf))
    return got, True


def test_blocks_arrive_whole_and_verified_after_the_ticket():
    views = blocks(5)
    port, ticket = serve(views)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as stranger:
        stranger.sendall(b"\0" * block_channel.TICKET_BYTES)  # the wrong ticket: closed unread
        assert stranger.recv(1) == b""
    got, ended = read(port, ticket, 5)
    assert ended is True and got == [bytes(v) for v in views]


def test_a_damaged_block_fails_its_checksum_and_the_run_before_it_stands():
    views = blocks(5, seed=1)
    port, ticket = serve(views, corrupt=5)  # prompt block 5: the third sent
    got, ended = read(port, ticket, 5)
    assert ended is False and got == [bytes(v) for v in views[:2]]


def test_a_send_that_stops_ends_the_read_with_what_came():
    views = blocks(5, seed=2)
    port, ticket = serve(views, stop_at=6)
    got, ended = read(port, ticket, 5)
    assert ended is None and got == [bytes(v) for v in views[:3]]


def test_a_holder_that_goes_quiet_times_out():
    listener = block_channel.listen("127.0.0.1")
    ticket = block_channel.new_ticket()
    with listener, block_channel.connect("127.0.0.1", listener.getsockname()[1], ticket, None,
                                         10) as conn:
        with pytest.raises(TimeoutError):
            block_channel.recv_block(conn, 0, memoryview(bytearray(BLOCK)),
                                     time.monotonic() + 0.2)


@pytest.mark.parametrize(("address", "host"), [
    ("10.0.0.1:50051", "10.0.0.1"), ("dns:///kv-a.internal:50051", "kv-a.internal"),
    ("ipv6:[::1]:50051", "::1"), ("[fd00::2]:50051", "fd00::2"),
    ("unix:///tmp/rkv/a.sock", "127.0.0.1"), ("/tmp/rkv/a.sock", "127.0.0.1")])
def test_the_data_host_of_a_member_address(address, host):
    assert block_channel.data_host(address) == host
