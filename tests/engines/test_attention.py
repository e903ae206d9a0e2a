"""radixkv's attention for a suffix on cached KV (radixkv.engines.attention) against PyTorch's
sdpa with the explicit bottom-right causal mask, and inside a model. fp32: atol 1e-5 (measured:
up to 3e-7); bf16 / fp16 keep their dtype and stay within their precision of the fp32 answer."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from radixkv.engines.attention import attention_forward, prefix_attention  # noqa: E402


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              window: int | None = None) -> torch.Tensor:
    q_len, k_len = q.shape[2], k.shape[2]
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)  # query i: keys ..p+i
    if window is not None:  # and not before p + i - window + 1, by position
        mask &= torch.arange(k_len) > torch.arange(q_len)[:, None] + k_len - q_len - window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("q_len, k_len", [(1, 1), (1, 37), (5, 5), (3, 40), (64, 65),
                                          (100, 300), (257, 1000)])
def test_matches_sdpa_with_the_bottom_right_mask(heads: int, kv_heads: int, q_len: int,
                                                  k_len: int) -> None:
    gen = torch.Generator().manual_seed(q_len * 1000 + k_len)
    q = torch.randn(2, heads, q_len, 32, generator=gen)
    k, v = (torch.randn(2, kv_heads, k_len, 32, generator=gen) for _ in range(2))
    got = prefix_attention(q, k, v)
    assert got.shape == (2, heads, q_len, 32)
    torch.testing.assert_close(got, reference(q, k, v), atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [1, 3, 8, 40, 41])
@pytest.mark.parametrize("q_len, k_len", [(1, 1), (1, 37), (5, 5), (3, 40), (40, 40), (20, 64)])
def test_a_sliding_window_hides_the_keys_before_it(window: int, q_len: int, k_len: int) -> None:
    gen = torch.Generator().manual_seed(q_len * 1000 + k_len + window)
    q = torch.randn(1, 4, q_len, 16, generator=gen)
    k, v = (torch.randn(1, 2, k_len, 16, generator=gen) for _ in range(2))
    got = prefix_attention(q, k, v, window=window)
    torch.testing.assert_close(got, reference(q, k, v, window), atol=1e-5, rtol=0)
    unseen = k_len - q_len - window + 1  # keys before the first query's window
    if unseen > 0:  # garbage there is never read (finite: a masked weight is 0, 0 * NaN is not)
        k[:, :, :unseen], v[:, :, :unseen] = 1e4, -1e4
        assert torch.equal(prefix_attention(q, k, v, window=window), got)


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision_keeps_its_dtype(dtype: torch.dtype, atol: float) -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 20, 32, generator=gen)
    k, v = (torch.randn(1, 2, 50, 32, generator=gen) for _ in range(2))
    got = prefix_attention(q.to(dtype), k.to(dtype), v.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), reference(q, k, v), atol=atol, rtol=0)


def test_scale_is_applied_to_both_parts() -> None:
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen) for n in (10, 30, 30))
    mask = torch.ones(10, 30, dtype=torch.bool).tril(20)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.05)
    torch.testing.assert_close(prefix_attention(q, k, v, scale=0.05), want, atol=1e-5, rtol=0)


def test_refuses_what_it_cannot_compute() -> None:
    q, k = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="keys must include"):
        prefix_attention(q, k, k)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="no attention mask"):
        attention_forward(module, q, q, q, torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout"):
        attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="soft-capping"):
        attention_forward(module, q, q, q, None, softcap=50.0)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_a_model_continues_cached_kv_as_it_computes_it_whole(dtype: torch.dtype,
                                                              atol: float) -> None:
    """A Llama with attn_implementation="radixkv": prefix, then the suffix on its KV, gives the
    last logits of one forward over everything (and of transformers' sdpa on the same weights)."""
    from transformers import DynamicCache

    from radixkv.engines import tiny_llama

    ours = tiny_llama.build_model("test", seed=0).to(dtype)
    sdpa = tiny_llama.build_model("test", seed=0, attn_implementation="sdpa").to(dtype)
    ids = torch.randint(0, 512, (1, 45), generator=torch.Generator().manual_seed(5))
    params = inspect.signature(ours.forward).parameters
    kw = "cache" if "cache" in params else "past_key_values"  # transformers 5 / 4
    with torch.inference_mode():
        whole = ours(ids).logits[0, -1].float()
        cache = DynamicCache(config=ours.config)
        ours(ids[:, :32], use_cache=True, **{kw: cache})
        rest = ours(ids[:, 32:], use_cache=True, **{kw: cache}).logits[0, -1].float()
        reference = sdpa(ids).logits[0, -1].float()
    torch.testing.assert_close(rest, whole, atol=atol, rtol=0)
    torch.testing.assert_close(rest, reference, atol=atol, rtol=0)
