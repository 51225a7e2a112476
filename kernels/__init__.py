"""Kernels: a registry of ops, each with a torch reference (and faster versions where they pay)."""

from __future__ import annotations

from hetero.kernels import cpu_native as _cpu_native  # noqa: F401  (C versions, built at first use)
from hetero.kernels import cpu_ops as _cpu_ops  # noqa: F401  (CPU versions of the small ops)
from hetero.kernels import moe as _moe  # noqa: F401  (the mixture-of-experts matmul reference)
from hetero.kernels import paged as _paged  # noqa: F401  (registers the paged references)
from hetero.kernels import paged_sinks as _paged_sinks  # noqa: F401  (window and sinks)
from hetero.kernels import reference as _reference  # noqa: F401  (registers the references)
from hetero.kernels import streamk as _streamk  # noqa: F401  (CUDA; no triton import)
from hetero.kernels import triton_fused as _triton_fused  # noqa: F401  (CUDA; no triton import)
from hetero.kernels import triton_moe as _triton_moe  # noqa: F401  (CUDA; no triton import)
from hetero.kernels import triton_moe_route as _triton_moe_route  # noqa: F401  (CUDA)
from hetero.kernels import triton_paged as _triton_paged  # noqa: F401  (CUDA; no triton import)
from hetero.kernels import triton_qmatmul as _triton_qmatmul  # noqa: F401  (CUDA; no triton import)
from hetero.kernels.registry import (
    KernelImpl,
    implementations,
    ops,
    reference,
    register,
    select,
)

__all__ = ["KernelImpl", "implementations", "ops", "reference", "register", "select"]
