"""hetero.quant quantizers: quality on Gaussian data, byte layout (decoded by the gguf package),
sizes, re-quantization stability, and agreement with a literal scalar port of llama.cpp's
reference K-quantizers (ggml-quants.c), which the vectorized numpy code must reproduce.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants

from hetero.quant import QuantType, get_quant, quantize, supported_types

WRITABLE = [q for q in supported_types() if q.quantize is not None]
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]

# Relative RMS round-trip error on N(0, 1) data: measured value (64 x 4096 values, seed 1) with
# ~10% margin. A quantizer with a wrong scale or a misplaced field lands far above these.
#   measured: Q8_0 0.535%  Q6_K 1.78%  Q5_1 3.79%  Q5_K 3.61%  Q5_0 4.27%  Q4_1 7.83%
#             Q4_K 7.14%   Q4_0 8.60%  Q3_K 15.1%  Q2_K 29.7%  F16 0.021%  BF16 0.166%
#             MXFP4 11.5% (power-of-two scales: amax / d in [4, 8), the top code 6 in [3, 6))
#             IQ4_NL 7.62%  IQ4_XS 7.68%
MAX_REL_RMS = {
    "F32": 0.0,
    "F16": 0.00025,
    "BF16": 0.0019,
    "Q8_0": 0.0059,
    "Q6_K": 0.0196,
    "Q5_1": 0.0417,
    "Q5_K": 0.0397,
    "Q5_0": 0.047,
    "Q4_1": 0.086,
    "Q4_K": 0.0785,
    "Q4_0": 0.095,
    "Q3_K": 0.166,
    "Q2_K": 0.327,
    "MXFP4": 0.127,
    "IQ4_NL": 0.084,
    "IQ4_XS": 0.085,
}


def _gaussian(rows: int, cols: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def _decode(raw: np.ndarray, name: str) -> np.ndarray:
    """Decode with the gguf package: llama.cpp's layout reference, independent of our code."""
    return quants.dequantize(raw, get_quant(name).ggml_type)


def _rel_rms(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(np.mean((y - x) ** 2)) / np.sqrt(np.mean(x**2)))


@pytest.fixture(scope="module")
def gaussian() -> np.ndarray:
    return _gaussian(64, 4096)


@pytest.mark.parametrize("qt", WRITABLE, ids=lambda q: q.name)
def test_round_trip_error_on_gaussian_data(qt: QuantType, gaussian: np.ndarray) -> None:
    raw = quantize(gaussian, qt.ggml_type)
    assert raw.dtype == np.uint8
    err = _rel_rms(_decode(raw, qt.name), gaussian)
    assert err <= MAX_REL_RMS[qt.name], f"{qt.name}: {err:.4%}"


def test_k_quants_beat_legacy_types_of_the_same_width(gaussian: np.ndarray) -> None:
    err = {n: _rel_rms(_decode(quantize(gaussian, n), n), gaussian) for n in K_TYPES + LEGACY}
    assert err["Q4_K"] < err["Q4_1"] < err["Q4_0"]
    assert err["Q5_K"] < err["Q5_1"] < err["Q5_0"]
    assert err["Q2_K"] > err["Q3_K"] > err["Q4_K"] > err["Q5_K"] > err["Q6_K"] > err["Q8_0"]


@pytest.mark.parametrize("qt", WRITABLE, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(256,), (3, 512), (2, 2, 768)], ids=str)
def test_bytes_per_row_match_ggml_sizes(qt: QuantType, shape: tuple[int, ...]) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qt.ggml_type]
    x = _gaussian(1, int(np.prod(shape)), seed=2).reshape(shape)
    raw = quantize(x, qt.name)
    assert raw.shape == (*shape[:-1], shape[-1] // block_size * type_size)
    assert raw.shape[-1] == qt.row_bytes(shape[-1])
    assert quantize(np.zeros((0, shape[-1]), np.float32), qt.name).shape == (0, raw.shape[-1])


@pytest.mark.parametrize("name", LEGACY + ["F16", "BF16", "F32"])
def test_requantizing_decoded_values_gives_the_same_bytes(name: str) -> None:
    x = _gaussian(32, 1024, seed=3)
    raw = quantize(x, name)
    assert np.array_equal(quantize(_decode(raw, name), name), raw)


@pytest.mark.parametrize("name", K_TYPES)
def test_requantizing_decoded_values_stays_put(name: str) -> None:
    """K-quant scale searches may pick another equivalent grid, but barely move the values."""
    x = _gaussian(32, 1024, seed=3)
    y = _decode(quantize(x, name), name)
    y2 = _decode(quantize(y, name), name)
    # measured ratios: Q2_K 0.04, Q3_K 0.21, Q4_K 0, Q5_K 0.11, Q6_K 0
    assert np.sqrt(np.mean((y2 - y) ** 2)) <= 0.3 * np.sqrt(np.mean((y - x) ** 2))


@pytest.mark.parametrize("name", K_TYPES)
def test_every_sub_block_keeps_its_own_scale(name: str) -> None:
    """Sub-blocks of very different magnitude and offset: a scale, min or code stored in the wrong
    place decodes with large relative error in some sub-block."""
    rng = np.random.default_rng(4)
    sub = 16 if name in ("Q2_K", "Q3_K", "Q6_K") else 32
    x = rng.standard_normal((8, 1024)).astype(np.float32).reshape(8, -1, sub)
    n_sub = x.shape[1]
    x *= np.float32(2.0) ** (np.arange(n_sub) % 3 - 1)[None, :, None]
    x += (np.arange(n_sub) % 4 - 1.5)[None, :, None].astype(np.float32) * 0.4
    y = _decode(quantize(x.reshape(8, 1024), name), name).reshape(x.shape)
    per_sub = np.sqrt(np.mean((y - x) ** 2, axis=2)) / np.sqrt(np.mean(x**2, axis=2))
    # measured worst sub-block: ~1.7-2x the type's Gaussian bound; a field decoded into the
    # neighbouring sub-block's place gives > 4 (400%)
    assert per_sub.max() < 2.5 * MAX_REL_RMS[name], per_sub.max()


@pytest.mark.parametrize("name", K_TYPES + LEGACY)
def test_degenerate_blocks(name: str) -> None:
    x = np.zeros((4, 512), np.float32)
    x[1] = -0.75  # constant rows: exact for affine formats, nearly so for symmetric ones
    x[2, ::7] = 1e-3  # sparse
    x[3] = np.linspace(-1e-6, 1e-6, 512)  # below what fp16 scales resolve: decodes to ~0
    y = _decode(quantize(x, name), name)
    assert np.isfinite(y).all()
    assert not y[0].any()  # zeros stay exactly zero
    assert np.abs(y[1] + 0.75).max() <= 0.75 * 0.02
    assert np.abs(y[2] - x[2]).max() <= 1e-3 * 0.6
    assert np.abs(y[3]).max() <= 2e-6


@pytest.mark.parametrize("name", K_TYPES + LEGACY)
def test_weight_sized_values_quantize_as_well(name: str) -> None:
    """Trained weights are ~N(0, 0.02): the fp16 scales then sit near the subnormal range."""
    x = _gaussian(16, 4096, seed=5) * np.float32(0.02)
    assert _rel_rms(_decode(quantize(x, name), name), x) <= MAX_REL_RMS[name]


def test_quantize_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="256"):
        quantize(np.zeros((2, 100), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="32"):
        quantize(np.zeros((2, 48), np.float32), "Q8_0")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(np.full((1, 256), np.nan, np.float32), "Q6_K")


# ---- a literal scalar port of ggml-quants.c's reference K-quantizers (float32 throughout) -----

f = np.float32


def _nint(v) -> int:
    return int(np.rint(f(v)))


def _h(v) -> np.float32:  # GGML_FP32_TO_FP16 then back
    return f(np.float16(v))


def _qkx2(x, w, nmax, rmin, rdelta, nstep, use_mad):
    n, mn, mx = len(x), min(f(0), min(x)), max(x)
    sum_w, sum_x = f(0), f(0)
    for i in range(n):
        sum_w, sum_x = f(sum_w + w[i]), f(sum_x + f(w[i] * x[i]))
    if mx == mn:
        return [0] * n, f(0), f(-mn)

    def err(s, m, L):
        e = f(0)
        for i in range(n):
            d = f(f(f(s * L[i]) + m) - x[i])
            e = f(e + f(w[i] * (abs(d) if use_mad else f(d * d))))
        return e

    iscale = f(f(nmax) / f(mx - mn))
    L = [max(0, min(nmax, _nint(f(iscale * f(x[i] - mn))))) for i in range(n)]
    scale = f(f(1) / iscale)
    best = err(scale, mn, L)
    for step in range(nstep + 1):
        iscale = f(f(f(rmin) + f(f(rdelta) * step) + f(nmax)) / f(mx - mn))
        La = [max(0, min(nmax, _nint(f(iscale * f(x[i] - mn))))) for i in range(n)]
        sl = sl2 = sxl = f(0)
        for i in range(n):
            wl = f(w[i] * La[i])
            sl, sl2, sxl = f(sl + wl), f(sl2 + f(wl * La[i])), f(sxl + f(wl * x[i]))
        det = f(f(sum_w * sl2) - f(sl * sl))
        if det > 0:
            s = f(f(f(sum_w * sxl) - f(sum_x * sl)) / det)
            m = f(f(f(sl2 * sum_x) - f(sl * sxl)) / det)
            if m > 0:
                s, m = f(sxl / sl2), f(0)
            e = err(s, m, La)
            if e < best:
                L, best, scale, mn = La, e, s, m
    return L, scale, f(-mn)


def _symmetric(x, nmax, coordinate_descent):
    """make_qx_quants (rmse_type 1) or make_q3_quants (do_rmse): levels + nmax, scale."""
    n = len(x)
    vmax = x[int(np.argmax(np.abs(x)))]
    if abs(vmax) < f(1e-15):
        return [0] * n, f(0)
    w = [f(v * v) for v in x]

    def fit(iscale):
        L = [max(-nmax, min(nmax - 1, _nint(f(iscale * v)))) for v in x]
        slx = sl2 = f(0)
        for i in range(n):
            slx, sl2 = f(slx + f(f(w[i] * x[i]) * L[i])), f(sl2 + f(f(w[i] * L[i]) * L[i]))
        return L, slx, sl2

    L, slx, sl2 = fit(f(f(-nmax) / vmax))
    if coordinate_descent:
        for _ in range(5):
            changed = 0
            for i in range(n):
                a = f(slx - f(f(w[i] * x[i]) * L[i]))
                if a > 0:
                    b = f(sl2 - f(f(w[i] * L[i]) * L[i]))
                    nl = max(-nmax, min(nmax - 1, _nint(f(f(x[i] * b) / a))))
                    if nl != L[i]:
                        a, b = f(a + f(f(w[i] * x[i]) * nl)), f(b + f(f(w[i] * nl) * nl))
                        if b > 0 and f(f(a * a) * sl2) > f(f(slx * slx) * b):
                            L[i], slx, sl2, changed = nl, a, b, changed + 1
            if not changed:
                break
        return [v + nmax for v in L], (f(slx / sl2) if sl2 > 0 else f(0))
    scale = f(slx / sl2) if sl2 else f(0)
    best = f(scale * slx)
    for step in [*range(-9, 0), *range(1, 10)]:
        La, a, b = fit(f(-f(f(nmax) + f(f(0.1) * step)) / vmax))
        if b > 0 and f(a * a) > f(best * b):
            L, scale = La, f(a / b)
            best = f(scale * a)
    return [v + nmax for v in L], scale


def _ref_affine_k(x, name):
    """quantize_row_q{2,4,5}_K_ref for one super-block, decoded."""
    # sub-block size, nmax, scale-code max, rmin, nstep
    sub, nmax, q, rmin, nstep = {
        "Q2_K": (16, 3, 15, -0.5, 15),
        "Q4_K": (32, 15, 63, -1.0, 20),
        "Q5_K": (32, 31, 63, -0.5, 15),
    }[name]
    out, fits = np.zeros(256, np.float32), []
    for j in range(0, 256, sub):
        xs = [f(v) for v in x[j : j + sub]]
        if name == "Q2_K":
            w = [abs(v) for v in xs]
        else:
            av = f(np.sqrt(f(sum(f(v * v) for v in xs) / f(32))))
            w = [f(av + abs(v)) for v in xs]
        fits.append(_qkx2(xs, w, nmax, rmin, 0.1, nstep, use_mad=name == "Q2_K"))
    ms, mm = max([f(0)] + [s for _, s, _ in fits]), max([f(0)] + [m for _, _, m in fits])
    isc, imn = (f(f(q) / ms) if ms > 0 else f(0)), (f(f(q) / mm) if mm > 0 else f(0))
    d, dmin = _h(f(ms / f(q))), _h(f(mm / f(q)))
    for k, (L, s, m) in enumerate(fits):
        ls, lm = min(q, _nint(f(isc * s))), min(q, _nint(f(imn * m)))
        dl, ml = f(d * ls), f(dmin * lm)
        for i in range(sub):
            xi = f(x[k * sub + i])
            li = max(0, min(nmax, _nint(f(f(xi + ml) / dl)))) if dl else L[i]
            out[k * sub + i] = f(f(dl * li) - ml)
    return out


def _ref_symmetric_k(x, name):
    """quantize_row_q3_K_ref / quantize_row_q6_K_ref for one super-block, decoded."""
    nmax, q, qmax = (4, 32, 31) if name == "Q3_K" else (32, 128, 127)
    subs = [[f(v) for v in x[j : j + 16]] for j in range(0, 256, 16)]
    fits = [_symmetric(xs, nmax, coordinate_descent=name == "Q3_K") for xs in subs]
    vmax = fits[int(np.argmax([abs(s) for _, s in fits]))][1]
    if abs(vmax) < f(1e-15):
        return np.zeros(256, np.float32)
    iscale = f(f(-q) / vmax)
    d = _h(f(f(1) / iscale))
    out = np.zeros(256, np.float32)
    for k, (L, s) in enumerate(fits):
        dl = f(d * max(-q, min(qmax, _nint(f(iscale * s)))))
        for i in range(16):
            li = max(-nmax, min(nmax - 1, _nint(f(x[k * 16 + i] / dl)))) + nmax if dl else L[i]
            out[k * 16 + i] = f(dl * (li - nmax))
    return out


@pytest.mark.parametrize("name", K_TYPES)
def test_matches_a_literal_port_of_the_llama_cpp_reference(name: str) -> None:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[1, :32] = 0  # zero sub-blocks
    x[1, 32:64] = -0.4  # a constant negative run
    x[2] *= np.float32(1e-3)
    ref = _ref_affine_k if name in ("Q2_K", "Q4_K", "Q5_K") else _ref_symmetric_k
    expected = np.stack([ref(row, name) for row in x])
    got = _decode(quantize(x, name), name)
    # float sums in another order may flip a near-tie between two grids; nothing else may differ
    assert np.mean(got == expected) > 0.95
    assert abs(_rel_rms(got, x) - _rel_rms(expected, x)) < 0.002
