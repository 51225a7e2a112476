"""A plan drawn as SVG: one row per device, its layers as a bar over the model, its memory.

The same picture serves `hetero plan -o plan.svg` (a Plan's StagePlans, before anything loads)
and the daemon's status page (the StageLayouts of the model as it runs): both have the fields
read here under the same names. The SVG is self-contained (no script, no external font or
style), so a browser, an image viewer or a document shows it as it is.

    cuda:0   quant        |#################...........|   [weights####|KV###      ]
             kernels       layers 0-19 (20)                  4.10 GB weights, 2.00 GB KV
    cpu      qdot         |.................###########|   [weights##|KV#          ]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol
from xml.sax.saxutils import escape, quoteattr

GB = 1e9
WIDTH = 960
ROW = 76  # pixels per device row
TOP = 56  # the title's band
LEFT, BAR_X, BAR_W = 12, 230, 400  # device column, layer bar
MEM_X, MEM_W = 650, 296  # memory bar
# one hue per device row (cycled), weights and KV in the memory bar
COLORS = ("#3b82f6", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#14b8a6")
WEIGHTS_COLOR, KV_COLOR, TRACK = "#64748b", "#a855f7", "#e5e7eb"


class StageLike(Protocol):
    device: str
    layer_start: int
    layer_end: int
    weights: str
    kernels: dict[str, str]
    kv_dtype: str
    num_kv_blocks: int
    kv_bytes: int
    weight_bytes: int


def plan_svg(
    stages: Sequence[StageLike], n_layers: int, title: str, notes: Sequence[str] = ()
) -> str:
    """The drawing of `stages` (in layer order) over a model of `n_layers` layers."""
    n_layers = max(n_layers, max((s.layer_end for s in stages), default=1))
    # a bar is the device's memory budget where the plan knows it, else the most any stage holds
    common = max((s.weight_bytes + s.kv_bytes for s in stages), default=1) or 1
    height = TOP + ROW * len(stages) + 18 * len(notes) + 34
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="hetero-plan" width="{WIDTH}" '
        f'height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" '
        f'font-size="12" role="img" aria-label={quoteattr(title)}>',
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        _text(LEFT, 22, title, size=15, weight="bold", cls="title"),
        _text(BAR_X, 44, f"layers 0-{n_layers - 1}", fill="#475569"),
        _text(MEM_X, 44, "memory: weights and KV", fill="#475569"),
    ]
    for i, s in enumerate(stages):
        parts.append(
            _stage(i, s, n_layers, getattr(s, "memory_budget", 0) or common, TOP + ROW * i)
        )
    y = TOP + ROW * len(stages) + 8
    for note in notes:
        y += 18
        parts.append(_text(LEFT, y, note, fill="#334155", cls="note"))
    y += 22
    parts.append(_legend(y))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def svg_of_plan(plan) -> str:
    """A Plan (planner/plan.py) drawn, its predictions as notes."""
    notes = [
        f"predicted: {plan.single_stream_tok_s:.1f} tok/s single stream, "
        f"{plan.aggregate_tok_s:.1f} tok/s at concurrency {plan.concurrency}; TTFT "
        f"{plan.ttft_s * 1e3:.0f} ms for {plan.prompt_len} prompt tokens",
        f"KV: {plan.num_kv_blocks * plan.block_size} tokens; "
        + ("one process" if plan.in_process or len(plan.stages) == 1 else "pipeline stages"),
    ]
    if plan.unused_devices:
        notes.append(f"unused: {', '.join(plan.unused_devices)}")
    return plan_svg(plan.stages, plan.n_layers, f"plan for {plan.model}", notes)


def _stage(i: int, s: StageLike, n_layers: int, scale: float, y: int) -> str:
    """One device's row: its words on the left, its layers over the model's, its memory."""
    x0 = BAR_X + BAR_W * s.layer_start / n_layers
    w = BAR_W * (s.layer_end - s.layer_start) / n_layers
    kernel = s.kernels.get("qlinear", "?")
    attn = s.kernels.get("paged_attention", "?")
    layers = f"{s.layer_start}-{s.layer_end - 1}"
    mode = f"weights {s.weights}, KV {s.kv_dtype} ({s.num_kv_blocks} blocks)"
    return "\n".join(
        [
            f'<g class="stage" data-device={quoteattr(s.device)} data-layers="{layers}" '
            f"data-weights={quoteattr(s.weights)}>",
            _text(LEFT, y + 16, s.device, size=14, weight="bold", cls="device"),
            _text(LEFT, y + 34, mode, cls="mode"),
            _text(LEFT, y + 50, f"linear: {kernel}; attention: {attn}", cls="kernels", size=11),
            _rect("track", BAR_X, y + 4, BAR_W, TRACK, rounded=True),
            _rect("layers", x0, y + 4, w, COLORS[i % len(COLORS)], rounded=True),
            _text(BAR_X, y + 44, f"layers {layers} ({s.layer_end - s.layer_start})", cls="span"),
            _memory(s, scale, y),
            "</g>",
        ]
    )


def _memory(s: StageLike, scale: float, y: int) -> str:
    """The memory bar: weights, then KV, as shares of `scale` bytes."""
    wx = MEM_W * s.weight_bytes / scale
    kx = MEM_W * s.kv_bytes / scale
    words = f"{s.weight_bytes / GB:.2f} GB weights, {s.kv_bytes / GB:.2f} GB KV"
    if getattr(s, "memory_budget", 0):
        words += f" of {scale / GB:.1f} GB"
    return "\n".join(
        [
            _rect("track", MEM_X, y + 4, MEM_W, TRACK, rounded=True),
            _rect("weights", MEM_X, y + 4, wx, WEIGHTS_COLOR),
            _rect("kv", MEM_X + wx, y + 4, kx, KV_COLOR),
            _text(MEM_X, y + 44, words, cls="memory"),
        ]
    )


def _rect(cls: str, x: float, y: float, width: float, fill: str, rounded: bool = False) -> str:
    corner = ' rx="3"' if rounded else ""
    return (
        f'<rect class="{cls}" x="{x:.2f}" y="{y:.2f}" width="{width:.2f}" height="22" '
        f'fill="{fill}"{corner}/>'
    )


def _legend(y: int) -> str:
    return "\n".join(
        [
            f'<rect x="{MEM_X}" y="{y - 10}" width="12" height="12" fill="{WEIGHTS_COLOR}"/>',
            _text(MEM_X + 16, y, "weights"),
            f'<rect x="{MEM_X + 80}" y="{y - 10}" width="12" height="12" fill="{KV_COLOR}"/>',
            _text(MEM_X + 96, y, "KV cache"),
        ]
    )


def _text(
    x: float,
    y: float,
    text: str,
    size: int | None = None,
    weight: str | None = None,
    fill: str = "#0f172a",
    cls: str | None = None,
) -> str:
    attrs = f'x="{x:.2f}" y="{y:.2f}" fill="{fill}"'
    if size:
        attrs += f' font-size="{size}"'
    if weight:
        attrs += f' font-weight="{weight}"'
    if cls:
        attrs += f' class="{cls}"'
    return f"<text {attrs}>{escape(text)}</text>"
