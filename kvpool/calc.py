"""The memory calculator behind `radixkv calc`: what a model's KV costs at each dtype, and for a
sliding-window model what a cached conversation costs when its windowed layers keep only their
window (kvpool/layout.py `conversation_bytes`) against every layer kept in full."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvpool.layout import KVLayout
from kvpool.units import format_bytes

QUANT_SCHEMES = {
    "fp32": "-",
    "fp16": "-",
    "bf16": "-",
    "fp8": "per-tensor",
    "int8": "per token+head",
    "int4": "K/channel, V/token",
}
CAPTION = ("scales are fp16 and live in each block. int8: symmetric, one scale per token per "
           "kv_head. int4: asymmetric (scale + minimum), keys per channel over a block's tokens, "
           "values per token per kv_head. A context's first 4 tokens (attention sinks) stay in "
           "the model dtype (kvpool/quant.py).")


@dataclass(frozen=True, slots=True)
class CalcRow:
    dtype: str
    scheme: str
    bytes_per_token: int
    scale_bytes_per_token: int
    bytes_per_block: int
    context_bytes: int
    requests_bytes: int
    tokens_in_memory: int | None
    requests_in_memory: int | None


@dataclass(frozen=True, slots=True)
class WindowRow:
    """One dtype's sliding-window figures; a conversation is `context_tokens` tokens cached."""

    dtype: str
    full_bytes_per_token: int  # the full-attention layers
    window_bytes_per_token: int  # the windowed layers
    conversation_bytes_windowed: int  # windowed layers keep their last window_blocks blocks
    conversation_bytes_all_full: int  # every layer kept for every block
    ratio: float  # all_full / windowed: how many more conversations the same memory holds
    conversations_in_memory_windowed: int | None
    conversations_in_memory_all_full: int | None


@dataclass(frozen=True, slots=True)
class CalcReport:
    layout: KVLayout
    context_tokens: int
    num_requests: int
    memory_bytes: int | None
    rows: tuple[CalcRow, ...]
    window_rows: tuple[WindowRow, ...] = ()  # one per row, for a windowed layout only

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layout"] = self.layout.to_dict()
        base = self.rows[0]
        # Top-level figures for the layout's own dtype, for scripts.
        out.update(bytes_per_token=base.bytes_per_token, bytes_per_block=base.bytes_per_block,
                   context_bytes=base.context_bytes, requests_bytes=base.requests_bytes)
        if not self.window_rows:
            del out["window_rows"]  # full attention: the output as before windows existed
            return out
        w = self.window_rows[0]
        out.update(sliding_window=self.layout.sliding_window,
                   window_pattern=self.layout.window_pattern,
                   num_window_layers=len(self.layout.window_layers),
                   num_full_layers=len(self.layout.full_layers),
                   window_blocks=self.layout.window_blocks,
                   full_bytes_per_token=w.full_bytes_per_token,
                   window_bytes_per_token=w.window_bytes_per_token,
                   conversation_bytes_windowed=w.conversation_bytes_windowed,
                   conversation_bytes_all_full=w.conversation_bytes_all_full,
                   window_ratio=w.ratio)
        return out


def window_row(lay: KVLayout, context_tokens: int, memory_bytes: int | None) -> WindowRow:
    windowed = lay.conversation_bytes(context_tokens)
    full = lay.conversation_bytes(context_tokens, windowed=False)

    def fit(each: int) -> int | None:
        if memory_bytes is None:
            return None
        return memory_bytes // each if each else 0

    return WindowRow(lay.dtype, lay.full_bytes_per_token, lay.window_bytes_per_token, windowed,
                     full, round(full / windowed, 4) if windowed else 1.0, fit(windowed),
                     fit(full))


def calculate(
    layout: KVLayout,
    context_tokens: int = 4096,
    num_requests: int = 100,
    memory_bytes: int | None = None,
    dtypes: tuple[str, ...] = ("int8", "int4"),
) -> CalcReport:
    """Rows for the layout's dtype, then for each of `dtypes` (skipping repeats)."""
    rows, window_rows = [], []
    for dtype in dict.fromkeys((layout.dtype, *dtypes)):
        lay = layout.with_dtype(dtype)
        ctx = lay.context_bytes(context_tokens)
        tokens = lay.tokens_in(memory_bytes) if memory_bytes is not None else None
        reqs = (memory_bytes // ctx if ctx else 0) if memory_bytes is not None else None
        rows.append(CalcRow(dtype, QUANT_SCHEMES[dtype], lay.bytes_per_token,
                            lay.scale_bytes_per_token, lay.bytes_per_block, ctx,
                            ctx * num_requests, tokens, reqs))
        if lay.is_windowed:
            window_rows.append(window_row(lay, context_tokens, memory_bytes))
    return CalcReport(layout, context_tokens, num_requests, memory_bytes, tuple(rows),
                      tuple(window_rows))


def _two_units(n: float) -> str:
    return format_bytes(n).replace(" (", "\n(")


def render(report: CalcReport) -> Any:
    """A rich Table for people: one column per dtype, one row per figure."""
    from rich.table import Table

    lay = report.layout
    title = (f"KV cache: {lay.num_layers} layers x {lay.num_kv_heads} kv_heads x "
             f"{lay.head_dim} head_dim, block_size {lay.block_size}")
    if lay.is_windowed:
        title += (f"; sliding window {lay.sliding_window:,} on {len(lay.window_layers)} of "
                  f"{lay.num_layers} layers ({lay.window_pattern})")
    if report.memory_bytes is not None:
        title += f"; budget {format_bytes(report.memory_bytes)}"
    table = Table(title=title, caption=CAPTION)
    table.add_column("", no_wrap=True)
    for row in report.rows:
        table.add_column(row.dtype, justify="right", no_wrap=True)
    lines: list[tuple[str, list[str]]] = [
        ("bytes / token", [f"{r.bytes_per_token:,}" for r in report.rows]),
        ("  of which scales", [f"{r.scale_bytes_per_token:,}" for r in report.rows]),
        (f"block ({lay.block_size} tokens)",
         [_two_units(r.bytes_per_block) for r in report.rows]),
        (f"{report.context_tokens:,}-token context",
         [_two_units(r.context_bytes) for r in report.rows]),
        (f"{report.num_requests:,} of them",
         [_two_units(r.requests_bytes) for r in report.rows]),
    ]
    if report.memory_bytes is not None:
        lines.append(("tokens in budget", [f"{r.tokens_in_memory:,}" for r in report.rows]))
        lines.append(("contexts in budget", [f"{r.requests_in_memory:,}" for r in report.rows]))
    lines += _window_lines(report)
    for label, cells in lines:
        table.add_row(label, *cells)
    return table


def _window_lines(report: CalcReport) -> list[tuple[str, list[str]]]:
    """The sliding-window rows: per-token cost of each kind of layer, one conversation both ways,
    and (with a budget) how many conversations fit."""
    if not report.window_rows:
        return []
    lay, rows = report.layout, report.window_rows
    n_full, n_window = len(lay.full_layers), len(lay.window_layers)
    conversation = f"{report.context_tokens:,}-token conversation"
    blocks = lay.conversation_blocks(report.context_tokens)
    kept = min(blocks, lay.window_blocks)
    lines: list[tuple[str, list[str]]] = [
        (f"bytes / token, {n_full} full layers", [f"{r.full_bytes_per_token:,}" for r in rows]),
        (f"bytes / token, {n_window} windowed layers",
         [f"{r.window_bytes_per_token:,}" for r in rows]),
        (f"{conversation}, windowed", [_two_units(r.conversation_bytes_windowed) for r in rows]),
        ("  windowed layers keep (blocks)", [f"last {kept:,} of {blocks:,}" for _ in rows]),
        (f"{conversation}, all layers full",
         [_two_units(r.conversation_bytes_all_full) for r in rows]),
        ("all full / windowed", [f"{r.ratio:.2f}x" for r in rows]),
    ]
    if report.memory_bytes is not None:
        lines.append(("conversations in budget, windowed",
                      [f"{r.conversations_in_memory_windowed:,}" for r in rows]))
        lines.append(("conversations in budget, all full",
                      [f"{r.conversations_in_memory_all_full:,}" for r in rows]))
    return lines
