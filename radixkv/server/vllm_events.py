"""KV events on vLLM's own wire, for the routers that read vLLM's events (llm-d's precise
prefix-cache scorer, Dynamo's KV router, vllm-router's kv_aware policy):

    radixkv serve --kv-events-endpoint tcp://*:5557 [--kv-events-replay-endpoint tcp://*:5558]
                  [--kv-events-topic T] [--kv-events-encoding map|array]

A ZMQ PUB sends multipart `(topic, sequence as 8 bytes big-endian, msgpack(EventBatch))`, the
sequence from 0, exactly as vLLM's `vllm/distributed/kv_events.py` does; the PUB binds when the
endpoint has `*`, `::`, `ipc://` or `inproc://` and connects otherwise (a subscriber that binds,
as llm-d's does). The replay ROUTER (always bound) answers `[b"", start 8 B]` with every
buffered batch from that sequence on, then `(b"", -1 as 8 B signed, b"")`.

The batches are read from the service's event log (radixkv/service/events.py), so every
BlockStored / BlockRemoved / cleared namespace of every token-keyed namespace goes out:

    EventBatch [ts, events, data_parallel_rank]           (always positional, as vLLM's)
    BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                lora_name}                                 radixkv's 64-bit chain hashes
    BlockRemoved{block_hashes, medium}
    AllBlocksCleared{}                                     a Clear (of any namespace)

`map` (vLLM since mid-2026) sends each event as a map tagged `type`; `array` sends it
positionally, tag first, as earlier vLLM and the consumers built on it read it. `medium` is
where the blocks are: `CPU` for a host pool, `GPU` for a cuda pool, `STORAGE` for the disk tier
below the pool. A block demoted to disk is a BlockRemoved from the pool's medium and a
BlockStored in `STORAGE` (its tokens and parent kept here from its first BlockStored, with a
disk tier only); one promoted back is a BlockRemoved from `STORAGE` before its BlockStored in
the pool's medium; one the disk tier drops is a BlockRemoved from `STORAGE`. So a consumer holds
each block in one medium, as the member does. The hashes chain from the namespace's salt, so
two namespaces (models, salts, LoRAs) never share one; `token_ids` are always sent, so a
consumer may key blocks by their tokens instead. Key-keyed namespaces (SGLang's pages) carry no
token ids and are not sent.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq

from radixkv.protocol.errors import InvalidArgument
from radixkv.service.events import EventLog, KVEvent

log = logging.getLogger("radixkv.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENCODINGS = ("map", "array")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _event_types(array: bool) -> tuple[type, type, type]:
    """BlockStored, BlockRemoved and AllBlocksCleared (tagged with vLLM's class names), as maps
    or arrays."""

    class Event(msgspec.Struct, omit_defaults=True, tag=True, array_like=array, gc=False):
        pass

    class Stored(Event, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class Removed(Event, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None

    class Cleared(Event, tag="AllBlocksCleared"):
        pass

    return Stored, Removed, Cleared


@dataclass(frozen=True, slots=True)
class VllmEventsConfig:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    encoding: str = "map"
    buffer_steps: int = 10_000  # batches kept for replay (vLLM's default)
    hwm: int = 100_000


@dataclass(slots=True)
class Kept:
    """A cached block as its BlockStored said it (kept to announce it again in STORAGE)."""

    parent: int | None
    tokens: np.ndarray  # its token ids, uint32
    on_disk: bool = False


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class VllmEventPublisher:
    """Follows `events` from its first event on and publishes each read as one batch."""

    POLL_S = 0.05  # the longest a new event waits for its batch

    def __init__(self, events: EventLog, config: VllmEventsConfig, medium: str,
                 disk: bool = False) -> None:
        """`medium`: the pool's; `disk`: a disk tier is below it (its blocks are sent as
        STORAGE, which needs each pooled block's tokens and parent kept in `_kept`)."""
        if config.encoding not in ENCODINGS:
            raise InvalidArgument(f"--kv-events-encoding must be one of {', '.join(ENCODINGS)}, "
                                  f"not {config.encoding!r}")
        self.events, self.config, self.medium = events, config, medium
        self._stored, self._removed, self._cleared = _event_types(config.encoding == "array")
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[Any] | None = None
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise InvalidArgument(f"KV events endpoint: {e}") from None
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._after = 0  # from the first event: what a warm start restored goes out too
        # with a disk tier: namespace -> block hash -> every block in the pool or on disk that
        # was stored since the start
        self._kept: dict[str, dict[int, Kept]] | None = {} if disk else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Publish what is left, close the sockets and remove the files of the ipc endpoints
        bound here (ZMQ leaves them behind)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._close_sockets()
        bound = [self.config.replay_endpoint or ""]
        if binds(self.config.endpoint):
            bound.append(self.config.endpoint)
        for endpoint in bound:
            path = endpoint.removeprefix("ipc://")
            if path != endpoint and os.path.exists(path) and stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            batch, lagged = self.events.read(self._after, timeout=0 if stopping else self.POLL_S)
            if lagged:  # events dropped before this thread read them: consumers start over
                log.warning("KV events: the event buffer overran; sending AllBlocksCleared")
                self._after = self.events.last_sequence
                self._publish([self._cleared()])
                continue
            if batch:
                self._after = batch[-1].sequence
                converted = [e for ev in batch for e in self._convert(ev)]
                if converted:
                    self._publish(converted)
            elif stopping:
                return

    def _publish(self, events: list[Any]) -> None:
        payload = self._encoder.encode(EventBatch(time.time(), events, 0))
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames, not 3: ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _convert(self, ev: KVEvent) -> list[Any]:
        if ev.kind == "cleared":
            if self._kept is not None:
                self._kept.pop(ev.namespace, None)
            return [self._cleared()]
        if ev.key_size or ev.kind.startswith("window"):
            return []  # page keys carry no token ids; window parts leave the positions
        hashes = list(ev.block_hashes)
        kept = None if self._kept is None else self._kept.setdefault(ev.namespace, {})
        if ev.kind == "removed":  # without pool blocks: the disk tier below dropped them
            out = [self._removed(hashes, self.medium if ev.block_ids else "STORAGE")]
            if kept is not None:
                if ev.block_ids and ev.tier == "disk":
                    out += self._to_disk(kept, hashes)
                else:
                    for h in hashes:
                        kept.pop(h, None)
            return out
        size = self.events.block_size
        tokens = np.frombuffer(ev.tokens, "<u4", len(hashes) * size)
        out = []
        if kept is not None:
            promoted = [h for h in hashes if h in kept and kept[h].on_disk]
            if promoted:
                out.append(self._removed(promoted, "STORAGE"))
            parent = ev.parent_block_hash
            for i, h in enumerate(hashes):
                kept[h] = Kept(parent, tokens[i * size:(i + 1) * size])
                parent = h
        out.append(self._stored(hashes, ev.parent_block_hash, tokens.tolist(), size, None,
                                self.medium, None))
        return out

    def _to_disk(self, kept: dict[int, Kept], hashes: list[int]) -> list[Any]:
        """A BlockStored in STORAGE for each of `hashes` (demoted: not a chain, each with its
        own parent)."""
        out = []
        for h in hashes:
            block = kept.get(h)
            if block is not None:
                block.on_disk = True
                out.append(self._stored([h], block.parent, block.tokens.tolist(),
                                        self.events.block_size, None, "STORAGE", None))
        return out
