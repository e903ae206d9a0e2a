"""The data channel of a peer fetch: whole KV blocks over a plain TCP socket (TLS when the
cluster has it), sent straight from the holder's pool and received straight into the
requester's pool block.

FetchBlocks (gRPC, with the cluster's token) is the handshake: the holder checks the layout,
pins the blocks and answers with an offer (a data port it listens on for this fetch only and a
one-time ticket). The requester connects, sends the ticket, and reads, for each block:

    header  <I Q>  the prompt's block index, XXH3-64 of the block's bytes
    bytes_per_block bytes

The holder computes the checksum from the pinned block just before sending it; the requester
computes it again over its pool block after `recv_into` wrote it there (the one copy) and
stops at the first mismatch. Measured against gRPC messages and a plain TCP copy in
docs/benchmarks.md (peer fetch).
"""

from __future__ import annotations

import hmac
import secrets
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence

import xxhash

from radixkv.protocol.env import normalize_target
from radixkv.protocol.errors import InvalidArgument

HEADER = struct.Struct("<IQ")
TICKET_BYTES = 16
ACCEPT_S = 5.0  # the requester connects within this, or the fetch ends unsent


def checksum(block: memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(block))


def new_ticket() -> bytes:
    return secrets.token_bytes(TICKET_BYTES)


def server_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The holder's TLS (the same PEM files as its gRPC port), None without."""
    if not (cert and key):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise InvalidArgument(f"cannot read TLS files: {e}") from None
    return ctx


def client_context(ca: str | None) -> ssl.SSLContext | None:
    """The requester's TLS: trust `ca` (the cluster's RADIXKV_TLS_CA), None without."""
    if not ca:
        return None
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise InvalidArgument(f"cannot read the TLS CA {ca!r}: {e}") from None


def data_host(address: str) -> str:
    """Where a member's data connections are: the host of its gRPC address, or loopback for a
    member on a Unix socket (on this host, its data listener is on 127.0.0.1)."""
    target = normalize_target(address)
    if target.startswith("unix:"):
        return "127.0.0.1"
    for scheme in ("dns:///", "ipv4:", "ipv6:"):
        target = target.removeprefix(scheme)
    return target.rsplit(":", 1)[0].strip("[]")


def listen(host: str) -> socket.socket:
    """A listener on an ephemeral port of `host` for one fetch."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, 0), family=family, backlog=4)


def accept(listener: socket.socket, ticket: bytes, tls: ssl.SSLContext | None,
           active: Callable[[], bool]) -> socket.socket | None:
    """The connection that presents `ticket` within ACCEPT_S (others are closed), or None."""
    end = time.monotonic() + ACCEPT_S
    listener.settimeout(0.2)
    while time.monotonic() < end and active():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        try:
            conn.settimeout(max(0.05, end - time.monotonic()))
            if tls is not None:
                conn = tls.wrap_socket(conn, server_side=True)
            if hmac.compare_digest(recv_exact(conn, TICKET_BYTES) or b"", ticket):
                conn.settimeout(None)
                return conn
        except (OSError, ssl.SSLError):
            pass
        conn.close()
    return None


def send_blocks(conn: socket.socket, first: int, views: Sequence[memoryview],
                before: Callable[[int], bool], corrupt: int = -1) -> int:
    """Send blocks first.. (header, bytes); `before(index)` may stop the send (False). The
    blocks sent. `corrupt`: a test hook, that block's bytes leave with one byte flipped."""
    for n, view in enumerate(views):
        index = first + n
        if not before(index):
            return n
        conn.sendall(HEADER.pack(index, checksum(view)))
        if index == corrupt:
            damaged = bytearray(view)
            damaged[0] ^= 0xFF
            conn.sendall(damaged)
        else:
            conn.sendall(view)
    return len(views)


def connect(host: str, port: int, ticket: bytes, tls: ssl.SSLContext | None,
            timeout_s: float) -> socket.socket:
    conn = socket.create_connection((host, port), timeout=max(0.01, timeout_s))
    if tls is not None:
        conn = tls.wrap_socket(conn, server_hostname=host)
    conn.sendall(ticket)
    return conn


def recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if recv_into(conn, memoryview(buf), None) else None


def recv_into(conn: socket.socket, view: memoryview, end: float | None) -> bool:
    """Fill `view` from `conn`; False if the peer closed first (timeouts raise)."""
    got = 0
    while got < len(view):
        if end is not None:
            conn.settimeout(max(0.001, end - time.monotonic()))
        n = conn.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def recv_block(conn: socket.socket, index: int, target: memoryview, end: float) -> bool | None:
    """Block `index` into `target`: True verified, False its checksum failed, None the stream
    ended or was not this block."""
    header = bytearray(HEADER.size)
    if not recv_into(conn, memoryview(header), end):
        return None
    got, crc = HEADER.unpack(header)
    if got != index or not recv_into(conn, target, end):
        return None
    return bool(checksum(target) == crc)
