"""The memory calculator behind `radixkv calc`: what a model's KV costs at each dtype."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gpu_pool.layout import KVLayout, format_bytes

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
           "the model dtype (gpu_pool/quant.py).")


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
class CalcReport:
    layout: KVLayout
    context_tokens: int
    num_requests: int
    memory_bytes: int | None
    rows: tuple[CalcRow, ...]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layout"] = self.layout.to_dict()
        base = self.rows[0]
        # Top-level figures for the layout's own dtype, for scripts.
        out.update(bytes_per_token=base.bytes_per_token, bytes_per_block=base.bytes_per_block,
                   context_bytes=base.context_bytes, requests_bytes=base.requests_bytes)
        return out


def calculate(
    layout: KVLayout,
    context_tokens: int = 4096,
    num_requests: int = 100,
    memory_bytes: int | None = None,
    dtypes: tuple[str, ...] = ("int8", "int4"),
) -> CalcReport:
    """Rows for the layout's dtype, then for each of `dtypes` (skipping repeats)."""
    rows = []
    for dtype in dict.fromkeys((layout.dtype, *dtypes)):
        lay = layout.with_dtype(dtype)
        ctx = lay.context_bytes(context_tokens)
        tokens = lay.tokens_in(memory_bytes) if memory_bytes is not None else None
        reqs = (memory_bytes // ctx if ctx else 0) if memory_bytes is not None else None
        rows.append(CalcRow(dtype, QUANT_SCHEMES[dtype], lay.bytes_per_token,
                            lay.scale_bytes_per_token, lay.bytes_per_block, ctx,
                            ctx * num_requests, tokens, reqs))
    return CalcReport(layout, context_tokens, num_requests, memory_bytes, tuple(rows))


def _two_units(n: float) -> str:
    return format_bytes(n).replace(" (", "\n(")


def render(report: CalcReport) -> Any:
    """A rich Table for people: one column per dtype, one row per figure."""
    from rich.table import Table

    lay = report.layout
    title = (f"KV cache: {lay.num_layers} layers x {lay.num_kv_heads} kv_heads x "
             f"{lay.head_dim} head_dim, block_size {lay.block_size}")
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
    for label, cells in lines:
        table.add_row(label, *cells)
    return table
