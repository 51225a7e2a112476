"""The qdot kernels of the codebook types (IQ4_NL, IQ4_XS, MXFP4: a 4-bit code indexes 16 int8
values) at their edges, on every instruction-set build this CPU runs: the largest values times
full-scale activations (where an int16 pair sum would saturate if a build flushed too late),
IQ4_XS's extreme group scales, MXFP4's whole exponent range (subnormal scales included), and
the registration that sends them to the kernel in "qdot" mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from hetero.kernels import cpu_qdot, native
from hetero.kernels.cpu_qdot import pack, qdot_linear
from hetero.kernels.cpu_qdot_ref import reference_terms
from hetero.quant import get_quant, random_blocks
from hetero.quant.codebooks import e8m0_half

pytestmark = pytest.mark.skipif(not cpu_qdot.available(), reason="no C compiler builds the kernel")

CODEBOOK = ("IQ4_NL", "IQ4_XS", "MXFP4")
QS = {"IQ4_NL": (2, 18), "IQ4_XS": (8, 136), "MXFP4": (1, 17)}  # the code bytes of a block
# per row (mod 4), the byte every code byte of it holds: nibble codes (0, 0), (15, 15), (7, 7),
# (15, 7): IQ4_NL's -127 and 113, MXFP4's 12 and -12, and a mix
ROW_BYTES = (0x00, 0xFF, 0x77, 0x7F)
VARIANTS = native.supported_variants()


def extreme_blocks(name: str, n: int, k: int) -> torch.Tensor:
    """Random blocks of W [n, k] whose codes are the tables' extremes (ROW_BYTES), and, for
    IQ4_XS, whose group scales are all -32 (ls 0) on even rows and 31 (ls 63) on odd ones."""
    qt = get_quant(name)
    per_row = k // qt.block_size
    blocks = random_blocks(name, n * per_row, np.random.default_rng(4)).reshape(n, per_row, -1)
    lo, hi = QS[name]
    for r in range(n):
        blocks[r, :, lo:hi] = ROW_BYTES[r % 4]
        if name == "IQ4_XS":
            blocks[r, :, 2:8] = 0 if r % 2 == 0 else 0xFF  # scales_h, scales_l
    return torch.from_numpy(blocks.reshape(n, -1))


def full_scale_x(t: int, k: int) -> torch.Tensor:
    """Rows whose int8 codes are all +-127: all +1, all -1, sign flipping per 16, random."""
    flips = (-1.0) ** torch.arange(k // 16).repeat_interleave(16)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 2, (k,), generator=g).float() * 2 - 1 for _ in range(t - 3)]
    return torch.stack([torch.ones(k), -torch.ones(k), flips, *rows])


def assert_reference(y: torch.Tensor, x: torch.Tensor, raw: torch.Tensor, name: str, n, k):
    ref, size = reference_terms(x, raw, int(T[name]), n, k)
    assert ((y.double() - ref).abs() <= 1e-5 * size + 1e-30).all(), name


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", CODEBOOK)
def test_largest_values_times_full_scale_activations_stay_exact(name: str, variant: str):
    n, k = 32, 1024
    raw = extreme_blocks(name, n, k)
    x = full_scale_x(9, k)
    assert bool((cpu_qdot.quantize_x(x, 32)[0].abs() == 127).all())
    y = qdot_linear(x, pack(raw, get_quant(name), n, k), 2, variant)
    assert_reference(y, x, raw, name, n, k)


def test_mxfp4_scale_is_every_exponent_bit_for_bit():
    """The tile's d of MXFP4's 256 exponent bytes equals quant/codebooks.e8m0_half (2^(e-128),
    the subnormals 2^-128 and 2^-127 at e = 0, 1) on every build."""
    qt = get_quant("MXFP4")
    raw = torch.from_numpy(random_blocks("MXFP4", 256, np.random.default_rng(2))).reshape(16, -1)
    raw.view(16, 16, 17)[:, :, 0] = torch.arange(256, dtype=torch.uint8).reshape(16, 16).t()
    w = pack(raw, qt, 16, 512)
    want = e8m0_half(torch.arange(256, dtype=torch.uint8).reshape(16, 16))  # [unit, row]
    for variant in VARIANTS:
        for u in range(16):
            tile = cpu_qdot.unpack_unit(qt.ggml_type, w.packed[0, u], variant)
            assert torch.equal(tile[512:576].view(torch.float32), want[u]), (variant, u)


@pytest.mark.parametrize("variant", VARIANTS)
def test_mxfp4_over_the_exponent_range_equals_the_reference(variant: str):
    n, k = 20, 1024
    raw = torch.from_numpy(random_blocks("MXFP4", n * k // 32, np.random.default_rng(6)))
    e = torch.from_numpy(np.random.default_rng(7).integers(0, 256, n * k // 32).astype(np.uint8))
    raw = raw.reshape(-1, 17)
    raw[:, 0] = e
    raw = raw.reshape(n, -1)
    # x small enough that 2^127 * 12 * k * |x| stays finite in float32
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3)) * 1e-6
    y = qdot_linear(x, pack(raw, get_quant("MXFP4"), n, k), 2, variant)
    assert torch.isfinite(y).all()
    assert_reference(y, x, raw, "MXFP4", n, k)


@pytest.mark.parametrize("name", CODEBOOK)
def test_qdot_mode_takes_the_codebook_types(name: str):
    qt = get_quant(name)
    assert qt.ggml_type in cpu_qdot.NATIVE_TYPES
    assert cpu_qdot.cpu_scheme(name) == cpu_qdot.cpu_scheme(int(qt.ggml_type)) == "qdot"
    assert cpu_qdot.qdot_blocks(name) == name
    assert cpu_qdot.bytes_per_weight(name) == qt.type_size / qt.block_size
    # IQ4_XS's 256-blocks take the K-quants' activations, the 32-blocks the legacy types'
    assert cpu_qdot.activation_block(name) == (256 if name == "IQ4_XS" else 32)
