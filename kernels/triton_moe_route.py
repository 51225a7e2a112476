"""The router's logits, its top-k and the experts' weighted sum on CUDA through Triton, one
launch each (moe_router_ref, moe_route_ref and moe_combine_ref in kernels/moe.py are the
references: same signatures).

At decode, a MoE layer's small ops are launches, not bytes: torch takes a cast and a float32
GEMV for the logits, softmax, a top-k (two kernels), a sum, a clamp and a division for the
route, and a cast, a product and a reduction for the sum; inside a CUDA graph fewer nodes replay
faster too.
"""

from __future__ import annotations

from typing import Any

import torch

from hetero.kernels.moe import moe_router_ref
from hetero.kernels.pdl import pdl_launch
from hetero.kernels.registry import register
from hetero.kernels.triton_fused import _pow2
from hetero.kernels.triton_qmatmul import triton_supported

GATING = {"softmax": 0, "softmax_topk": 1}


def _kernels() -> Any:
    from hetero.kernels import triton_moe_kernels  # imports triton: first use only

    return triton_moe_kernels


# Up to this many tokens the logits take the GEMV kernel; more (prompts), cuBLAS's float32 GEMM
ROUTER_MAX_T = 16
# Experts a program: up to 8, fewer where that leaves under ROUTER_PROGRAMS programs a token (the
# call is latency-bound: 1 MB of float32 router for Qwen3-30B-A3B's 128 experts took 5.2 us in
# 16 programs of 8): Qwen3-30B-A3B 2 (64 programs), gpt-oss-20b's 32 experts 1
ROUTER_BLOCK_E = 8
ROUTER_PROGRAMS = 64


def router_block_e(e: int) -> int:
    be = ROUTER_BLOCK_E
    while be > 1 and -(-e // be) < ROUTER_PROGRAMS:
        be //= 2
    return be


@register("moe_router", "triton", priority=10, supports=triton_supported)
def moe_router_triton(h: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """moe_router_ref's contract; a program per (token, router_block_e experts) reads h in its
    own dtype (no cast launch) and sums in float32."""
    t, c = h.shape
    if t > ROUTER_MAX_T:
        return moe_router_ref(h, weight, bias)
    h = h if h.stride(-1) == 1 else h.contiguous()
    weight = weight.contiguous()
    e = weight.shape[0]
    out = torch.empty(t, e, dtype=torch.float32, device=h.device)
    if t:
        be = router_block_e(e)
        _kernels().moe_router_kernel[(t, -(-e // be))](
            h, weight, bias if bias is not None else weight, out, e, c, h.stride(0),
            HAS_BIAS=bias is not None, BE=be, BC=min(512, _pow2(c)), num_warps=4,
            **pdl_launch(h),
        )  # fmt: skip
    return out


@register("moe_route", "triton", priority=10, supports=triton_supported)
def moe_route_triton(
    logits: torch.Tensor, k: int, gating: str, norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_route_ref's contract: one program a token picks its k largest logits (ties: the
    lower expert id) and weighs them."""
    if gating not in GATING:
        raise ValueError(f"gating {gating!r} is not one of softmax, softmax_topk")
    logits = logits.float().contiguous()
    t, e = logits.shape
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    if t:
        _kernels().moe_route_kernel[(t,)](
            logits, ids, w, e, BE=_pow2(e), K=k, BK=_pow2(k), GATING=GATING[gating],
            NORM=norm, num_warps=1 if e <= 256 else 4, **pdl_launch(logits),
        )  # fmt: skip
    return ids, w


@register("moe_combine", "triton", priority=10, supports=triton_supported)
def moe_combine_triton(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """moe_combine_ref's contract, a program per (token, tile of columns)."""
    t, k = w.shape
    o = o if o.stride(-1) == 1 else o.contiguous()
    c = o.shape[-1]
    out = torch.empty(t, c, dtype=o.dtype, device=o.device)
    if t:
        bc = min(1024, _pow2(c))
        _kernels().moe_combine_kernel[(t, -(-c // bc))](
            o, w.float().contiguous(), out, c, o.stride(0), out.stride(0), K=k, BC=bc,
            num_warps=4, **pdl_launch(o),
        )  # fmt: skip
    return out
