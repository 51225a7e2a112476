"""Native (C) versions of the small per-layer ops, registered above kernels/cpu_ops.py's.

A decode step on the CPU calls rms_norm / add_rms_norm ~60 times and silu_mul 30 times on
[T, 576]-sized tensors; torch's rms_norm costs ~40 us a call there (a reduction's setup), the C
loop a few us through ctypes (kernels/cpu_small_ops.c). Float32 rows only; anything else (other
dtypes, odd strides) takes the torch path of the same op. Tested against the references in
tests/test_cpu_native.py.
"""

from __future__ import annotations

import torch

from hetero.kernels import cpu_ops, native
from hetero.kernels.registry import register


def native_cpu(device: torch.device) -> bool:
    return device.type == "cpu" and native.available()


def _rows(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.is_contiguous()


@register("rms_norm", "native", priority=2, supports=native_cpu)
def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_ref for float32 x [..., C]."""
    if not (_rows(x) and _rows(weight)):
        return cpu_ops.rms_norm_cpu(x, weight, eps)
    out = torch.empty_like(x)
    c = x.shape[-1]
    native.load().native_rms_norm(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // max(c, 1), c, eps
    )
    return out


@register("add_rms_norm", "native", priority=2, supports=native_cpu)
def add_rms_norm_native(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_ref: (rms_norm(x + residual), x + residual) for float32 [..., C]."""
    if not (_rows(x) and _rows(residual) and _rows(weight)) or x.shape != residual.shape:
        total = x + residual
        return cpu_ops.rms_norm_cpu(total, weight, eps), total
    normed, total = torch.empty_like(x), torch.empty_like(x)
    c = x.shape[-1]
    native.load().native_add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), normed.data_ptr(),
        total.data_ptr(), x.numel() // max(c, 1), c, eps,
    )  # fmt: skip
    return normed, total


@register("silu_mul", "native", priority=2, supports=native_cpu)
def silu_mul_native(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu_mul_ref for float32 gate, up [T, F] whose rows share one stride (split views)."""
    ok = gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype == torch.float32
    if not ok or gate.stride() != up.stride() or gate.stride(1) != 1:
        return cpu_ops.silu_mul_cpu(gate, up)
    t, f = gate.shape
    out = torch.empty(t, f)
    native.load().native_silu_mul(
        gate.data_ptr(), up.data_ptr(), out.data_ptr(), t, f, gate.stride(0)
    )
    return out
