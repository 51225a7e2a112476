"""IQ4_NL and IQ4_XS quantizers: llama.cpp's quantize_row_iq4_nl_impl, without an importance
matrix (ggml-quants.c, as `llama-quantize` runs it: ntry = 7), vectorized over 32-weight groups.

For each group x (32 float32), with weights w = x^2 (what llama.cpp uses when no importance
matrix is given) and `max` the element of largest |x|:

    1. codes for d = max / 127 (the table's -127 mapped onto max), then the least-squares
       scale d = sum(w q x) / sum(w q^2) of those codes (q = TABLE[code]);
    2. 15 more trials: codes for 1/d = (t - 127) / max, t = -7 .. 7, each keeping its
       least-squares scale where it scores better (sum(w q x)^2 / sum(w q^2) larger);
    3. IQ4_NL: the fp16 of the best d, and the codes for 1/d;
       IQ4_XS: D = -(the group scale of largest |d|) / 32, stored as fp16; each group's
       l = round(d / D) clamped to -32 .. 31 (stored l + 32), codes for 1/(D l) with the float32
       D, as llama.cpp does.

A code is the table entry nearest to x/d: the count of midpoints (TABLE[i-1] + TABLE[i]) / 2
at or below x/d, compared as 2x/d against the integer sums (llama.cpp's branchless search).
Sums run over a group's elements in order (not numpy's pairwise order), as the C loop adds
them. Groups whose |x| stays below 1e-15 get a zero scale.
"""

from __future__ import annotations

import numpy as np

from .codebooks import IQ4NL_VALUES

VALUES = np.array(IQ4NL_VALUES, dtype=np.float32)
MIDPOINT_SUMS = VALUES[:-1] + VALUES[1:]  # twice the midpoints, exact integers
NTRY = 7
GROUP_MAX_EPS = np.float32(1e-15)
QK = 32
QK_K = 256


# The sums are integers, so "sum <= 2x/d" depends on floor(2x/d) alone: a table over the
# integers they span answers it (a binary search per element costs 5x more here)
_LO, _HI = int(MIDPOINT_SUMS[0]) - 1, int(MIDPOINT_SUMS[-1])
_CODE_AT = np.searchsorted(MIDPOINT_SUMS, np.arange(_LO, _HI + 1, dtype=np.float32), "right")


def best_index(scaled: np.ndarray) -> np.ndarray:
    """float32 x/d -> int64 codes of the nearest table values (ties to the larger one)."""
    at = np.clip(np.floor(scaled + scaled), _LO, _HI).astype(np.int64) - _LO
    return _CODE_AT[at]


def _ordered_sum(a: np.ndarray) -> np.ndarray:
    """(G, 32) -> (G,) float32, adding column by column as a sequential loop does."""
    total = a[:, 0].copy()
    for j in range(1, a.shape[1]):
        total += a[:, j]
    return total


def _fit(x: np.ndarray, w: np.ndarray, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sum w q x, sum w q^2) (G,) of the codes for scale 1/inv (G,)."""
    q = VALUES[best_index(inv[:, None] * x)]
    wq = w * q
    return _ordered_sum(wq * x), _ordered_sum(wq * q)


def group_scales(x: np.ndarray) -> np.ndarray:
    """(G, 32) float32 -> (G,) float32: each group's best scale d (steps 1 and 2)."""
    w = x * x
    at = np.abs(x).argmax(axis=1)
    big = x[np.arange(len(x)), at]  # the first element of largest |x|
    live = np.abs(big) >= GROUP_MAX_EPS
    big = np.where(live, big, np.float32(1))
    with np.errstate(divide="ignore", invalid="ignore"):
        sumqx, sumq2 = _fit(x, w, np.float32(1) / (-big / VALUES[0]))
        d = np.where(sumq2 > 0, sumqx / sumq2, np.float32(0)).astype(np.float32)
        best = d * sumqx
        for t in range(-NTRY, NTRY + 1):
            sumqx, sumq2 = _fit(x, w, (np.float32(t) + VALUES[0]) / big)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d)
            best = np.where(better, d * sumqx, best)
    return np.where(live, d, np.float32(0)).astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)


def _pack_codes(codes: np.ndarray) -> np.ndarray:
    """(G, 32) codes -> (G, 16) bytes: element j in the low nibble of byte j, j + 16 high."""
    codes = codes.astype(np.uint8)
    return codes[:, :16] | (codes[:, 16:] << 4)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """float32 (..., n) -> uint8 (G, 18) IQ4_NL blocks (G = size / 32)."""
    groups = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK)
    d = group_scales(groups)
    codes = best_index(_inverse(d)[:, None] * groups)
    dh = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return np.concatenate([dh, _pack_codes(codes)], axis=1)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """float32 (..., n) -> uint8 (S, 136) IQ4_XS super-blocks (S = size / 256)."""
    groups = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK)
    scales = group_scales(groups).reshape(-1, QK_K // QK)  # (S, 8)
    pick = np.abs(scales).argmax(axis=1)
    big = scales[np.arange(len(scales)), pick]  # the first group scale of largest |d|
    d = (-big / np.float32(32)).astype(np.float32)
    levels = np.clip(np.rint(_inverse(d)[:, None] * scales), -32, 31)
    dl = (d[:, None] * levels).astype(np.float32).reshape(-1)
    codes = best_index(_inverse(dl)[:, None] * groups)
    return _pack_iq4_xs(d, levels.astype(np.int64) + 32, codes)


def _pack_iq4_xs(d: np.ndarray, ls: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """fp16 d | u16 scales_h (2 high bits of ls_g at 2g) | scales_l[4] (low nibbles) | qs."""
    n = len(d)
    out = np.empty((n, 136), dtype=np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    high = ((ls >> 4) << (2 * np.arange(8))).sum(axis=1).astype(np.uint16)
    out[:, 2:4] = high.view(np.uint8).reshape(n, 2)
    low = (ls & 0xF).astype(np.uint8)
    out[:, 4:8] = low[:, 0::2] | (low[:, 1::2] << 4)
    out[:, 8:136] = _pack_codes(codes).reshape(n, 128)
    return out
