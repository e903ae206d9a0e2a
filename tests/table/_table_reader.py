"""A reader process for tests/table/test_table_readers.py: maps the service's lookup table and
peeks prompts in a loop until killed or for SECONDS, writing one JSON line per read (the writer's
last sequence before and after it, the namespace, the prompt's index, the pool block ids found).

    python _table_reader.py SOCKET PROMPTS.json SECONDS OUT.jsonl
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from radixkv.client import Client
from radixkv.table.reader import TableReader


def main() -> None:
    socket, prompts_path, seconds, out_path = sys.argv[1:5]
    prompts = [np.asarray(p, np.uint32) for p in json.load(open(prompts_path))]
    with Client(socket) as kv:
        info = kv.pool_info()
    reader = TableReader(info.table_name, info.table_nbytes, info.epoch)
    deadline = time.monotonic() + float(seconds)
    with open(out_path, "w") as out:
        print("reading", flush=True)
        i = 0
        while time.monotonic() < deadline:
            ns, k = ("a", "b")[i % 2], i % len(prompts)
            before = reader.sequence
            peek = reader.peek(ns, prompts[k])
            after = reader.sequence
            out.write(json.dumps([before, after, ns, k, peek.num_blocks,
                                  list(peek.block_ids)]) + "\n")
            i += 1
    print(json.dumps({"reads": reader.reads, "retries": reader.retries,
                      "gave_up": reader.gave_up}), flush=True)


if __name__ == "__main__":
    main()
