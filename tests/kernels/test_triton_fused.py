"""Small fused Triton kernels (hetero.kernels.triton_fused) against their torch references.

A registry walk: every implementation of rms_norm, add_rms_norm, rope, qk_norm_rope, silu_mul and
swiglu_oai other than the reference (run under the interpreter where there is no CUDA) on fresh
random inputs: odd widths (masked tails), strided inputs (views of fused matmul outputs), both rope
layouts with partial rotation, float32 and float16.
"""

from __future__ import annotations

import pytest
import torch

from hetero.kernels import implementations, reference
from tests.support.triton_interp import CUDA, DEVICE, kernels_runnable, rerun_test  # noqa: F401 (autouse)

triton = pytest.importorskip("triton")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])

test_in_a_fresh_interpreter_process = rerun_test(__file__)


def fast(op: str):
    """Implementations of `op` to check here: all but the reference (the Triton ones run under
    the interpreter on a CPU)."""
    impls = [i for i in implementations(op) if not i.is_reference]
    assert impls, f"no fast implementation of {op} registered"
    return impls


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within two roundings of the dtype (float32: accumulation order)."""
    eps = {torch.float32: 1e-5, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}[want.dtype]
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs() - eps * (1 + want.float().abs())
    assert (err <= 0).all(), f"max excess error {err.max().item()}"


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 96), (3, 2, 577)])
def test_rms_norm_and_residual_add(dtype, shape) -> None:
    x, res = randn(*shape, dtype=dtype, seed=1), randn(*shape, dtype=dtype, seed=2)
    w = randn(shape[-1], seed=3)
    for impl in fast("rms_norm"):
        close(impl.fn(x, w, 1e-5), reference("rms_norm").fn(x, w, 1e-5))
    want_norm, want_sum = reference("add_rms_norm").fn(x, res, w, 1e-6)
    for impl in fast("add_rms_norm"):
        got_norm, got_sum = impl.fn(x, res, w, 1e-6)
        assert torch.equal(got_sum, want_sum)
        close(got_norm, want_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["normal", "neox"])
def test_rope(dtype, style: str) -> None:
    """Full rotation of D = 64 and partial (R = 12 of D = 40: dims 24..39 pass through), on a
    strided view (q out of a fused qkv output)."""
    for d, r in ((64, 32), (40, 12)):
        qkv = randn(7, 3 * 2 * d, dtype=dtype, seed=d)
        x = qkv[:, : 2 * d].reshape(7, 2, d)  # [T, H, D], row stride 6 * d
        pos = torch.arange(7, device=DEVICE).float()[:, None] * 13
        freqs = pos * (10000.0 ** (-torch.arange(r, device=DEVICE) / r))
        cos, sin = freqs.cos(), freqs.sin()
        want = reference("rope").fn(x, cos, sin, style)
        for impl in fast("rope"):
            close(impl.fn(x, cos, sin, style), want)
    with pytest.raises(ValueError, match="rope style"):
        fast("rope")[0].fn(x, cos, sin, "gptj")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["normal", "neox"])
def test_qk_norm_rope(dtype, style: str) -> None:
    """Qwen3's q/k norm and the rotation in one launch, on q and k viewed out of one fused qkv
    output (H = 4, KV = 2), full (D = 64) and partial rotation (R = 12 of D = 40)."""
    for d, r in ((64, 32), (40, 12)):
        qkv = randn(5, 8 * d, dtype=dtype, seed=d)
        q, k = qkv[:, : 4 * d].view(5, 4, d), qkv[:, 4 * d : 6 * d].view(5, 2, d)
        wq, wk = (randn(d, seed=s).abs().float() + 0.5 for s in (1, 2))
        pos = torch.arange(5, device=DEVICE).float()[:, None] * 7
        freqs = pos * (10000.0 ** (-torch.arange(r, device=DEVICE) / r))
        cos, sin = freqs.cos(), freqs.sin()
        want = reference("qk_norm_rope").fn(q, k, wq, wk, 1e-6, cos, sin, style)
        for impl in fast("qk_norm_rope"):
            got = impl.fn(q, k, wq, wk, 1e-6, cos, sin, style)
            close(got[0], want[0])
            close(got[1], want[1])
    with pytest.raises(ValueError, match="rope style"):
        fast("qk_norm_rope")[0].fn(q, k, wq, wk, 1e-6, cos, sin, "gptj")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_on_fused_halves(dtype) -> None:
    for t, f in ((3, 1500), (1, 64)):
        gate_up = randn(t, 2 * f, dtype=dtype, seed=f)
        gate, up = gate_up.split(f, dim=-1)
        want = reference("silu_mul").fn(gate, up)
        for impl in fast("silu_mul"):
            close(impl.fn(gate, up), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_oai_on_fused_halves(dtype) -> None:
    """gpt-oss's clamped SwiGLU: values spread past the clamps (|x| up to ~20)."""
    for t, f in ((3, 1440), (1, 64)):
        gate, up = (5 * randn(t, 2 * f, seed=f)).to(dtype).split(f, dim=-1)
        want = reference("swiglu_oai").fn(gate, up)
        assert (gate > 7).any() and (up.abs() > 7).any()
        for impl in fast("swiglu_oai"):
            close(impl.fn(gate, up), want)


def test_empty_inputs() -> None:
    w = randn(8)
    for impl in fast("rms_norm"):
        assert impl.fn(torch.empty(0, 8, device=DEVICE), w, 1e-5).shape == (0, 8)
    for impl in fast("silu_mul"):
        assert impl.fn(*torch.empty(0, 16, device=DEVICE).split(8, -1)).shape == (0, 8)


@pytest.mark.gpu
def test_gpu_llama_widths() -> None:
    """Llama-3-8B widths in bf16: 4096 norms over 64 rows, 32 heads of 128, 14336 SwiGLU."""
    x, res, w = (
        randn(64, 4096, dtype=torch.bfloat16),
        randn(64, 4096, dtype=torch.bfloat16),
        randn(4096),
    )
    n, s = fast("add_rms_norm")[0].fn(x, res, w, 1e-5)
    want_n, want_s = reference("add_rms_norm").fn(x, res, w, 1e-5)
    assert torch.equal(s, want_s)
    close(n, want_n)
    q = randn(64, 32, 128, dtype=torch.bfloat16)
    freqs = torch.arange(64, device=DEVICE).float()[:, None] * torch.rand(64, device=DEVICE)
    close(fast("rope")[0].fn(q, freqs.cos(), freqs.sin(), "normal"),
          reference("rope").fn(q, freqs.cos(), freqs.sin(), "normal"))  # fmt: skip
    g, u = randn(64, 2 * 14336, dtype=torch.bfloat16).split(14336, -1)
    close(fast("silu_mul")[0].fn(g, u), reference("silu_mul").fn(g, u))
