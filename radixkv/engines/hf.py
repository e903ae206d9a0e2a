"""A Hugging Face causal LM (Llama-architecture: LlamaForCausalLM, Qwen2, Mistral; sliding-window
layers as in Mistral-7B-v0.1, Gemma-2 and layer_types configs) that reuses prompt KV through
radixkv. One prompt at a time, batch 1, on the pool's device.

    prompt     |<------------- tokens ------------->|
    blocks     [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ][ b5 ][ par|       block_size tokens each
    Match       b0 b1 b2 (cached)                           -> gather into a DynamicCache
    forward                      tokens[use:] at positions use.. -> logits of the last token
    Allocate                      b3' b4' b5' (new full blocks; the partial one is not cached)
    scatter + Insert(b0 b1 b2 b3' b4' b5'), Release

At least one token is always computed (there must be logits): a fully cached prompt reuses all
but its last token. The KV is exactly what the model computed (copies are bit-exact), so reused
logits equal a full recompute up to float rounding (the suffix attention merges two partial
softmaxes, radixkv.engines.attention: within 2e-7 in fp32 on CPU).

A sliding-window pool (`KVLayout.is_windowed`) holds a block's full-attention layers and its
windowed layers as two parts: the engine reads the full parts of the matched blocks and the
window parts of the last `window_blocks` of them, and stores window parts for a sequence's last
blocks only (radixkv.engines.window_cache: which blocks, and the cache it builds and reads).

The lease pins the matched blocks from Match to Insert. A forward that outlives the service's
lease TTL (a long prompt on CPU) loses it: the engine then matches again and stores under the
new lease. A read-only prefill (`store=False`) releases its lease before the forward.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvpool.layout import KVLayout
from radixkv.client.client import STORE_ALL, Client, Lease
from radixkv.engines import window_cache
from radixkv.engines.window_cache import cache_layers as cache_layers  # re-exported
from radixkv.protocol.errors import InvalidArgument, LeaseExpired, OutOfBlocks, RadixKVError

log = logging.getLogger("radixkv.engines.hf")

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def pool_layout_for(model_config: Any, block_size: int, dtype: str | None = None) -> KVLayout:
    """The pool layout a model needs: from its config (a transformers config or a config.json
    dict); `dtype` defaults to the config's torch_dtype."""
    cfg = model_config if isinstance(model_config, dict) else model_config.to_dict()
    return KVLayout.from_hf_config(cfg, dtype=dtype, block_size=block_size)


def _attention_text(layout: KVLayout) -> str:
    if layout.sliding_window is None:
        return "full attention on every layer"
    return (f"a sliding window of {layout.sliding_window} tokens on layers "
            f"{layout.window_pattern!r} ({len(layout.window_layers)} of {layout.num_layers})")


@dataclass(frozen=True, slots=True)
class PrefillResult:
    logits_last: torch.Tensor  # [vocab]: logits after the last prompt token
    cache: Any  # transformers DynamicCache holding the KV of every prompt token
    cached_tokens: int  # prompt tokens whose KV came from radixkv (not computed)
    timings: dict[str, float] = field(default_factory=dict)  # seconds; "total" is the TTFT
    # with return_hidden: the final (normed) hidden states of the computed positions
    # cached_tokens.. as [tokens, hidden]; the LM head of row i gives the logits after token
    # cached_tokens + i
    hidden: torch.Tensor | None = None


class Engine:
    """`model` (a transformers causal LM, eval mode) plus, optionally, a radixkv service.

    `service`: a `Client` or a socket path; None gives an engine that never caches (baseline).
    `namespace` must name the exact weights: KV is only reusable by the same model. At connect
    the service's pool layout must equal the model's (`pool_layout_for`), else InvalidArgument.
    Not thread-safe: one prompt at a time.

    `store_after_first_token`: `prefill` returns once the first token's logits exist and writes
    the new blocks back (scatter, Insert, Release) on a helper thread, as a serving engine
    streams its first token before the cache write-back. The next call on this engine (and
    `wait_stored`, `close`) waits for it, so this engine always sees its own blocks; another
    process may miss blocks still being written (a miss, never wrong data)."""

    def __init__(self, model: Any, service: Client | str | None = None,
                 namespace: str | None = None, *, store_after_first_token: bool = False
                 ) -> None:
        if service is not None and not namespace:
            raise InvalidArgument("an engine with a radixkv service needs a namespace naming its "
                                  "weights (e.g. model id and revision)")
        self.model = model
        self.namespace = namespace or ""
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5/4
        self._owns_client = isinstance(service, str)
        self.kv = Client(service) if isinstance(service, str) else service
        self.layout: KVLayout | None = None
        self._restarts_seen = 0
        self._writer = ThreadPoolExecutor(1, "radixkv-store") if store_after_first_token \
            else None
        self._pending: Future[float] | None = None
        if self.kv is not None:
            self.kv.wait_ready()
            self._check_layout()

    def _check_layout(self) -> None:
        assert self.kv is not None
        have = self.kv.pool_info().layout
        want = pool_layout_for(self.model.config, have.block_size, _DTYPES.get(self.model.dtype))
        if have.is_quantized and have.model_dtype == want.dtype:  # stored quantized: its
            want = replace(want.with_dtype(have.dtype, have.sink_tokens),  # own knobs
                           group_size=have.group_size, key_scales=have.key_scales)
        if (have.sliding_window, have.window_layers) != (want.sliding_window, want.window_layers):
            raise InvalidArgument(
                f"radixkv service at {self.kv.target} holds KV for {_attention_text(have)} but "
                f"this model has {_attention_text(want)}: serve it with --model-config <this "
                f"model's config.json>")
        if have != want:
            raise InvalidArgument(
                f"radixkv service at {self.kv.target} holds KV layout {have} but this model "
                f"needs {want}: serve it with --model-config <this model's config.json> "
                f"--dtype {want.dtype}")
        self.layout = have
        self.kv.pool(refresh=True)  # map the pool now, not on the first request

    def close(self) -> None:
        """Finish a pending write-back; close the client if the engine opened it (from a
        socket path)."""
        try:
            self.wait_stored()
        finally:
            if self._writer is not None:
                self._writer.shutdown()
            if self.kv is not None and self._owns_client:
                self.kv.close()

    def wait_stored(self) -> None:
        """Wait for the write-back of the last prefill (store_after_first_token); re-raises
        what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _pool_view(self, lease: Lease) -> torch.Tensor:
        """The pool mapping of the lease's epoch (StalePool if the service restarted since its
        Match: block ids of one pool must never be written through a mapping of another);
        after a restart the layout is checked again."""
        assert self.kv is not None
        if self.kv.restarts != self._restarts_seen:
            self._restarts_seen = self.kv.restarts
            self._check_layout()
        view: torch.Tensor = lease.view()
        return view

    @staticmethod
    def _sync(view: torch.Tensor) -> None:
        """Complete queued copies to or from the pool (GPU): before Insert publishes blocks,
        and before Release lets the blocks read be evicted and reused."""
        if view.is_cuda:
            torch.cuda.current_stream(view.device).synchronize()

    # ---- model plumbing ----------------------------------------------------------------------

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            return DynamicCache()
        if any(getattr(cache, "is_sliding", ())):  # sliding layers would drop what a store
            return window_cache.new_cache()  # needs: keep every position (window_cache)
        return cache

    def _forward_hidden(self, tokens: Sequence[int], start: int, cache: Any
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `tokens` at positions start.. on top of `cache` (which grows). Returns the last
        logits and the hidden states of every position ([tokens, hidden]); the LM head runs
        on the last position only (over a 49k vocabulary it would cost more than the rest)."""
        device = self.model.device
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
        positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)
        out = self.decoder(input_ids=ids, position_ids=positions, use_cache=True,
                           **{self._cache_kw: cache})
        hidden: torch.Tensor = out.last_hidden_state[0]
        logits: torch.Tensor = self.lm_head(hidden[-1])
        return logits.float(), hidden

    def _forward(self, tokens: Sequence[int], start: int, cache: Any) -> torch.Tensor:
        """Run `tokens` at positions start.. on top of `cache` (which grows); last logits."""
        return self._forward_hidden(tokens, start, cache)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over hidden states (e.g. `PrefillResult.hidden`), as fp32."""
        out: torch.Tensor = self.lm_head(hidden)
        return out.float()

    # ---- the request path --------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int], *, store: bool = True,
                return_hidden: bool = False) -> PrefillResult:
        """Match -> copy cached blocks into a DynamicCache -> run the model on the rest -> write
        the newly completed full blocks to the pool -> Insert -> Release. Without a service, the
        same as `prefill_no_cache`. `store=False` reads the cache without adding to it;
        `return_hidden` keeps the computed positions' hidden states (`PrefillResult.hidden`)."""
        if self.kv is None:
            return self.prefill_no_cache(tokens, return_hidden=return_hidden)
        if not tokens:
            raise InvalidArgument("prefill needs at least one token")
        self.wait_stored()  # this engine sees its own blocks
        t0 = time.perf_counter()
        tokens = list(tokens)
        layout = self.layout
        assert layout is not None
        if layout.is_windowed:  # the last token may need window KV before the last parts
            tokens_to_match = tokens[:window_cache.match_length(layout, len(tokens))]
        else:
            tokens_to_match = tokens
        lease = self.kv.lease(self.namespace, tokens_to_match,
                              store_tokens=STORE_ALL if store else 0)
        try:
            view = self._pool_view(lease)
            t1 = time.perf_counter()
            use = window_cache.resume_point(lease.num_tokens, len(tokens))
            if layout.is_windowed:
                cache = window_cache.read_cache(layout, lease, use, self.model.device)
            else:
                cache = self._new_cache()
                if use:
                    num_blocks = -(-use // layout.block_size)
                    k, v = lease.pool().read(lease.block_ids[:num_blocks])  # [layers, tokens..]
                    k, v = k.to(self.model.device), v.to(self.model.device)  # host pool, GPU
                    for layer in range(k.shape[0]):
                        cache.update(k[layer, :use].transpose(0, 1).unsqueeze(0),
                                     v[layer, :use].transpose(0, 1).unsqueeze(0), layer)
            if not store:
                self._sync(view)  # the gather may still be queued: finish it before Release
                lease.release()  # the KV is copied: no pins held across the forward
            t2 = time.perf_counter()
            logits, hidden = self._forward_hidden(tokens[use:], use, cache)
            t3 = time.perf_counter()
        except BaseException:
            with contextlib.suppress(RadixKVError):  # keep the original error
                lease.release()
            raise
        if self._writer is not None:  # the first token is ready: write back meanwhile
            self._pending = self._writer.submit(self._finish, lease, tokens, cache, view, store,
                                                t3 - t2)
            t4 = t5 = time.perf_counter()
        else:
            t4 = self._finish(lease, tokens, cache, view, store, t3 - t2)
            t5 = time.perf_counter()
        timings = {"match": t1 - t0, "load": t2 - t1, "forward": t3 - t2, "store": t4 - t3,
                   "release": t5 - t4, "total": t5 - t0}
        return PrefillResult(logits, cache, use, timings, hidden if return_hidden else None)

    @torch.inference_mode()
    def _finish(self, lease: Lease, tokens: list[int], cache: Any, view: torch.Tensor,
                store: bool, forward_s: float) -> float:
        """After the forward: store the new full blocks (Insert ends the lease), else release
        it. Returns the time the store ended."""
        try:
            if store:
                try:
                    self._store(lease, tokens, cache, view)
                except LeaseExpired:  # the forward outlived the lease TTL: match again
                    log.warning("lease expired during a %.1f s forward; storing under a new "
                                "one (serve with a --lease-ttl above the longest prefill)",
                                forward_s)
                    assert self.kv is not None
                    with self.kv.lease(self.namespace, tokens) as again:
                        self._store(again, tokens, cache, self._pool_view(again))
            stored = time.perf_counter()
        except BaseException:
            with contextlib.suppress(RadixKVError):  # keep the original error
                lease.release()
            raise
        if not lease.released:  # nothing was stored (an Insert would have ended the lease)
            self._sync(view)  # the gather may still be queued: finish it before Release
            with contextlib.suppress(LeaseExpired):  # expired: the pins are already dropped
                lease.release()
        return stored

    @torch.inference_mode()  # as `prefill`: no autograd graph (a baseline that times alike)
    def prefill_no_cache(self, tokens: Sequence[int], *,
                         return_hidden: bool = False) -> PrefillResult:
        """The baseline: the whole prompt through the model, no radixkv."""
        if not tokens:
            raise InvalidArgument("prefill needs at least one token")
        t0 = time.perf_counter()
        cache = self._new_cache()
        logits, hidden = self._forward_hidden(tokens, 0, cache)
        elapsed = time.perf_counter() - t0
        return PrefillResult(logits, cache, 0, {"forward": elapsed, "total": elapsed},
                             hidden if return_hidden else None)

    def _store(self, lease: Lease, tokens: list[int], cache: Any, view: torch.Tensor) -> int:
        """Write the full blocks of `tokens` past the lease's matched ones from `cache` into
        the blocks the Match allocated (or an Allocate call's) and Insert them, ending the
        lease in the same call. Returns the number of blocks written (0: the lease is still
        open)."""
        assert self.layout is not None
        if self.layout.is_windowed:
            return window_cache.store(self.layout, lease, tokens, cache,
                                      lambda: self._sync(view))
        block_size = self.layout.block_size
        have = len(lease.block_ids)
        num_full = min(len(tokens) // block_size,  # longer than the pool: a prefix
                       lease.pool().num_blocks)
        if num_full <= have:
            return 0
        try:
            new = lease.allocate(num_full - have)
        except OutOfBlocks as e:  # every block pinned by other requests: serve uncached
            log.warning("not caching %d blocks: %s", num_full - have, e)
            return 0
        start, end = have * block_size, num_full * block_size
        layers = cache_layers(cache)
        # DynamicCache layers are [batch 1, kv_heads, seq, head_dim]; the pool wants
        # [layers, tokens, kv_heads, head_dim]
        k = torch.stack([key[0, :, start:end].transpose(0, 1) for key, _ in layers])
        v = torch.stack([value[0, :, start:end].transpose(0, 1) for _, value in layers])
        lease.pool().write(new, k, v)
        self._sync(view)  # the copy may be queued: complete it before Insert publishes blocks
        lease.insert(tokens[:end], lease.block_ids + new, release=True)
        return len(new)

    @torch.inference_mode()
    def store(self, tokens: Sequence[int], cache: Any) -> int:
        """Cache the KV of `tokens` held in `cache` (e.g. prompt + generated tokens after
        decoding, so that the next turn reuses the answer too). Returns blocks written."""
        if self.kv is None:
            return 0
        self.wait_stored()
        seq_len = cache_layers(cache)[0][0].shape[-2]
        tokens = list(tokens)[:seq_len]
        with self.kv.lease(self.namespace, tokens) as lease:
            return self._store(lease, tokens, cache, self._pool_view(lease))

    @torch.inference_mode()
    def decode(self, prompt: Sequence[int], result: PrefillResult, max_new_tokens: int,
               eos_token_id: int | None = None) -> list[int]:
        """Greedy decoding after `prefill`; `result.cache` grows by the generated tokens (all
        but the last, whose KV is never computed)."""
        out = [int(result.logits_last.argmax())]
        position = len(prompt)
        while len(out) < max_new_tokens and out[-1] != eos_token_id:
            logits = self._forward(out[-1:], position, result.cache)
            position += 1
            out.append(int(logits.argmax()))
        return out

    def generate(self, tokens: Sequence[int], max_new_tokens: int, *, use_radixkv: bool = True,
                 cache_output: bool = True) -> list[int]:
        """Greedy generation of `max_new_tokens` tokens. With radixkv (if connected), reuses and
        caches the prompt's KV, and with `cache_output` also the KV of the generated tokens."""
        reuse = use_radixkv and self.kv is not None
        result = self.prefill(tokens) if reuse else self.prefill_no_cache(tokens)
        out = self.decode(tokens, result, max_new_tokens)
        if reuse and cache_output:
            self.store(list(tokens) + out[:-1], result.cache)
        return out
