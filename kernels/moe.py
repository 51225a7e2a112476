"""Mixture-of-experts matmuls, torch reference: each routed (token, expert) pair times its
expert's matrix, with only the experts that tokens chose dequantized.

An expert weight is one 3-D GGUF tensor, numpy order [E, N, K] (GGUF ne = [K, N, E], as
llama.cpp's converter writes `ffn_{gate,up,down}_exps`): expert e's rows are a plain [N, K]
matrix of GGUF blocks, `qweight[e]`.

Routing gives each of T tokens k experts, topk_ids [T, k]. A *slot* is one (token, choice) pair,
s = t * k + j, so a layer's experts see S = T * k slots:

    x      [T, K]       the tokens (gate/up: the k slots of token t all read row t), or
           [S, K]       one row a slot (down: each slot's own activations)
    y      [S, N]       y[s] = x[row(s)] @ W[topk_ids.flat[s]]^T

The GPU kernel (triton_moe.py) sorts the slots by expert into blocks of one expert each (vLLM's
fused_moe layout), so each block reads its expert's tiles once; this reference gathers each
expert's slots and multiplies them (the per-expert loop of transformers' MoE blocks).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from hetero.kernels.registry import register

_ROUTING = threading.local()


@contextmanager
def routing_scope() -> Iterator[None]:
    """One MoE layer's calls: an implementation may keep what it derives from a topk_ids tensor
    (the GPU kernel's sort of the slots by expert) for the layer's other calls on that tensor.
    Nothing outlives the block."""
    outer = getattr(_ROUTING, "memo", None)
    _ROUTING.memo = {}
    try:
        yield
    finally:
        _ROUTING.memo = outer


def routing_memo() -> dict | None:
    """The innermost routing_scope's store (None outside one)."""
    return getattr(_ROUTING, "memo", None)


GATINGS = ("softmax", "softmax_topk")
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU (llama.cpp: LLM_FFN_SWIGLU_OAI_MOE)


def activation_fn(name: str, device: torch.device | str):
    """The registry's implementation of an expert activation on `device`: "silu" (silu_mul) or
    "swiglu_oai"; (gate, up) [S, F] -> [S, F]."""
    from hetero.kernels.registry import select

    return select("silu_mul" if name == "silu" else "swiglu_oai", device).fn


@register("swiglu_oai", "torch")
def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's activation: g sigmoid(1.702 g) (clamp(up, -7, 7) + 1), g = min(gate, 7)."""
    g = gate.clamp(max=OAI_LIMIT)
    return g * torch.sigmoid(OAI_ALPHA * g) * (up.clamp(-OAI_LIMIT, OAI_LIMIT) + 1)


def expert_matrix(
    qweight: torch.Tensor, e: int, ggml_type: int, shape: tuple[int, int, int], dtype
) -> torch.Tensor:
    """Expert e's W [N, K] in `dtype`: qweight[e] as it is when the experts are already dense
    (a float tensor [E, N, K]), else its GGUF blocks dequantized."""
    if qweight.is_floating_point():
        return qweight[e].to(dtype)
    from hetero.quant import dequantize

    return dequantize(qweight[e], ggml_type, shape[1:]).to(dtype)


def slot_rows(x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The row of x each slot reads [S]: its token's row (x [T, K]) or its own (x [S, K])."""
    t, k = topk_ids.shape
    slots = torch.arange(t * k, device=x.device)
    return slots if slot_row_div(x, topk_ids) == 1 else slots // k


def slot_row_div(x: torch.Tensor, topk_ids: torch.Tensor) -> int:
    """Slot s reads row s // this of x: 1 where x has a row a slot, k where a row a token; a
    clear error for any other row count."""
    t, k = topk_ids.shape
    if x.shape[0] == t * k:
        return 1
    if x.shape[0] != t:
        raise ValueError(f"x has {x.shape[0]} rows: neither T = {t} tokens nor S = {t * k} slots")
    return k


@register("moe_matmul", "torch")
def moe_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    ggml_type: int,
    shape: tuple[int, int, int],
    topk_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [S, N]: every slot's row of x times its expert's W^T (the module docstring), plus its
    expert's row of bias [E, N] where given (gpt-oss).

    x [T, K] or [S, K]; qweight: the GGUF bytes [E, N, row_bytes] (or dense floats [E, N, K]);
    shape (E, N, K); topk_ids [T, k] int. Experts no slot chose are never read.
    """
    n_experts, n, k = shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the experts take {k}")
    flat = topk_ids.reshape(-1)
    rows = slot_rows(x, topk_ids)
    y = x.new_empty(flat.shape[0], n)
    for e in flat.unique().tolist():  # a host sync: the reference, not the fast path
        if not 0 <= e < n_experts:
            raise ValueError(f"expert id {e} is outside 0..{n_experts - 1}")
        sel = (flat == e).nonzero().squeeze(1)
        w = expert_matrix(qweight, e, ggml_type, shape, x.dtype)
        y[sel] = x[rows[sel]] @ w.t()
    return y if bias is None else y + bias[flat].to(y.dtype)


# llama.cpp clamps the sum of a token's chosen weights away from 0 (f16's smallest normal)
NORM_FLOOR = 6.103515625e-5


@register("moe_router", "torch")
def moe_router_ref(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The router's logits [T, E] float32 of h [T, C] (any float dtype, taken exactly to
    float32) and its float32 weight [E, C] (+ bias [E])."""
    return F.linear(h.float(), weight, bias)


@register("moe_route", "torch")
def moe_route_ref(
    logits: torch.Tensor, k: int, gating: str, norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice from its logits [T, E] (float32): (ids [T, k] int64, w [T, k] float32).

    "softmax": the k largest of softmax(logits), their weights renormalized to sum to 1 where
    `norm` (Qwen3 MoE); "softmax_topk": the k largest logits, softmax over those k (gpt-oss)."""
    if gating == "softmax":
        w, ids = logits.softmax(-1).topk(k, dim=-1)
        if norm:
            w = w / w.sum(-1, keepdim=True).clamp_min(NORM_FLOOR)
        return ids, w
    if gating == "softmax_topk":
        top, ids = logits.topk(k, dim=-1)
        return ids, top.softmax(-1)
    raise ValueError(f"gating {gating!r} is not one of softmax, softmax_topk")


@register("moe_combine", "torch")
def moe_combine_ref(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A token's expert outputs summed by their weights: o [T * k, C] (slot t * k + j), w [T, k]
    float32 -> [T, C] in o's dtype, accumulated in float32 and rounded once."""
    t, k = w.shape
    return (o.float().view(t, k, -1) * w[..., None]).sum(1).to(o.dtype)
