"""Small fused ops on CUDA through Triton: RMSNorm (+ residual add), rotary embedding (+ Qwen3's
per-head q/k norm before it), SiLU-mul.

Same signatures as the references in kernels/reference.py, which they are tested against. Each
is one launch where torch takes several (RMSNorm: pow, mean, rsqrt, two muls, casts; with the
residual add one more read and write of [T, C]); at decode sizes the launches, not the bytes,
are the cost, and inside a CUDA graph fewer nodes replay faster too.
"""

from __future__ import annotations

from typing import Any

import torch

from hetero.kernels.moe import OAI_ALPHA, OAI_LIMIT
from hetero.kernels.pdl import pdl_launch
from hetero.kernels.registry import register
from hetero.kernels.triton_qmatmul import triton_supported


def _kernels() -> Any:
    from hetero.kernels import triton_fused_kernels  # imports triton: first use only

    return triton_fused_kernels


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] as [rows, C] with unit stride along C (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(x, residual, weight, eps: float):
    x2 = _rows(x)
    rows, c = x2.shape
    out = torch.empty(rows, c, dtype=x.dtype, device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(out) if residual is not None else out
    if rows:
        _kernels().rms_norm_kernel[(rows,)](
            x2, res2, weight, out, res_out, eps, c,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            BC=_pow2(c), ADD=residual is not None, num_warps=4 if c <= 4096 else 8,
            **pdl_launch(x),
        )  # fmt: skip
    return out.reshape(x.shape), res_out.reshape(x.shape)


@register("rms_norm", "triton", priority=10, supports=triton_supported)
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[0]


@register("add_rms_norm", "triton", priority=10, supports=triton_supported)
def add_rms_norm_triton(x, residual, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, eps)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, style: str) -> tuple[torch.Tensor, ...]:
    """The rotation kernels' tables: cos, sin [T, R] as contiguous float32, after the style is
    checked (normal or neox)."""
    if style not in ("normal", "neox"):
        raise ValueError(f"rope style {style!r} is not one of normal, neox")
    return cos.float().contiguous(), sin.float().contiguous()


@register("rope", "triton", priority=10, supports=triton_supported)
def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str):
    """x [T, H, D] (any row and head strides, unit stride along D) -> a new [T, H, D]."""
    cos, sin = rope_tables(cos, sin, style)
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, h, d = x.shape
    r = cos.shape[-1]
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t:
        _kernels().rope_kernel[(t, h)](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), out.stride(0),
            out.stride(1), r, d, BR=_pow2(r), BD=_pow2(d), NEOX=style == "neox", num_warps=1,
            **pdl_launch(x),
        )  # fmt: skip
    return out


@register("qk_norm_rope", "triton", priority=10, supports=triton_supported)
def qk_norm_rope_triton(q, k, wq, wk, eps: float, cos, sin, style: str):
    """qk_norm_rope_ref's contract in one launch for q and k (four where they go op by op):
    q [T, H, D], k [T, KV, D] with any row and head strides, unit stride along D."""
    cos, sin = rope_tables(cos, sin, style)
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    t, h, d = q.shape
    kv = k.shape[1]
    r = cos.shape[-1]
    qo = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(t, kv, d, dtype=k.dtype, device=k.device)
    if t:
        _kernels().qk_norm_rope_kernel[(t, h + kv)](
            q, k, wq, wk, cos, sin, qo, ko, eps, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), cos.stride(0), h, r, d, BR=_pow2(r), BD=_pow2(d),
            NEOX=style == "neox", num_warps=1, **pdl_launch(q),
        )  # fmt: skip
    return qo, ko


@register("swiglu_oai", "triton", priority=10, supports=triton_supported)
def swiglu_oai_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (kernels/moe.swiglu_oai) in one launch: gate, up [T, F] -> [T, F],
    in float32 and rounded once (the reference rounds each torch op to the dtype)."""
    return _gated(_kernels().swiglu_oai_kernel, gate, up, OAI_ALPHA, OAI_LIMIT)


@register("silu_mul", "triton", priority=10, supports=triton_supported)
def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [T, F] (e.g. the halves of one fused [T, 2F] matmul output) -> [T, F]."""
    return _gated(_kernels().silu_mul_kernel, gate, up)


def _gated(kernel, gate: torch.Tensor, up: torch.Tensor, *consts) -> torch.Tensor:
    """An elementwise (gate, up) [T, F] -> [T, F] kernel over a grid of (T, tiles of F)."""
    g, u = _rows(gate), _rows(up)
    t, f = g.shape
    out = torch.empty(t, f, dtype=gate.dtype, device=gate.device)
    if t:
        bf = min(1024, _pow2(f))
        kernel[(t, -(-f // bf))](
            g,
            u,
            out,
            f,
            g.stride(0),
            u.stride(0),
            out.stride(0),
            *consts,
            BF=bf,
            num_warps=4,
            **pdl_launch(g),
        )
    return out.reshape(gate.shape)
