"""The native qdot CPU kernels against an integer reference built from the GGUF bytes in torch
(kernels/cpu_qdot_ref.py), for every block type and every instruction-set build this CPU runs
(AVX-512 VNNI, AVX2 and the plain C build on an AVX-512 machine), and against the exact
dequantized weights within the activations' rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero.kernels import cpu_qdot, native
from hetero.kernels.cpu_qdot import gguf_bytes, pack, qdot_linear, quantize_x, unpack
from hetero.kernels.cpu_qdot_ref import quantize_x_reference, reference_terms, split
from hetero.quant import dequantize, get_quant, random_blocks

pytestmark = pytest.mark.skipif(not cpu_qdot.available(), reason="no C compiler builds the kernel")

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
TYPES += ("IQ4_NL", "IQ4_XS", "MXFP4")  # the codebook types
SIGNED = ("Q8_0", "IQ4_NL", "IQ4_XS")  # int8 codes
VARIANTS = native.supported_variants() + native.emulations()  # amxemu: AMX's code, in C
AVX512_FAMILY = ("amx", "amxemu", "avx512")  # the builds whose VNNI reads codes unsigned


def weight(ggml_type: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    qt = get_quant(ggml_type)
    blocks = random_blocks(ggml_type, n * k // qt.block_size, np.random.default_rng(seed))
    return torch.from_numpy(blocks).reshape(n, -1)


def check_against_reference(x, raw, ggml_type, n, k, y) -> None:
    ref, size = reference_terms(x, raw, int(get_quant(ggml_type).ggml_type), n, k)
    # exact integers, then float32 sums of the per-block terms in another order
    assert ((y.double() - ref).abs() <= 1e-5 * size + 1e-30).all()


def test_this_machine_runs_a_simd_build():
    assert native.supported_variants()[-1] == "generic" and len(native.supported_variants()) > 1
    for v in VARIANTS:
        assert cpu_qdot.isa(v) == cpu_qdot.ISA_NAMES[native.ISA_CODES[v]]


@pytest.mark.parametrize("qb", (32, 256))
@pytest.mark.parametrize("variant", VARIANTS)
def test_activation_quantization_is_bit_identical_to_torch(variant: str, qb: int):
    x = torch.randn(7, 512) * torch.logspace(-3, 3, 7)[:, None]
    x[1] = 0  # an all-zero block: scale 0, codes 0
    x[2, :32] = torch.arange(32) * (127 / 31) / 127  # values on the half-steps: ties round even
    x[3, 5] = -1e4  # one outlier sets its block's scale
    got, want = quantize_x(x, qb, variant), quantize_x_reference(x, qb)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got[0].abs().max() <= 127


@pytest.mark.parametrize("ggml_type", TYPES)
def test_packing_moves_the_gguf_bytes_without_changing_them(ggml_type: str):
    qt = get_quant(ggml_type)
    n, k = 21, 512  # n not a multiple of 16: zero rows pad the last group
    raw = weight(ggml_type, n, k, seed=3)
    w = pack(raw, qt, n, k)
    assert w.nbytes == 32 * (k // qt.block_size) * qt.type_size  # two groups of 16 rows
    assert torch.equal(gguf_bytes(w).reshape(n, -1), raw)
    assert torch.equal(unpack(w), dequantize(raw, qt.ggml_type, (n, k)))
    assert cpu_qdot.bytes_per_weight(ggml_type) == qt.type_size / qt.block_size


@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_integer_split_is_the_dequantization(ggml_type: str):
    n, k = 5, 512
    raw = weight(ggml_type, n, k, seed=2)
    exact = dequantize(raw, get_quant(ggml_type).ggml_type, (n, k)).double()
    parts = split(raw, int(get_quant(ggml_type).ggml_type), n, k)
    torch.testing.assert_close(parts.weights(), exact, rtol=1e-6, atol=0)
    assert int(parts.u.min()) >= (-128 if ggml_type in SIGNED + ("MXFP4",) else 0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("ggml_type", TYPES)
def test_kernel_equals_integer_reference(ggml_type: str, variant: str):
    k = 512
    for n, threads in ((1, 1), (13, 2), (45, 3), (130, 2)):  # N % 16 != 0
        raw = weight(ggml_type, n, k, seed=n)
        w = pack(raw, get_quant(ggml_type), n, k)
        for t in (1, 3, 8, 9, 17):  # within, at and across the register tiles (4 or 8 rows)
            x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
            check_against_reference(x, raw, ggml_type, n, k, qdot_linear(x, w, threads, variant))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("ggml_type", ("Q4_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"))
def test_rows_do_not_depend_on_tiles_or_threads(ggml_type: str, variant: str):
    """Each output row is the same sums in the same order whatever the batch and the split (one
    row of Q4_K or Q6_K reads its codes in place, more rows unpack them into tiles)."""
    n, k = 70, 1024
    w = pack(weight(ggml_type, n, k, seed=9), get_quant(ggml_type), n, k)
    x = torch.randn(37, k)
    one_by_one = torch.cat([qdot_linear(x[i : i + 1], w, 1, variant) for i in range(37)])
    for threads in (1, 2, 5):
        assert torch.equal(qdot_linear(x, w, threads, variant), one_by_one)
    assert qdot_linear(torch.empty(0, k), w, 1, variant).shape == (0, n)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_against_exact_weights_within_activation_rounding(ggml_type: str):
    """|y - x @ W^T| <= sum_j |w_j| * xd_j / 2: each x_j is off by at most half its block's
    step, and the weights are the GGUF's exactly."""
    qt = get_quant(ggml_type)
    n, k = 37, 512
    raw = weight(ggml_type, n, k, seed=5)
    exact = dequantize(raw, qt.ggml_type, (n, k))
    x = torch.randn(5, k)
    y = qdot_linear(x, pack(raw, qt, n, k))
    qb = cpu_qdot.activation_block(ggml_type)
    step = quantize_x_reference(x, qb)[1].repeat_interleave(qb, dim=1)
    bound = 0.5 * step @ exact.abs().t() + 1e-5 * (x.abs() @ exact.abs().t())
    want = x @ exact.t()
    assert ((y - want).abs() <= bound).all()
    assert float((y - want).norm() / want.norm()) < 2e-2  # measured 5-8e-3


def code_bias(ggml_type: str, variant: str) -> int:
    """What the tile adds to an int8 code so that the dot can read it unsigned: VNNI's u8 x s8
    takes Q8_0 and IQ4 values + 128; MXFP4's -12 .. 12 is + 12 on every build (cpu_qcodebook.c)."""
    if ggml_type == "MXFP4":
        return 12
    return 128 if variant in AVX512_FAMILY and ggml_type in SIGNED else 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_tile_holds_the_integer_split(variant: str):
    """One unit of 16 rows unpacked by the C code: codes, scales and offsets equal the torch
    split of the same GGUF bytes, integer for integer (a biased code's offset, -bias times its
    scale, in the offsets); the float scales bit for bit."""
    for ggml_type in TYPES:
        qt = get_quant(ggml_type)
        raw = weight(ggml_type, 16, qt.block_size, seed=7)
        parts = split(raw, int(qt.ggml_type), 16, qt.block_size)
        tile = cpu_qdot.unpack_unit(qt.ggml_type, pack(raw, qt, 16, qt.block_size).packed, variant)
        codes = tile[: qt.block_size * 16].reshape(-1, 16, 4).permute(1, 0, 2).reshape(16, -1)
        bias = code_bias(ggml_type, variant)
        signed = ggml_type in SIGNED and not bias
        codes = (codes.view(torch.int8) if signed else codes).long() - bias
        assert torch.equal(codes, parts.u[:, 0]), ggml_type
        if qt.block_size == 32:
            d = tile[512:576].view(torch.float32).double()
            assert torch.equal(d, parts.d[:, 0]), ggml_type
            continue
        nsub = parts.sc.shape[2]
        sc = tile[4096 : 4096 + 64 * nsub].view(torch.int32).reshape(nsub, 16).t().long()
        assert torch.equal(sc, parts.sc[:, 0]), ggml_type
        mn = tile[5120:5632].view(torch.int16).reshape(8, 16, 2).permute(1, 0, 2)
        offsets = parts.off[:, 0] - bias * sc.repeat_interleave(16 // nsub, dim=1)
        assert torch.equal(mn.reshape(16, 16).long(), offsets), ggml_type
        dk = tile[5632:5696].view(torch.float32).double()
        assert torch.equal(dk, parts.d[:, 0]) and torch.equal(
            tile[5696:5760].view(torch.float32).double(), parts.dm[:, 0]
        )


def test_the_pool_runs_every_item_once():
    for n, threads in ((1, 4), (7, 2), (1000, 3), (5000, 8)):
        used, sums = cpu_qdot.pool_selftest(n, threads)
        assert sum(sums) == n * (n + 1) // 2
        assert 1 <= used <= min(threads, n)


def test_back_to_back_jobs_never_mix():
    """Many short jobs in a row, more threads than cores (workers are descheduled mid-loop),
    two contexts taking turns: every job's items ran once, with its own context, before
    pool_run returned. Before the state was published first, a worker late from the last job
    ran an item of the next: 15 wrong jobs in 200k at 8 threads on 2 cores."""
    lib = native.load()
    assert lib.native_pool_stress(100_000, 8) == 0
    assert lib.native_pool_stress(20_000, 3) == 0


def test_a_forced_instruction_set_must_be_one_the_cpu_runs(monkeypatch):
    for v in (native.supported_variants()[-1], *native.emulations()):
        monkeypatch.setenv("HETERO_CPU_ISA", v)
        assert native.variant() == v
    monkeypatch.setenv("HETERO_CPU_ISA", "sve2")
    with pytest.raises(ValueError, match="this CPU runs"):
        native.variant()


KQUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v in ("amx", "amxemu")])
@pytest.mark.parametrize("ggml_type", KQUANTS)
def test_amx_tiles_equal_the_vnni_kernel_bit_for_bit(ggml_type: str, variant: str):
    """From 16 activation rows a K-quant product runs on AMX tiles (kernels/cpu_qdot_amx.h: the
    sub-block scales multiplied into two int8 planes of the weights, C_lo + 128 C_hi = kdot's
    int32, then kdot's float steps): pairs of token tiles, a single one, the rows past the last
    tile on VNNI, groups done together and items split along the rows all give the AVX-512
    build's floats exactly. Extreme scales (Q6_K's -128, the largest codes) included: the
    random blocks draw every scale byte."""
    qt = get_quant(ggml_type)
    shapes = ((70, 1024, 37, 1), (45, 512, 100, 3), (16, 256, 50, 2), (300, 512, 600, 2))
    for n, k, t, threads in shapes:
        raw = weight(ggml_type, n, k, seed=t)
        w = pack(raw, qt, n, k)
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(n))
        want = qdot_linear(x, w, threads, "avx512")
        assert torch.equal(qdot_linear(x, w, threads, variant), want)
