"""Triton quantized matmul (hetero.kernels.triton_qmatmul) against the torch reference.

Every packable GGUF type, fresh random blocks, odd N, K tails, T in {1, 3, 8, 17, 64}. Without CUDA
the kernels run under Triton's interpreter (tests/triton_interp.py sets TRITON_INTERPRET=1 before
triton is first imported), on small shapes; the `gpu` tests run the compiled kernels on the
device. The registry walk compares every qlinear implementation a device supports with the
reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero.kernels import implementations, reference
from hetero.kernels import triton_qmatmul as tq
from hetero.kernels.reference import qlinear_ref
from hetero.kernels.registry import prepare_weight
from hetero.kernels.repack import SPECS, PackedWeight, dequantize_packed, repack
from hetero.quant import dequantize, get_quant, random_blocks
from tests.support.triton_interp import (  # noqa: F401  (kernels_runnable: an autouse fixture)
    CUDA,
    DEVICE,
    INTERPRETED,
    kernels_runnable,
    rerun_test,
)

triton = pytest.importorskip("triton")
TYPES = [t.name for t in SPECS]


test_in_a_fresh_interpreter_process = rerun_test(__file__)


def make_weight(ggml_type: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, PackedWeight]:
    """Random GGUF bytes [n, row_bytes] of a W [n, k] on DEVICE, and their packed planes."""
    qt = get_quant(ggml_type)
    blocks = random_blocks(ggml_type, n * k // qt.block_size, np.random.default_rng(seed))
    raw = torch.from_numpy(blocks).reshape(n, -1).to(DEVICE)
    return raw, repack(raw, ggml_type, (n, k))


def assert_close(y: torch.Tensor, x: torch.Tensor, raw: torch.Tensor, ggml_type: str) -> None:
    """y against the reference x @ W^T, within the rounding the inputs' dtype allows.

    The bound scales with |x| @ |W|^T (the float32 accumulation-order error of a K-long sum);
    half precision adds the rounding of each weight to x's dtype (which the decode kernel skips:
    it multiplies the float32 weights) and the rounding of the output.
    """
    n, k = y.shape[-1], x.shape[-1]
    qt = get_quant(ggml_type)
    ref = qlinear_ref(x, raw, int(qt.ggml_type), (n, k)).float()
    w = dequantize(raw, qt.ggml_type, (n, k))
    scale = x.float().abs().reshape(-1, k) @ w.abs().t()
    eps = {torch.float32: 2e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[x.dtype]
    tol = 4 * eps * scale.reshape(ref.shape) + eps * ref.abs() + 1e-6
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    bad = (y.float() - ref).abs() > tol
    assert not bad.any(), f"{bad.sum().item()} of {bad.numel()} outputs off; max error " + str(
        ((y.float() - ref).abs() - tol).max().item()
    )


# Interpreter shapes: N odd (masked rows), K two K-quant super-blocks; the legacy types also get
# K = 352 (11 blocks: a step of 256 codes and a ragged one).
def _k_values(ggml_type: str) -> list[int]:
    return [512] if get_quant(ggml_type).block_size == 256 else [512, 352]


@pytest.mark.parametrize("ggml_type", TYPES)
def test_packed_planes_hold_the_reference_values(ggml_type: str) -> None:
    """The packed layout decodes (in torch) to hetero.quant.dequantize bit for bit."""
    for k in _k_values(ggml_type):
        raw, pw = make_weight(ggml_type, 7, k, seed=k)
        exact = dequantize(raw, ggml_type, (7, k))
        assert torch.equal(dequantize_packed(pw).view(torch.int32), exact.view(torch.int32))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_dequant_kernel_is_bit_exact(ggml_type: str) -> None:
    raw, pw = make_weight(ggml_type, 19, 512, seed=1)
    exact = dequantize(raw, ggml_type, (19, 512))
    got = tq.qdequant(pw, torch.float32, block_n=32)
    assert torch.equal(got.view(torch.int32), exact.view(torch.int32))
    # Rounded to half precision as torch rounds (to nearest even). The interpreter truncates
    # float32 -> bfloat16, so it checks float16 only; the device checks both.
    for dtype in (torch.float16, torch.bfloat16) if CUDA else (torch.float16,):
        rows = tq.qdequant(pw, dtype, slice(5, 12), block_n=32)
        assert torch.equal(rows.view(torch.int16), exact[5:12].to(dtype).view(torch.int16))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_decode_kernel(ggml_type: str) -> None:
    """T = 1 and 3, split-K forced (the in-kernel fix-up) and not, two row tiles."""
    for k in _k_values(ggml_type):
        raw, pw = make_weight(ggml_type, 37, k, seed=k + 2)
        for t, split in ((1, 2), (3, 1)):
            x = torch.randn(t, k, device=DEVICE)
            assert_close(tq.qgemv(x, pw, split_k=split, block_n=32), x, raw, ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_decode_tokens_kernel(ggml_type: str) -> None:
    """The few-token decode kernel: T = 3 (one group of 4, a masked token), 8, and 11 (a whole
    group of 8 and a ragged one); split-K forced and not; odd N (masked rows)."""
    for k in _k_values(ggml_type):
        raw, pw = make_weight(ggml_type, 37, k, seed=k + 3)
        for t, split in ((3, 2), (8, 1), (11, 3)):
            x = torch.randn(t, k, device=DEVICE)
            assert_close(tq.qgemv_tokens(x, pw, split_k=split), x, raw, ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_tensor_core_kernel(ggml_type: str) -> None:
    """T = 17 and 64 (a partial token tile and whole ones); float32 and float16 activations;
    K whole and split in two (the in-kernel fix-up)."""
    raw, pw = make_weight(ggml_type, 37, 512, seed=5)
    for t, dtype, split in ((17, torch.float32, 1), (64, torch.float16, 2)):
        x = torch.randn(t, 512, device=DEVICE).to(dtype)
        assert_close(tq.qmm(x, pw, block_n=32, split_k=split), x, raw, ggml_type)


def test_bf16_activations_decode_path() -> None:
    raw, pw = make_weight("Q4_K", 21, 256, seed=9)
    x = torch.randn(2, 256, device=DEVICE).to(torch.bfloat16)
    assert_close(tq.qgemv(x, pw, block_n=32), x, raw, "Q4_K")


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q6_K"])
def test_dense_path_slabs(ggml_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large T: dequantize in row slabs, then torch's matmul (equal to the reference)."""
    raw, pw = make_weight(ggml_type, 37, 256, seed=11)
    monkeypatch.setattr(tq, "DENSE_SLAB_ELEMENTS", 10 * 256)  # slabs of 10 rows: 4 of them
    x = torch.randn(5, 256, device=DEVICE)
    assert_close(tq.dense_mm(x, pw), x, raw, ggml_type)


def test_qlinear_entry_point_shapes_and_paths() -> None:
    """The registered function: raw bytes or prepared weights, [..., K] inputs, every path."""
    impl = next(i for i in implementations("qlinear") if i.name == "triton")
    raw, _ = make_weight("Q5_K", 19, 256, seed=13)
    qtype = int(get_quant("Q5_K").ggml_type)
    prepared = prepare_weight(impl, raw, qtype, (19, 256))
    assert isinstance(prepared, PackedWeight)
    for t in (1, 3, 8, 17, 64):
        x = torch.randn(t, 256, device=DEVICE)
        assert_close(impl.fn(x, prepared, qtype, (19, 256)), x, raw, "Q5_K")
    x3 = torch.randn(2, 2, 256, device=DEVICE)
    y3 = impl.fn(x3, raw, qtype, (19, 256))  # raw bytes: repacked per call
    assert y3.shape == (2, 2, 19)
    assert_close(y3.reshape(4, 19), x3.reshape(4, 256), raw, "Q5_K")
    assert impl.fn(torch.randn(0, 256, device=DEVICE), prepared, qtype, (19, 256)).shape == (0, 19)


def test_qlinear_errors_and_fallback() -> None:
    impl = next(i for i in implementations("qlinear") if i.name == "triton")
    raw, pw = make_weight("Q4_0", 8, 64, seed=0)
    q4 = int(get_quant("Q4_0").ggml_type)
    with pytest.raises(ValueError, match="features"):
        impl.fn(torch.randn(1, 32, device=DEVICE), pw, q4, (8, 64))
    with pytest.raises(ValueError, match="packed weight is Q4_0"):
        impl.fn(torch.randn(1, 64, device=DEVICE), pw, int(get_quant("Q8_0").ggml_type), (8, 64))
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        impl.fn(torch.ones(1, 64, dtype=torch.int32, device=DEVICE), pw, q4, (8, 64))
    with pytest.raises(ValueError, match="do not hold"):
        repack(raw[:, :-2], "Q4_0", (8, 64))
    with pytest.raises(ValueError, match="no packed GPU layout"):
        repack(raw, "F16", (8, 64))
    # F16 has no packed layout: the function (and the prepare hook) hand it to the reference.
    w16 = torch.randn(8, 64, device=DEVICE).to(torch.float16)
    f16 = int(get_quant("F16").ggml_type)
    assert prepare_weight(impl, w16, f16, (8, 64)) is w16
    x = torch.randn(2, 64, device=DEVICE)
    assert torch.equal(impl.fn(x, w16, f16, (8, 64)), qlinear_ref(x, w16, f16, (8, 64)))


def test_supports_needs_cuda_with_bf16_tensor_cores() -> None:
    assert not tq.triton_supported(torch.device("cpu"))
    if CUDA:
        major, _ = torch.cuda.get_device_capability()
        assert tq.triton_supported(torch.device("cuda")) == (major >= 8)


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q8_0"])
def test_registry_walk(ggml_type: str) -> None:
    """Every qlinear implementation the device runs (and the Triton one under the interpreter)
    equals the reference, T in {1, 3, 8, 17, 64}: a new implementation is tested by registering."""
    ref = reference("qlinear")
    raw, _ = make_weight(ggml_type, 19, 256, seed=21)
    qtype = int(get_quant(ggml_type).ggml_type)
    for impl in implementations("qlinear"):
        if impl is ref or not (impl.supports(DEVICE) or (impl.name == "triton" and INTERPRETED)):
            continue
        weight = prepare_weight(impl, raw, qtype, (19, 256))
        for t in (1, 3, 8, 17, 64):
            x = torch.randn(t, 256, device=DEVICE)
            assert_close(impl.fn(x, weight, qtype, (19, 256)), x, raw, ggml_type)


# ----------------------------------------------------------------------------- on the device


# (tokens, activation dtype): every path (decode <= 2, few-token decode <= 8, tensor cores, dense
# >= 160) in bf16, and each kernel once in fp16 and fp32 (each pair compiles its own variants).
GPU_CASES = [
    (1, torch.bfloat16),
    (2, torch.float16),
    (3, torch.bfloat16),
    (8, torch.float16),
    (12, torch.bfloat16),
    (17, torch.float32),
    (64, torch.bfloat16),
    (300, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", TYPES)
def test_gpu_all_paths(ggml_type: str) -> None:
    """Compiled kernels on model-like and ragged shapes against the reference on the device."""
    impl = next(i for i in implementations("qlinear") if i.name == "triton")
    qtype = int(get_quant(ggml_type).ggml_type)
    for n, k in ((1001, 1024), (256, 4096), (4096, 512)):
        raw, pw = make_weight(ggml_type, n, k, seed=n + k)
        for t, dtype in GPU_CASES:
            x = torch.randn(t, k, device=DEVICE).to(dtype)
            assert_close(impl.fn(x, pw, qtype, (n, k)), x, raw, ggml_type)
        exact = dequantize(raw, ggml_type, (n, k))
        got = tq.qdequant(pw, torch.float32)
        assert torch.equal(got.view(torch.int32), exact.view(torch.int32))
        x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        y = tq.qgemv(x, pw, split_k=4)
        x16 = torch.randn(16, k, device=DEVICE, dtype=torch.bfloat16)
        y16 = tq.qmm(x16, pw, split_k=3)
        assert_close(y16, x16, raw, ggml_type)
        x6 = torch.randn(6, k, device=DEVICE, dtype=torch.bfloat16)
        y6 = tq.qgemv_tokens(x6, pw, split_k=3)
        assert_close(y6, x6, raw, ggml_type)
        for _ in range(3):  # split-K counters reset themselves: same bits every launch
            assert torch.equal(tq.qgemv(x, pw, split_k=4), y)
            assert torch.equal(tq.qmm(x16, pw, split_k=3), y16)
            assert torch.equal(tq.qgemv_tokens(x6, pw, split_k=3), y6)
