"""The native qdot CPU kernel against its torch twin (the same integer arithmetic) and against the
exact dequantized GGUF weights, for every kind of weight it packs, odd shapes and thread counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero.kernels import cpu_qdot
from hetero.kernels.cpu_qdot import (
    pack,
    qdot_linear,
    qdot_reference,
    quantize_x,
    quantize_x_reference,
    unpack,
)
from hetero.quant import dequantize, get_quant, random_blocks

pytestmark = pytest.mark.skipif(not cpu_qdot.available(), reason="no C compiler builds the kernel")

NATIVE = ("Q4_0", "Q4_1", "Q8_0")
REQUANT = ("Q6_K", "Q5_1", "F16")  # requantized to 8 bits per 32-block at load


def weight(ggml_type: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    qt = get_quant(ggml_type)
    blocks = random_blocks(ggml_type, n * k // qt.block_size, np.random.default_rng(seed))
    raw = torch.from_numpy(blocks).reshape(n, -1)
    return raw.view(torch.float16).reshape(n, k) if ggml_type == "F16" else raw


def test_activation_quantization_is_bit_identical_to_torch():
    x = torch.randn(7, 96) * torch.logspace(-3, 3, 7)[:, None]
    x[1] = 0  # an all-zero block: scale 0, codes 0
    x[2, :32] = torch.arange(32) * (127 / 31) / 127  # values on the half-steps: ties round even
    x[3, 5] = -1e4  # one outlier sets its block's scale
    for a, b in zip(quantize_x(x), quantize_x_reference(x)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    xq, xd, xs = quantize_x(x)
    assert xq.abs().max() <= 127 and torch.equal(xs, xd * xq.sum(-1).float())


def abs_terms(x, w) -> torch.Tensor:
    """sum over blocks of |d * xd * dot| + |m * xs|: what bounds a float32 sum's rounding."""
    xq, xd, xs = quantize_x_reference(x)
    codes, d, m = w.rows()
    dots = torch.einsum("tbj,nbj->tnb", xq.double(), codes.double()).abs()
    out = (dots * (d.double().abs()[None] * xd.double()[:, None])).sum(-1)
    if m is not None:
        out = out + xs.double().abs() @ m.double().abs().t()
    return out.float() + 1e-30


@pytest.mark.parametrize("ggml_type", NATIVE + REQUANT)
def test_kernel_equals_integer_reference(ggml_type: str):
    k = 256 if ggml_type == "Q6_K" else 96  # K a multiple of 32 (K-quants: of 256)
    for n, threads in ((1, 1), (13, 2), (45, 3), (130, 2), (64, 1)):  # N % 8 != 0, N % 64 != 0
        qt = get_quant(ggml_type)
        w = pack(weight(ggml_type, n, k, seed=n), qt, n, k)
        assert w.is_q4 == (ggml_type in ("Q4_0", "Q4_1"))
        for t in (1, 2, 3, 7, 8, 9, 16, 17, 33):  # within, at and across the row tiles
            x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
            y = qdot_linear(x, w, threads=threads)
            # float32 sums of the per-block terms in another order
            assert ((y - qdot_reference(x, w)).abs() <= 1e-5 * abs_terms(x, w)).all(), (n, t)


@pytest.mark.parametrize("ggml_type", NATIVE)
def test_native_types_keep_exact_weights(ggml_type: str):
    n, k = 19, 128
    raw = weight(ggml_type, n, k)
    assert torch.equal(
        unpack(pack(raw, get_quant(ggml_type), n, k)), dequantize(raw, ggml_type, (n, k))
    )


@pytest.mark.parametrize("ggml_type", NATIVE + REQUANT)
def test_against_exact_weights_within_activation_rounding(ggml_type: str):
    """|y - x @ W^T| <= sum_j |w_j| * xd_j / 2 (each x_j is off by at most half its block's step)
    plus, for requantized types, the weights' own 8-bit rounding (|dw| <= d / 2 per block)."""
    n, k = 37, 256
    raw = weight(ggml_type, n, k, seed=5)
    exact = dequantize(raw, ggml_type, (n, k))
    w = pack(raw, get_quant(ggml_type), n, k)
    x = torch.randn(5, k)
    y = qdot_linear(x, w)
    step = quantize_x_reference(x)[1].repeat_interleave(32, dim=1)
    bound = 0.5 * step @ exact.abs().t()
    if ggml_type in REQUANT:
        bound = bound + 0.5 * x.abs() @ w.rows()[1].repeat_interleave(32, dim=1).t()
    bound = bound * (1 + 1e-4) + 1e-5 * (x.abs() @ exact.abs().t())
    assert ((y - x @ exact.t()).abs() <= bound).all()
    rel = float((y - x @ exact.t()).norm() / (x @ exact.t()).norm())
    assert rel < 1e-2  # measured 4-7e-3 on random blocks and Gaussian x


def test_padding_of_k_and_empty_batch():
    n, k = 10, 72  # float weights whose K is no multiple of 32: zero-padded
    w = pack(torch.randn(n, k), get_quant("F32"), n, k)
    assert w.d.shape == (n, 3) and w.k == 96 and not w.is_q4
    x = torch.randn(4, k)
    torch.testing.assert_close(qdot_linear(x, w), qdot_reference(x, w), rtol=1e-5, atol=1e-5)
    assert qdot_linear(torch.empty(0, k), w).shape == (0, n)


def test_portable_c_fallback_matches(tmp_path):
    """The plain C loops (built without AVX2) compute the same as the integer reference."""
    import ctypes

    from hetero.kernels import native

    lib_path = tmp_path / "portable.so"
    flags = ("-O2", "-shared", "-fPIC", "-std=gnu11", "-mno-avx2")
    assert native._compile(native._compiler(), flags, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    args, res = native.SIGNATURES["qdot_linear"]
    lib.qdot_linear.argtypes, lib.qdot_linear.restype = args, res
    for ggml_type in NATIVE:
        n, k = 21, 96
        w = pack(weight(ggml_type, n, k, seed=4), get_quant(ggml_type), n, k)
        m = w.m.data_ptr() if w.m is not None else None
        for t in (1, 5):
            x, y = torch.randn(t, k), torch.empty(t, n)
            ptrs = (w.qs.data_ptr(), w.d.data_ptr(), m, x.data_ptr(), y.data_ptr())
            assert lib.qdot_linear(int(w.is_q4), n, k, t, *ptrs, 1) == 0
            assert ((y - qdot_reference(x, w)).abs() <= 1e-5 * abs_terms(x, w)).all()
