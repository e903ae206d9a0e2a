"""Attention for a prompt whose prefix KV came from radixkv: `attn_implementation="radixkv"`.

A suffix of q new tokens on top of p cached ones attends bottom-right causally: query i sees keys
0 .. p + i. PyTorch's CPU sdpa has no such kernel, so transformers' "sdpa" builds a [q, p + q]
mask and pays for all q x (p + q) scores. Here the two parts run apart and merge exactly through
their log-sum-exps (as cascade attention does on GPUs):

    keys     |<--- cached prefix (p) --->|<--- suffix (q) --->|
    part 1   every query, no mask               (q x p, dense)
    part 2                                 square causal      (q x q / 2)
    out      (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2)

At 1,000 cached + 1,000 new tokens this is ~0.8x the masked kernel's time (bench/ttft.py). A
full prefill (q = p + q) and decoding (q = 1) go straight to sdpa. Batch 1 without padding, as
the engine runs: no attention mask is built or read (transformers skips mask creation for an
implementation it does not know). Other devices use sdpa with a bottom-right mask.

Sliding-window layers (the model passes `sliding_window` W: a query sees itself and the W - 1 keys
before it) use sdpa with the bottom-right band mask whenever the window hides a key, in a full
prefill and in decoding too: with no mask built by transformers, the band is ours to apply.

    from radixkv.engines import attention
    attention.register()  # once per process, before the model is built
    model = LlamaForCausalLM.from_pretrained(..., attn_implementation="radixkv")
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "radixkv"


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of `query` [b, heads, q, d] over `key`/`value` [b, kv_heads, k, d] whose
    last q positions are the queries' own (k >= q; the first k - q are a cached prefix), keys
    at consecutive positions. `window`: sliding-window attention, query i sees keys
    k - q + i - window + 1 .. k - q + i only. Returns [b, heads, q, d]."""
    q_len, k_len = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if k_len < q_len:
        raise ValueError(f"{q_len} queries over {k_len} keys: the keys must include the queries'")
    prefix = k_len - q_len
    out: torch.Tensor
    if window is not None and k_len > window:  # the last query's window starts after key 0
        band = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device)
        band = band.tril(prefix).triu(prefix - window + 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=band, scale=scale,
                                             enable_gqa=gqa)
    elif q_len == 1 or prefix == 0:  # decode step / full prefill
        out = F.scaled_dot_product_attention(query, key, value, is_causal=q_len > 1,
                                             scale=scale, enable_gqa=gqa)
    elif query.device.type != "cpu":
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(prefix)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                             enable_gqa=gqa)
    else:  # the CPU flash kernel takes GQA key/value heads as they are (no repeated copy)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out1, lse1 = flash(query, key[:, :, :prefix], value[:, :, :prefix], scale=scale)
        out2, lse2 = flash(query, key[:, :, prefix:], value[:, :, prefix:], is_causal=True,
                           scale=scale)
        # out = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2) = o2 + (o1 - o2) sigmoid(lse1 - lse2):
        # one fused lerp over the output instead of five passes. lse is fp32 whatever the
        # inputs: the merge runs in fp32.
        w1 = torch.sigmoid(lse1 - lse2).unsqueeze_(-1)
        if query.dtype == torch.float32:
            out = torch.lerp(out2, out1, w1)
        else:
            out = torch.lerp(out2.float(), out1.float(), w1).to(query.dtype)
    return out


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ([b, q, heads, d], no weights).
    `sliding_window`: the layer's window (None: full attention)."""
    if attention_mask is not None:
        raise ValueError("attn_implementation='radixkv' runs batch 1 without padding: "
                         "no attention mask")
    if dropout:
        raise ValueError("attn_implementation='radixkv' is for inference: dropout must be 0")
    if softcap:
        raise ValueError(f"attn_implementation='radixkv' has no logit soft-capping (the model "
                         f"asks {softcap}): use 'eager'")
    out = prefix_attention(query, key, value, scaling, sliding_window)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `attn_implementation="radixkv"` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention_forward)
