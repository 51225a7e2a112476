"""The IQ4_NL / IQ4_XS quantizers (hetero.quant.iq4_quantize) against a literal scalar port of
llama.cpp's quantize_row_iq4_nl_impl (ggml-quants.c, no importance matrix, ntry = 7), float32
throughout, and their bytes decoded by the gguf package.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants

from hetero.quant import get_quant, quantize
from hetero.quant.codebooks import IQ4NL_VALUES

f = np.float32
VALUES = [f(v) for v in IQ4NL_VALUES]


def _nint(v) -> int:
    return int(np.rint(f(v)))


def _best_index(x) -> int:  # best_index_int8: branchless binary search on doubled midpoints
    x2, idx = f(x + x), 0
    for step in (8, 4, 2, 1):
        j = idx + step
        idx = j if x2 >= f(VALUES[j - 1] + VALUES[j]) else idx
    return idx


def _sums(xb, w, inv):
    sumqx = sumq2 = f(0)
    for j in range(len(xb)):
        q = VALUES[_best_index(f(inv * xb[j]))]
        sumqx = f(sumqx + f(f(w[j] * q) * xb[j]))
        sumq2 = f(sumq2 + f(f(w[j] * q) * q))
    return sumqx, sumq2


def _group_scale(xb) -> np.float32:
    w = [f(v * v) for v in xb]
    amax, mx = f(0), f(0)
    for v in xb:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < f(1e-15):
        return f(0)
    d = f(-mx / VALUES[0])
    sumqx, sumq2 = _sums(xb, w, f(f(1) / d))
    d = f(sumqx / sumq2) if sumq2 > 0 else f(0)
    best = f(d * sumqx)
    for itry in range(-7, 8):
        sumqx, sumq2 = _sums(xb, w, f(f(itry + VALUES[0]) / mx))
        if sumq2 > 0 and f(sumqx * sumqx) > f(best * sumq2):
            d = f(sumqx / sumq2)
            best = f(d * sumqx)
    return d


def _ref_iq4_nl(x) -> np.ndarray:
    """One 32-block, decoded: fp16 d, codes for 1/d (the float32 d)."""
    xb = [f(v) for v in x]
    d = _group_scale(xb)
    inv = f(f(1) / d) if d else f(0)
    return np.array([f(f(np.float16(d)) * VALUES[_best_index(f(inv * v))]) for v in xb])


def _ref_iq4_xs(x) -> np.ndarray:
    """One 256-block, decoded."""
    groups = [[f(v) for v in x[g : g + 32]] for g in range(0, 256, 32)]
    scales = [_group_scale(xb) for xb in groups]
    amax, big = f(0), f(0)
    for s in scales:
        if abs(s) > amax:
            amax, big = abs(s), s
    d = f(-big / f(32))
    inv = f(f(1) / d) if d else f(0)
    dh = f(np.float16(d))
    out = []
    for xb, s in zip(groups, scales, strict=True):
        level = max(-32, min(31, _nint(f(inv * s))))
        dl = f(d * level)
        idl = f(f(1) / dl) if dl else f(0)
        out += [f(f(dh * level) * VALUES[_best_index(f(idl * v))]) for v in xb]
    return np.array(out)


def _rows() -> np.ndarray:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[1, :32] = 0  # a zero group
    x[1, 32:64] = -0.4  # a constant negative run
    x[2] *= np.float32(1e-3)  # weight-sized values: fp16 scales near the subnormal range
    x[3, 100] = 40.0  # an outlier: its group's scale dominates the super-block
    return x


@pytest.mark.parametrize("name", ["IQ4_NL", "IQ4_XS"])
def test_matches_a_literal_port_of_the_llama_cpp_quantizer(name: str) -> None:
    x = _rows()
    if name == "IQ4_NL":
        expected = np.stack([_ref_iq4_nl(g) for g in x.reshape(-1, 32)]).reshape(x.shape)
    else:
        expected = np.stack([_ref_iq4_xs(row) for row in x])
    got = quants.dequantize(quantize(x, name), get_quant(name).ggml_type)
    assert np.array_equal(got.view(np.uint32), expected.astype(np.float32).view(np.uint32))


def test_all_zero_blocks_decode_to_zero() -> None:
    for name in ("IQ4_NL", "IQ4_XS"):
        raw = quantize(np.zeros((2, 256), np.float32), name)
        assert not quants.dequantize(raw, get_quant(name).ggml_type).any()


def test_iq4_xs_keeps_each_groups_scale() -> None:
    """Groups of very different magnitude in one super-block keep their own 6-bit scales: a
    group 30x smaller than its neighbours still decodes within the codebook's step."""
    x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    x[0, 64:96] *= np.float32(1 / 30)
    y = quants.dequantize(quantize(x, "IQ4_XS"), get_quant("IQ4_XS").ggml_type)
    small = x[0, 64:96]
    err = np.sqrt(np.mean((y[0, 64:96] - small) ** 2)) / np.sqrt(np.mean(small**2))
    assert err < 0.15, err
