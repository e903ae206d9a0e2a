"""layout.HostPages: SGLang's HiCache host pool layouts (page_first, page_first_direct) <->
radixkv's canonical [layers, 2, block, heads, dim] blocks, element by element (no SGLang
needed: the host buffers are built with SGLang's documented shapes;
tests/integrations/sglang/test_sglang.py runs the same copies against SGLang's own host pool)."""

from __future__ import annotations

import pytest
import torch

from radixkv.integrations.layout import HostPages, LayoutError

L, H, D, P, PAGES = 3, 2, 4, 4, 6


def host_buffer(layout: str) -> torch.Tensor:
    shape = (2, PAGES * P, L, H, D) if layout == "page_first" else (2, PAGES, L, P, H, D)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def canonical(kv: torch.Tensor, layout: str, slot: int) -> torch.Tensor:
    """Element (layer, k|v, token, head, dim) of the page at `slot`, read one by one."""
    out = torch.empty(L, 2, P, H, D)
    for layer in range(L):
        for kvi in range(2):
            for t in range(P):
                if layout == "page_first":
                    out[layer, kvi, t] = kv[kvi, slot + t, layer]
                else:
                    out[layer, kvi, t] = kv[kvi, slot // P, layer, t]
    return out


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_pages_round_trip_in_canonical_order(layout: str) -> None:
    kv = host_buffer(layout)
    pages = HostPages(layout, P)
    slots = torch.tensor([4 * P, 1 * P, 3 * P])
    pool = torch.zeros(8, L, 2, P, H, D)
    pages.copy(kv, slots, pool, [7, 0, 2], to_pool=True)
    for slot, block in zip(slots.tolist(), [7, 0, 2], strict=True):
        assert torch.equal(pool[block], canonical(kv, layout, slot))
    assert not pool[[1, 3, 4, 5, 6]].any()
    back = torch.zeros_like(kv)
    pages.copy(back, torch.tensor([0, 5 * P]), pool, [2, 7], to_pool=False)
    assert torch.equal(canonical(back, layout, 0), pool[2])
    assert torch.equal(canonical(back, layout, 5 * P), pool[7])
    assert not canonical(back, layout, 2 * P).any()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_runs_of_consecutive_pages_copy_as_one(layout: str) -> None:
    """Pages consecutive on both sides are one copy; runs break where either side jumps, and
    every page still lands in its own block (element by element)."""
    kv = host_buffer(layout)
    pages = HostPages(layout, P)
    page_slots = [1, 2, 3, 5, 0, 4]
    blocks = [2, 3, 4, 5, 0, 7]  # slots 1-3 -> blocks 2-4 one run; 5 -> 5 breaks on the slot
    assert pages.runs([s * P for s in page_slots], blocks) == [
        (1 * P, 2, 3), (5 * P, 5, 1), (0, 0, 1), (4 * P, 7, 1)]
    pool = torch.zeros(8, L, 2, P, H, D)
    pages.copy(kv, torch.tensor(page_slots) * P, pool, blocks, to_pool=True)
    for slot, block in zip(page_slots, blocks, strict=True):
        assert torch.equal(pool[block], canonical(kv, layout, slot * P))
    assert not pool[[1, 6]].any()
    back = torch.zeros_like(kv)
    pages.copy(back, torch.tensor(page_slots) * P, pool, blocks, to_pool=False)
    assert torch.equal(back, kv)
    with pytest.raises(ValueError, match="2 host pages for 1 pool blocks"):
        pages.copy(kv, torch.tensor([0, P]), pool, [0], to_pool=True)


def test_other_layouts_are_refused_by_name() -> None:
    with pytest.raises(LayoutError, match="'layer_first' is not supported"):
        HostPages("layer_first", P)
