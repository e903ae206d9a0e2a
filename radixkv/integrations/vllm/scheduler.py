"""The scheduler side of the vLLM connector: which prefix radixkv has, and what to store.

- `matched`: read the request's cached prefix (whole blocks, the last token always left to
  compute) from radixkv's lookup table in shared memory (radixkv/table/): no call on vLLM's
  scheduler thread. The worker pins it with a Match before it copies (`Load` with lease 0); a
  block evicted in between is a failed load there, which vLLM recomputes. Where radixkv
  publishes no table, or where a member fetches from peers (`--peer-fetch`: a prompt the table
  lacks may be on another member), a Match here pins it instead, and answers None ("ask again
  next step") while the member fetches.
- `finished`: at a request's end, if the table lacks some of its computed whole blocks, hand
  the worker a `Save`: it Matches with allocation, copies the new pages, Inserts. vLLM keeps
  the request's pages until the worker reports the save done (delayed free), so a
  conversation's next turn finds its prompt and answer.

radixkv down, restarting or refusing is a miss (`link.Down`), never an error.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.layout import KVLayout
from radixkv.client import STORE_ALL, Client
from radixkv.integrations.link import Down, LayoutMismatch, Link, check_pool_layout
from radixkv.integrations.vllm.messages import Load, Save
from radixkv.integrations.vllm.stats import Stats
from radixkv.protocol.errors import Unavailable
from radixkv.protocol.values import LeaseMatch
from radixkv.table.reader import Peek

DTYPES = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}


@dataclass(frozen=True, slots=True)
class Pending:
    lease_id: int  # 0: read from the lookup table, nothing pinned yet (the worker pins)
    epoch: str
    blocks: tuple[int, ...]
    first_block: int  # blocks before this one vLLM has locally
    namespace: str = ""
    tokens: tuple[int, ...] = ()  # lease 0: the cached prefix, for the worker's Match


def engine_layout(vllm_config: Any) -> KVLayout:
    """The KV layout radixkv's pool must have for this vLLM model (one block = one vLLM page)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if tp > 1 or pp > 1:  # each rank holds a shard of the KV, but the namespace is the engine's
        raise LayoutMismatch(
            f"vLLM runs with tensor_parallel_size {tp}, pipeline_parallel_size {pp}: the radixkv "
            "connector keeps one engine's KV per namespace, not one rank's shard, so its ranks "
            "would load each other's KV; run vLLM with tensor and pipeline parallelism 1")
    dtype = DTYPES.get(str(model.dtype))
    if dtype is None:
        raise LayoutMismatch(f"vLLM's model dtype {model.dtype} has no radixkv pool dtype")
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if cache_dtype not in ("auto", None):
        raise LayoutMismatch(f"vLLM's kv_cache_dtype {cache_dtype!r} is not supported by the "
                             "radixkv connector (use the model dtype: 'auto')")
    return KVLayout(model.get_num_layers(parallel), model.get_num_kv_heads(parallel),
                    model.get_head_size(), dtype, vllm_config.cache_config.block_size)


def serve_flags(vllm_config: Any, layout: KVLayout) -> str:
    """`radixkv serve` flags whose pool fits `layout` (the model folder's config.json)."""
    model = vllm_config.model_config.model
    config = os.path.join(model, "config.json") if os.path.isdir(model) else "CONFIG.json"
    return (f"--model-config {config} --dtype {layout.dtype} "
            f"--block-size {layout.block_size}")


def check_layout(client: Client, want: KVLayout, flags: str) -> None:
    """LayoutMismatch naming both layouts and the fitting `radixkv serve` flags."""
    check_pool_layout(client, (want.num_layers, want.num_kv_heads, want.head_dim, want.dtype,
                               want.block_size), "this vLLM model's KV", "block_size",
                      f"`radixkv serve {flags}`")


def base_namespace(vllm_config: Any, configured: str | None) -> str:
    """The configured namespace, else one naming the exact weights and KV dtype."""
    if configured:
        return configured
    model = vllm_config.model_config
    return default_namespace(model.model, model.revision, DTYPES.get(str(model.dtype)))


def default_namespace(model: str, revision: str | None, dtype: str | None) -> str:
    """The connector's namespace for a model served by that name (`--model`), at `revision`
    (None: main), with KV of `dtype` ("bf16", ...): what `radixkv gateway` routes by too."""
    return f"vllm:{model}@{revision or 'main'}/{dtype}"


def request_namespace(base: str, request: Any) -> str:
    """`base` plus the request's cache salt and LoRA adapter: those never share blocks."""
    ns = base
    salt = getattr(request, "cache_salt", None)
    if salt:
        ns += f"|salt={salt}"
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        ns += f"|lora={lora.lora_name}"
    return ns


ASK_AGAIN_S = 5.0  # the longest a request waits for a member's peer fetch before it computes


class SchedulerSide:
    def __init__(self, link: Link, namespace: str, block_size: int, lease_ttl: float,
                 stats: Stats, use_table: bool = True) -> None:
        self.link = link
        self.namespace = namespace
        self.block_size = block_size
        self.lease_ttl = lease_ttl
        self.stats = stats
        self._pending: dict[str, Pending] = {}
        self._loads: list[Load] = []
        self._saves: list[Save] = []
        self._asking: dict[str, float] = {}  # request id -> when its first Match was asked
        self.peer_fetch = False  # radixkv's member fetches from peers: misses ask with a Match
        self._epoch_seen = ""  # the pool epoch whose PoolInfo said whether it does
        self.use_table = use_table  # False: every lookup is a Match (`lookup: match`)

    def _release(self, lease_id: int) -> None:
        try:
            self.link.call(lambda c: c.release(lease_id))
        except Down:
            pass  # its TTL ends it

    def _match(self, ns: str, tokens: list[int], store: int = 0,
               peer_async: bool = False) -> LeaseMatch:
        """Match (Down: a miss); the layout of a pool epoch new to the link is checked before
        the answer is used (a mismatch: the lease released, the link refuses, Down)."""
        def run(c: Client) -> LeaseMatch:
            m = c.match(ns, tokens, self.lease_ttl, store, peer_async)
            self.link.check_answer(c, m.epoch, lambda: c.release(m.lease_id))
            return m
        return self.link.call(run)

    def matched(self, request: Any, num_computed: int) -> int | None:
        """Tokens beyond `num_computed` that radixkv holds for this request (whole blocks,
        never the last token); pending until `after_alloc`. None ("ask again next step": vLLM
        schedules others meanwhile) while the member fetches the prompt's blocks from a peer,
        for at most ASK_AGAIN_S per request."""
        old = self._pending.pop(request.request_id, None)
        if old is not None and old.lease_id:
            self._release(old.lease_id)
        b = self.block_size
        tokens = request.all_token_ids
        limit = (len(tokens) - 1) // b * b
        if limit <= num_computed:
            return 0
        ns = request_namespace(self.namespace, request)
        query = tokens[:limit]
        t0 = time.perf_counter()
        peek = self._peek(ns, query)
        if peek is not None and (peek.num_tokens == limit or not self.peer_fetch):
            self._asking.pop(request.request_id, None)
            self.stats.record(side="scheduler", op="peek", req=request.request_id,
                              s=time.perf_counter() - t0, tokens=limit, hit=peek.num_tokens)
            if peek.num_tokens <= num_computed:
                return 0
            self._pending[request.request_id] = Pending(
                0, "", (), num_computed // b, ns, tuple(query[:peek.num_tokens]))
            return peek.num_tokens - num_computed
        return self._matched_by_call(request, ns, list(query), num_computed, t0)

    def _peek(self, ns: str, tokens: Sequence[int]) -> Peek | None:
        """The table's answer, or None where there is none to read (ask with a Match). A pool
        epoch new here has its layout checked first, and whether its member fetches from
        peers read (one call each, then none)."""
        if not self.use_table:
            return None

        def run(c: Client) -> Peek | None:
            try:
                peek = c.peek(ns, tokens)
            except Unavailable:  # no table published, or radixkv gone (the Match says which)
                return None
            self.link.check_answer(c, peek.epoch)
            if peek.epoch != self._epoch_seen:
                self.peer_fetch = c.pool_info().peer_fetch
                self._epoch_seen = peek.epoch
            return peek

        try:
            return self.link.call(run)
        except Down:
            return None

    def _matched_by_call(self, request: Any, ns: str, query: list[int], num_computed: int,
                         t0: float) -> int | None:
        """`matched` through a Match, which pins (and may start a member's peer fetch)."""
        b, limit = self.block_size, len(query)
        asked = self._asking.setdefault(request.request_id, t0)
        try:
            m = self._match(ns, query, peer_async=True)
        except Down:
            self._asking.pop(request.request_id, None)
            return 0
        if m.fetching and t0 - asked < ASK_AGAIN_S:
            self._release(m.lease_id)
            return None
        self._asking.pop(request.request_id, None)
        self.stats.record(side="scheduler", op="match", req=request.request_id,
                          s=time.perf_counter() - t0, tokens=limit, hit=m.num_tokens)
        found = min(m.num_tokens, limit)
        if found <= num_computed:
            self._release(m.lease_id)
            return 0
        self._pending[request.request_id] = Pending(m.lease_id, m.epoch, m.block_ids,
                                                    num_computed // b)
        return found - num_computed

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM allocated pages for the request: plan the load of `num_external` tokens."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None:
            return
        n = num_external // self.block_size
        if n <= 0:
            if pending.lease_id:
                self._release(pending.lease_id)
            return
        first = pending.first_block
        pages = tuple(block_ids[first:first + n])
        if not pending.lease_id:  # the worker pins it
            self._loads.append(Load(request.request_id, 0, "", (), pages, pending.namespace,
                                    pending.tokens[:(first + n) * self.block_size], first))
            return
        self._loads.append(Load(request.request_id, pending.lease_id, pending.epoch,
                                tuple(pending.blocks[first:first + n]), pages))

    def take(self) -> tuple[list[Load], list[Save]]:
        """This step's loads and saves (the state resets)."""
        loads, saves = self._loads, self._saves
        self._loads, self._saves = [], []
        return loads, saves

    def finished(self, request: Any, block_ids: Sequence[int]) -> bool:
        """Plan storing the request's computed whole blocks that radixkv lacks; True when a
        save is planned (vLLM then keeps the pages until the worker reports it done)."""
        self._asking.pop(request.request_id, None)
        pending = self._pending.pop(request.request_id, None)
        if pending is not None and pending.lease_id:
            self._release(pending.lease_id)
        if "ERROR" in str(getattr(request, "status", "")):
            return False  # e.g. a failed load: its KV is not to be trusted
        b = self.block_size
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        tokens = request.all_token_ids
        n_full = min(computed, len(tokens), len(block_ids) * b) // b
        if n_full == 0:
            return False
        ns = request_namespace(self.namespace, request)
        store = [int(t) for t in tokens[:n_full * b]]
        t0 = time.perf_counter()
        peek = self._peek(ns, store)
        if peek is not None:  # the worker Matches with allocation, copies and Inserts
            missing = n_full - peek.num_blocks
            self.stats.record(side="scheduler", op="store_peek", req=request.request_id,
                              s=time.perf_counter() - t0, cached_blocks=peek.num_blocks,
                              new_blocks=missing)
            if missing <= 0:
                return False
            self._saves.append(Save(request.request_id, 0, "", ns, tuple(store), (), (),
                                    tuple(block_ids[:n_full])))
            return True
        try:
            m = self._match(ns, store, STORE_ALL)
        except Down:
            return False
        k, new = len(m.block_ids), m.new_block_ids
        self.stats.record(side="scheduler", op="store_match", req=request.request_id,
                          s=time.perf_counter() - t0, cached_blocks=k, new_blocks=len(new))
        if not new:
            self._release(m.lease_id)
            return False
        end = (k + len(new)) * b
        self._saves.append(Save(request.request_id, m.lease_id, m.epoch, ns,
                                tuple(store[:end]), m.block_ids + new, new,
                                tuple(block_ids[k:k + len(new)])))
        return True
