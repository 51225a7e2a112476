"""CPU packed-weight linear layers: every scheme against what it represents and against the exact
dequantized GGUF weights, on random blocks of several GGUF types and on a real SmolLM2 tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero.kernels.cpu_linear import (
    SCHEMES,
    PackedLinear,
    available_schemes,
    choose_scheme,
    pack_error,
    pack_linear,
    packed_linear,
    unpack,
)
from hetero.kernels.cpu_qdot import NATIVE_TYPES, activation_block
from hetero.kernels.cpu_qdot_ref import quantize_x_reference
from hetero.quant import dequantize, get_quant, random_blocks

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q6_K", "F16", "F32")
BF16_OUT = ("bf16", "int8", "int4")  # kernels that return bfloat16 outputs

# Relative RMS weight error bounds: ~1.4x the worst of 5 seeds measured on these random blocks.
# bf16 / fp16: rounding of every weight (2^-9, 2^-12 relative); int8 / w8a8: one scale per row;
# int4 keeps Q4_0/Q4_1 codes (only d rounds fp16 -> bf16), requantizes everything else.
ERROR_BOUND = {"bf16": 2.5e-3, "fp16": 3e-4, "int8": 1e-2, "w8a8": 1e-2}
INT4_BOUND = {"Q4_0": 2.5e-3, "Q4_1": 2.5e-3}  # others: 4-bit requantization
INT4_REQUANT_BOUND = 0.12


def make_weight(ggml_type: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """GGUF data of shape (n, k) as the reader gives it: uint8 blocks, or typed F16/F32."""
    qt = get_quant(ggml_type)
    blocks = random_blocks(ggml_type, n * k // qt.block_size, np.random.default_rng(seed))
    raw = torch.from_numpy(blocks).reshape(n, -1)
    if ggml_type == "F32":
        return raw.view(torch.float32).reshape(n, k)
    if ggml_type == "F16":
        return raw.view(torch.float16).reshape(n, k)
    return raw


def reference(x: torch.Tensor, p: PackedLinear) -> torch.Tensor:
    """x @ W^T for the W the packing represents, with x rounded as the kernel rounds it."""
    return x.to(p.input_dtype).float() @ unpack(p).t()


def assert_matches(y: torch.Tensor, x: torch.Tensor, p: PackedLinear) -> None:
    w = unpack(p)
    xr = x.to(p.input_dtype).float()
    ref = xr @ w.t()
    scale = xr.abs() @ w.abs().t()  # bounds the float32 accumulation error
    tol = 1e-5 * scale + 1e-30
    if p.scheme in BF16_OUT:
        tol = tol + 2.0**-8 * ref.abs()  # one bf16 rounding of each output
    if p.scheme == "qdot":  # x rounded to int8 per block: |error| <= xd / 2 per element
        qb = activation_block(p.weight.ggml_type)
        step = quantize_x_reference(xr, qb)[1].repeat_interleave(qb, dim=1)
        tol = tol + 0.5 * (1 + 1e-5) * (step @ w.abs().t())
    if p.scheme == "w8a8":  # x quantized to 7-bit steps over [min(x, 0), max(x, 0)] per call
        step = (x.max().clamp(min=0) - x.min().clamp(max=0)) / 127
        tol = tol + 0.51 * step * w.abs().sum(1)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    excess = (y - ref).abs() - tol
    assert excess.max() <= 0, f"{p.scheme}: off by {float(excess.max()):.3g} beyond tolerance"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("ggml_type", TYPES)
def test_packed_linear_equals_unpacked_product(ggml_type: str, scheme: str):
    n, k = 40, 256  # N not a multiple of 16: the int4 packer's padding is exercised
    raw = make_weight(ggml_type, n, k)
    if scheme == "qdot" and get_quant(ggml_type).ggml_type not in NATIVE_TYPES:
        with pytest.raises(ValueError, match="qdot reads"):
            pack_linear(raw, ggml_type, (n, k), scheme)
        return
    p = pack_linear(raw, ggml_type, (n, k), scheme)
    assert (p.scheme, p.out_features, p.in_features) == (scheme, n, k)
    for t in (1, 3, 7):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        assert_matches(packed_linear(x, p), x, p)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("ggml_type", TYPES)
def test_pack_error_within_measured_bound(ggml_type: str, scheme: str):
    n, k = 40, 256
    raw = make_weight(ggml_type, n, k, seed=7)
    if scheme == "qdot" and get_quant(ggml_type).ggml_type not in NATIVE_TYPES:
        return  # refused (above): float types run fp16 in qdot mode
    err = pack_error(raw, ggml_type, (n, k), scheme)
    if scheme == "fp32" or (scheme == "fp16" and ggml_type == "F16"):
        assert err == 0.0
    elif scheme == "qdot":  # the GGUF blocks as they are
        assert err == 0.0
    elif scheme == "int4":
        assert 0 < err <= INT4_BOUND.get(ggml_type, INT4_REQUANT_BOUND)
    else:
        assert 0 < err <= ERROR_BOUND[scheme]


@pytest.mark.parametrize("ggml_type", TYPES + ("BF16",))
def test_fp32_is_the_exact_dequantized_reference(ggml_type: str):
    n, k = 24, 256
    raw = make_weight(ggml_type, n, k)
    exact = dequantize(raw, ggml_type, (n, k))
    p = pack_linear(raw, ggml_type, (n, k), "fp32")
    assert torch.equal(unpack(p), exact)
    x = torch.randn(5, k)
    torch.testing.assert_close(packed_linear(x, p), x @ exact.t(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("ggml_type", "scheme"), [("F16", "fp16"), ("BF16", "bf16")])
def test_half_schemes_are_lossless_for_their_own_type(ggml_type: str, scheme: str):
    n, k = 24, 96
    raw = make_weight(ggml_type, n, k)
    exact = dequantize(raw, ggml_type, (n, k))
    p = pack_linear(raw, ggml_type, (n, k), scheme)
    assert torch.equal(unpack(p), exact)
    assert pack_error(raw, ggml_type, (n, k), scheme) == 0.0


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1"])
def test_int4_keeps_legacy_codes_exactly_when_scales_fit_bf16(ggml_type: str):
    """d with 3 mantissa bits and m = -7.5 d are exact in bf16, as is the zero m + 8d = d/2:
    then int4 must reproduce the GGUF weights bit for bit (codes, nibble order, rows, groups)."""
    n, k = 32, 128
    qt = get_quant(ggml_type)
    rng = np.random.default_rng(3)
    blocks = random_blocks(ggml_type, n * k // 32, rng).reshape(-1, qt.type_size)
    d = (2.0 ** rng.integers(-10, -4, len(blocks))) * (1 + rng.integers(0, 8, len(blocks)) / 8)
    blocks[:, 0:2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    if ggml_type == "Q4_1":
        blocks[:, 2:4] = (-7.5 * d).astype(np.float16).reshape(-1, 1).view(np.uint8)
    raw = torch.from_numpy(blocks).reshape(n, -1)
    p = pack_linear(raw, ggml_type, (n, k), "int4")
    assert torch.equal(unpack(p), dequantize(raw, ggml_type, (n, k)))


def test_float_weights_with_unaligned_k_are_padded():
    n, k = 20, 72  # K not a multiple of the int4 group or the int8 kernels' 32-wide loads
    raw = make_weight("F32", n, k, seed=2)
    for scheme in available_schemes():
        if scheme == "qdot":  # reads GGUF blocks only: F32 runs fp16 in qdot mode
            continue
        p = pack_linear(raw, "F32", (n, k), scheme)
        x = torch.randn(3, k)
        assert_matches(packed_linear(x, p), x, p)
        assert unpack(p).shape == (n, k)


def test_non_contiguous_input_and_empty_batch():
    n, k = 32, 64
    raw = make_weight("Q4_1", n, k)
    wide = torch.randn(5, 2 * k)
    for scheme in available_schemes():
        p = pack_linear(raw, "Q4_1", (n, k), scheme)
        x = wide[:, ::2]  # strided rows: the int kernels need dense, aligned ones
        assert_matches(packed_linear(x, p), x.contiguous(), p)
        assert packed_linear(torch.empty(0, k), p).shape == (0, n)


def test_real_smollm2_tensor(smollm2_path):
    from hetero.gguf_loader import load_gguf

    t = load_gguf(smollm2_path).tensor("blk.0.attn_q.weight")  # Q4_1 576 x 576
    x = torch.randn(3, t.shape[1])
    for scheme in available_schemes():
        p = pack_linear(t.torch(), t.ggml_type, t.shape, scheme)
        assert_matches(packed_linear(x, p), x, p)
    assert pack_error(t.torch(), t.ggml_type, t.shape, "int4") <= INT4_BOUND["Q4_1"]


def test_bad_input_raises_value_error():
    raw = make_weight("Q4_1", 16, 64)
    with pytest.raises(ValueError, match="unknown scheme"):
        pack_linear(raw, "Q4_1", (16, 64), "int3")
    with pytest.raises(ValueError, match="TQ1_0|not supported|unknown"):
        pack_linear(raw, "TQ1_0", (16, 64), "int4")
    with pytest.raises(ValueError, match="bytes"):
        pack_linear(raw[:8], "Q4_1", (16, 64), "int4")
    with pytest.raises(ValueError, match="2-D"):
        pack_linear(raw, "Q4_1", (4, 4, 64), "fp32")
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_linear(raw, "Q4_1", (16, 48), "fp32")
    p = pack_linear(raw, "Q4_1", (16, 64), "int4")
    with pytest.raises(ValueError, match="float32"):
        packed_linear(torch.randn(2, 63), p)
    with pytest.raises(ValueError, match="float32"):
        packed_linear(torch.randn(2, 64, dtype=torch.float64), p)
    nan = raw.clone()
    nan[0, 0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # block 0's d = fp16 nan
    for scheme in available_schemes():
        with pytest.raises(ValueError, match="inf/nan"):
            pack_linear(nan, "Q4_1", (16, 64), scheme)
    big = torch.full((16, 32), 1e6, dtype=torch.float32)
    with pytest.raises(ValueError, match="fp16 cannot hold"):
        pack_linear(big, "F32", (16, 32), "fp16")
    with pytest.raises(ValueError, match="unknown scheme"):
        choose_scheme(raw, "Q4_1", (16, 64), tokens=1, candidates=("fp8",))


def test_choose_scheme_prefers_fast_schemes_within_the_error_budget():
    shape = (32, 256)
    q4, q8, f16 = (make_weight(t, *shape) for t in ("Q4_1", "Q8_0", "F16"))
    if "qdot" in available_schemes():  # keeps the blocks (weight error 0): fastest up to T=16
        for tokens in (1, 2, 16):
            assert choose_scheme(q4, "Q4_1", shape, tokens=tokens) == "qdot"
            assert choose_scheme(q8, "Q8_0", shape, tokens=tokens) == "qdot"
        assert choose_scheme(q4, "Q4_1", shape, tokens=512) == "fp16"
        # qdot does not read F16: fp16, the next fastest
        assert choose_scheme(f16, "F16", shape, tokens=1) == "fp16"
    no_qdot = ("fp32", "bf16", "fp16", "int8", "int4")
    # int4 keeps Q4_1's codes (error ~2e-3): measured fastest for one token, fp16 beyond
    assert choose_scheme(q4, "Q4_1", shape, tokens=1, candidates=no_qdot) == "int4"
    for tokens in (2, 16, 512):
        assert choose_scheme(q4, "Q4_1", shape, tokens=tokens, candidates=no_qdot) == "fp16"
    # int4 requantizes Q8_0 (~6%): over the budget, so fp16, the next fastest
    assert choose_scheme(q8, "Q8_0", shape, tokens=1, candidates=no_qdot) == "fp16"
    # without fp16 (its ops gone from a later torch, say): per-row int8 is over the budget too
    no_fp16 = ("fp32", "bf16", "int8", "int4")
    assert choose_scheme(q8, "Q8_0", shape, tokens=1, candidates=no_fp16) == "bf16"
    assert choose_scheme(q8, "Q8_0", shape, tokens=64, candidates=no_fp16) == "fp32"
    assert choose_scheme(q8, "Q8_0", shape, tokens=1, max_error=0.0, candidates=no_qdot) == "fp32"
    assert choose_scheme(f16, "F16", shape, tokens=1, max_error=0.0) == "fp16"  # lossless
    big = torch.randn(*shape) * 1e5  # beyond fp16's range: packing it raises, so it is skipped
    assert choose_scheme(big, "F32", shape, tokens=1, candidates=no_qdot) == "bf16"
