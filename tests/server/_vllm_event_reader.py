"""Run by .venv-vllm's python: read a radixkv member's KV events with vLLM's own structs
(vllm.distributed.kv_events), as a vLLM consumer would, and print them as JSON lines.

    python _vllm_event_reader.py ENCODING replay REPLAY_ENDPOINT START
        -> every batch the replay ROUTER resends from START, then {"end": true}
    python _vllm_event_reader.py ENCODING live ENDPOINT COUNT
        -> {"subscribed": true} once subscribed, then the first COUNT batches published
    python _vllm_event_reader.py ENCODING file GOLDEN.json 0
        -> every batch of a golden fixture (a JSON list of payloads in hex), as sequence 0...

Each batch line: {"seq", "topic", "ts", "rank", "events": [{"type": vLLM's class, fields}]}.
ENCODING `array` decodes with vLLM's structs made positional (as earlier vLLM sent them)."""
# (no `from __future__ import annotations`: msgspec resolves the local classes of `decoder`)


import json
import sys

import msgspec
import zmq
from vllm.distributed import kv_events as ke


def decoder(encoding: str) -> msgspec.msgpack.Decoder:
    if encoding == "map":
        return msgspec.msgpack.Decoder(type=ke.KVEventBatch)

    class Stored(ke.BlockStored, array_like=True, tag="BlockStored"):
        pass

    class Removed(ke.BlockRemoved, array_like=True, tag="BlockRemoved"):
        pass

    class Cleared(ke.AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
        pass

    class Batch(ke.EventBatch):
        events: list[Stored | Removed | Cleared]

    return msgspec.msgpack.Decoder(type=Batch)


def line(dec: msgspec.msgpack.Decoder, topic: bytes, seq: bytes, payload: bytes) -> str:
    batch = dec.decode(payload)
    events = []
    for ev in batch.events:
        base = next(c for c in type(ev).__mro__ if c.__module__ == ke.__name__)
        events.append({"type": base.__name__, **msgspec.structs.asdict(ev)})
    return json.dumps({"seq": int.from_bytes(seq, "big"), "topic": topic.decode(),
                       "ts": batch.ts, "rank": batch.data_parallel_rank, "events": events})


def main() -> None:
    encoding, mode, endpoint, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dec, ctx = decoder(encoding), zmq.Context()
    if mode == "file":
        with open(endpoint) as f:
            for i, payload in enumerate(json.load(f)):
                print(line(dec, b"", i.to_bytes(8, "big"), bytes.fromhex(payload)), flush=True)
        return
    if mode == "replay":
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart([b"", n.to_bytes(8, "big")])
        while True:
            _, topic, seq, payload = sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                print(json.dumps({"end": True}), flush=True)
                return
            print(line(dec, topic, seq, payload), flush=True)
    sock = ctx.socket(zmq.SUB)
    sock.connect(endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.RCVTIMEO = 30_000
    print(json.dumps({"subscribed": True}), flush=True)
    for _ in range(n):
        print(line(dec, *sock.recv_multipart()), flush=True)


if __name__ == "__main__":
    main()
