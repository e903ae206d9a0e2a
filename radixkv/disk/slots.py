"""The disk tier's file: a preallocated array of fixed-size slots, one cached block each.

    file   [file header: FILE_HEADER bytes][slot 0][slot 1] ... [slot N-1]
    slot   [slot header | namespace | the block's token ids | pad to 4 KiB][payload | pad]

The file header names the format, the pool layout the payloads belong to (a fingerprint of the
layout; a directory written for another layout is refused), the slot geometry and the
generation: the count of service starts on this file, bumped at every open. A slot header
holds what rebuilding the index needs without the payload (namespace, the block's position in
its sequence, its chain hash and its parent's, its tokens) and two checksums: `meta_crc`, a CRC-32
over the header fields, namespace and tokens (checked when the file is scanned at start), and
`crc`, over all of that and the payload (checked before a promoted block is handed to anyone):
XXH3-64 of the payload seeded with the CRC-32 of the rest, cut to 32 bits (XXH3 hashes several
times faster than zlib's CRC-32, and promotion checks every byte it reads). A slot whose
write was torn by a crash fails one of them and is dropped, never served; a slot with a
generation newer than the file's is dropped too.

The payload is the block's bytes in the pool's format (`Slab.block_bytes`), quantized formats
and sink blocks included. I/O is positional and vectored (os.pwritev / os.preadv), so one
thread may write while others read; a run of adjacent slots is one call either way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from kvpool.layout import KVLayout
from radixkv.disk.claim import lock_directory, open_owned
from radixkv.protocol.tokens import TOKEN_BYTES

log = logging.getLogger(__name__)

FILE_NAME = "radixkv-disk-tier.slots"
FILE_MAGIC = b"RKVDISK2"
OLD_MAGICS = (b"RKVDISK1",)  # earlier formats: their slots are dropped, the file reused
FILE_HEADER = 4096
_FILE = struct.Struct("<8sIQQQQQ32s")  # magic, crc, generation, slots, slot, meta, payload, fp
SLOT_MAGIC = b"RKVS"
_SLOT = struct.Struct("<4sIIQQ16s16sIIHH")  # magic crc meta_crc gen seq hash parent pos len
ALIGN = 4096
SINK = 1  # flags: the payload is a sink-region block's (sink_bytes_per_block)
ZERO_HASH = bytes(16)


def payload_check(payload: memoryview | bytes, meta_crc: int, body: bytes) -> int:
    """The slot's `crc`: XXH3-64 of the payload seeded with the CRC-32 of the header fields."""
    seed = zlib.crc32(struct.pack("<I", meta_crc) + body)
    return xxhash.xxh3_64_intdigest(payload, seed) & 0xFFFFFFFF


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def chain_hash(parent: bytes, namespace: str, tokens: bytes) -> bytes:
    """A block's key: its parent's key and its own token ids (and the namespace at the root)."""
    seed = parent if parent != ZERO_HASH else namespace.encode()
    return hashlib.blake2b(tokens, digest_size=16, key=seed[:64]).digest()


def layout_fingerprint(layout: KVLayout) -> bytes:
    """32 bytes that change with anything that changes a block's bytes."""
    return hashlib.sha256(json.dumps(layout.to_dict(), sort_keys=True).encode()).digest()


@dataclass(frozen=True, slots=True)
class SlotMeta:
    """What a slot says about its block (without the payload)."""

    namespace: str
    hash: bytes
    parent: bytes
    position: int  # the block's index in its sequence
    tokens: bytes  # the block's token ids
    payload_len: int
    sink: bool
    generation: int
    seq: int  # write order within a generation


@dataclass(frozen=True, slots=True)
class Geometry:
    meta_bytes: int
    payload_bytes: int  # the largest block (a sink block on pools with sink tokens)

    @property
    def slot_bytes(self) -> int:
        return self.meta_bytes + _round_up(self.payload_bytes)

    @classmethod
    def of(cls, layout: KVLayout, max_namespace: int = 256) -> Geometry:
        meta = _round_up(_SLOT.size + max_namespace + layout.block_size * TOKEN_BYTES)
        payload = max(layout.bytes_per_block, layout.sink_bytes_per_block)
        return cls(meta, payload)


class BadTierFile(Exception):
    """The file exists but is not a disk tier of this layout and geometry."""


class SlotFile:
    """The open file: its directory locked, header checked or written, generation bumped,
    slots read and written."""

    def __init__(self, path: str, layout: KVLayout, num_slots: int) -> None:
        self.path = path
        self.geometry = Geometry.of(layout)
        self.num_slots = num_slots
        self.fingerprint = layout_fingerprint(layout)
        self.token_bytes = layout.block_size * TOKEN_BYTES
        # where a read puts the pads between payloads (shared by the reader threads: unread)
        self._discard = memoryview(bytearray(self.geometry.slot_bytes - self.geometry.meta_bytes))
        self.fd = -1
        self._lock = lock_directory(os.path.dirname(path) or ".")  # one server per directory
        try:
            self.fd = open_owned(path, os.O_RDWR | os.O_CREAT)
            self.generation = self._open_header()
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return FILE_HEADER + self.num_slots * self.geometry.slot_bytes

    @staticmethod
    def size_of(layout: KVLayout, num_slots: int) -> int:
        """The file's bytes for `num_slots` slots of `layout`'s blocks."""
        return FILE_HEADER + num_slots * Geometry.of(layout).slot_bytes

    @staticmethod
    def slots_in(layout: KVLayout, size_bytes: int) -> int:
        """How many slots a file of `size_bytes` holds."""
        return max(0, size_bytes - FILE_HEADER) // Geometry.of(layout).slot_bytes

    def _open_header(self) -> int:
        g = self.geometry
        raw = os.pread(self.fd, _FILE.size, 0)
        generation = 0
        if len(raw) == _FILE.size and raw[:8] == FILE_MAGIC:
            _, crc, gen, _, slot, meta, payload, fp = _FILE.unpack(raw)
            if crc != zlib.crc32(raw[12:]):
                raise BadTierFile(f"{self.path}: the file header fails its checksum")
            if fp != self.fingerprint or (slot, meta, payload) != (g.slot_bytes, g.meta_bytes,
                                                                   g.payload_bytes):
                raise BadTierFile(f"{self.path} holds a disk tier of another pool layout; give "
                                  "another --disk-dir or remove the file")
            generation = gen  # a new slot count keeps the slots both have
        elif raw[:8] in OLD_MAGICS:
            log.warning("%s was written in an earlier slot format: its blocks are dropped and "
                        "the file reused", self.path)
            os.ftruncate(self.fd, 0)  # every slot empty again (reallocated below)
        elif raw.strip(b"\0"):
            raise BadTierFile(f"{self.path} exists and is not a radixkv disk tier")
        if os.fstat(self.fd).st_size < self.size:
            os.posix_fallocate(self.fd, 0, self.size)  # ENOSPC now rather than mid-demotion
        elif os.fstat(self.fd).st_size > self.size:
            os.ftruncate(self.fd, self.size)
        generation += 1
        body = struct.pack("<QQQQQ32s", generation, self.num_slots, g.slot_bytes, g.meta_bytes,
                           g.payload_bytes, self.fingerprint)
        os.pwrite(self.fd, FILE_MAGIC + struct.pack("<I", zlib.crc32(body)) + body, 0)
        os.fsync(self.fd)
        return generation

    def offset(self, slot: int) -> int:
        return FILE_HEADER + slot * self.geometry.slot_bytes

    def encode_meta(self, meta: SlotMeta, payload: memoryview | bytes) -> bytes:
        """The slot's header region (padded to meta_bytes), both CRCs filled in."""
        ns = meta.namespace.encode()
        fields = struct.pack("<QQ16s16sIIHH", meta.generation, meta.seq, meta.hash, meta.parent,
                             meta.position, meta.payload_len, SINK if meta.sink else 0, len(ns))
        body = fields + ns + meta.tokens
        meta_crc = zlib.crc32(body)
        crc = payload_check(payload, meta_crc, body)
        head = SLOT_MAGIC + struct.pack("<II", crc, meta_crc) + body
        return head.ljust(self.geometry.meta_bytes, b"\0")

    def write(self, jobs: Sequence[tuple[int, bytes, memoryview | bytes] | int]) -> None:
        """Write (slot, encoded meta, payload) triples, and zero the header of each slot given
        alone (a tombstone), in order; runs of adjacent slots go in one pwritev."""
        run: list[tuple[int, bytes, memoryview | bytes]] = []
        for job in jobs:
            if isinstance(job, int):
                self._write_run(run)
                run = []
                os.pwrite(self.fd, bytes(ALIGN), self.offset(job))
            else:
                run.append(job)
        self._write_run(run)

    def _write_run(self, jobs: list[tuple[int, bytes, memoryview | bytes]]) -> None:
        g = self.geometry
        pad = bytes(g.slot_bytes - g.meta_bytes)
        i = 0
        ordered = sorted(jobs, key=lambda j: j[0])  # stable: one slot twice stays in order
        while i < len(ordered):
            j = i
            while j + 1 < len(ordered) and ordered[j + 1][0] == ordered[j][0] + 1 and j - i < 63:
                j += 1
            buffers: list[bytes | memoryview] = []
            for _, head, payload in ordered[i:j + 1]:
                buffers += [head, payload, pad[:g.slot_bytes - g.meta_bytes - len(payload)]]
            want = (j + 1 - i) * g.slot_bytes
            done = os.pwritev(self.fd, buffers, self.offset(ordered[i][0]))
            if done != want:
                raise OSError(f"short write to {self.path}: {done} of {want} bytes")
            i = j + 1

    def read_run(self, first: int, outs: Sequence[memoryview]) -> tuple[list[bytearray], int]:
        """Read slots first, first+1, ... in one os.preadv: each header into a buffer of its
        own (returned), each payload straight into its `outs` buffer (len payload_len), the
        pads discarded. Returns the headers and the bytes read; `check_run` checks them."""
        g = self.geometry
        heads = [bytearray(g.meta_bytes) for _ in outs]
        buffers: list[bytearray | memoryview] = []
        for head, out in zip(heads, outs, strict=True):
            buffers += [head, out]
            if pad := g.slot_bytes - g.meta_bytes - len(out):
                buffers.append(self._discard[:pad])
        return heads, os.preadv(self.fd, buffers, self.offset(first))

    def check_run(self, heads: Sequence[bytearray], got: int, metas: Sequence[SlotMeta],
                  outs: Sequence[memoryview]) -> list[bool]:
        """After `read_run`: for each of the run's slots, whether it was read whole, verifies
        its CRC and still holds its `metas` block."""
        g = self.geometry
        return [got >= k * g.slot_bytes + g.meta_bytes + len(out) and self._verify(head, meta, out)
                for k, (head, meta, out) in enumerate(zip(heads, metas, outs, strict=True))]

    def _verify(self, head: bytearray, meta: SlotMeta, payload: memoryview) -> bool:
        parsed = self._parse(bytes(head))
        if parsed is None or parsed[0] != meta:
            return False
        crc, meta_crc, body = parsed[1], parsed[2], parsed[3]
        return crc == payload_check(payload, meta_crc, body)

    def _parse(self, head: bytes) -> tuple[SlotMeta, int, int, bytes] | None:
        if head[:4] != SLOT_MAGIC:
            return None
        _, crc, meta_crc, gen, seq, h, parent, pos, plen, flags, ns_len = _SLOT.unpack_from(head)
        tok = self.token_bytes
        end = _SLOT.size + ns_len + tok
        if end > len(head) or plen > self.geometry.payload_bytes:
            return None
        body = head[12:end]
        if zlib.crc32(body) != meta_crc:
            return None
        try:
            ns = head[_SLOT.size:_SLOT.size + ns_len].decode()
        except UnicodeDecodeError:
            return None
        meta = SlotMeta(ns, h, parent, pos, head[_SLOT.size + ns_len:end], plen,
                        bool(flags & SINK), gen, seq)
        return meta, crc, meta_crc, body

    def scan(self, chunk_slots: int = 256) -> Iterator[tuple[int, SlotMeta | None]]:
        """Every slot's header (None: empty, torn or not verifying), in slot order."""
        g = self.geometry
        heads = [bytearray(g.meta_bytes) for _ in range(chunk_slots)]
        for first in range(0, self.num_slots, chunk_slots):
            n = min(chunk_slots, self.num_slots - first)
            for k in range(n):
                got = os.preadv(self.fd, [heads[k]], self.offset(first + k))
                if got != g.meta_bytes:
                    yield first + k, None
                    continue
                parsed = self._parse(bytes(heads[k]))
                if parsed is None or parsed[0].generation > self.generation:
                    yield first + k, None
                else:
                    yield first + k, parsed[0]

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._lock >= 0:  # last: the directory is free once the file is closed
            os.close(self._lock)
            self._lock = -1


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What the tier knows of a pool block: enough to write its slot."""

    namespace: str
    hash: bytes
    parent: bytes
    position: int
    tokens: bytes
    sink: bool  # its bytes are in the sink format (a promoted block: its slot's format)
