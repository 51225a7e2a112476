"""K-quant quantizers (numpy): llama.cpp's reference `quantize_row_q*_K_ref`, vectorized.

Per super-block of 256 values: fit every sub-block (kquant_search), quantize the sub-block scales
(and mins) against one fp16 super-scale, re-round every value against the scale it will actually
be decoded with, then pack the bits in the layouts drawn in `kquants.py` (which `gguf` decodes).
Work is split into chunks of super-blocks that fit in cache and spread over the CPU cores
(numpy releases the GIL inside its loops).

Each `quantize_q*_k` maps float32 (..., n) with n % 256 == 0 to uint8 (..., n // 256 * type_size).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .kquant_search import GROUP_MAX_EPS, make_q3_quants, make_qkx2_quants, make_qx_quants

QK_K = 256
_CHUNK = 2048  # super-blocks per work item: 2 MiB of float32, so the passes stay in cache
_F32 = np.float32


def _chunked(kernel: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """Apply a (N, 256) float32 -> (N, type_size) uint8 kernel over all super-blocks of x."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise ValueError(f"K-quant rows must hold a multiple of {QK_K} values, got {x.shape}")
    blocks = x.reshape(-1, QK_K)
    starts = range(0, blocks.shape[0], _CHUNK)
    parts: list[np.ndarray]
    workers = min(len(starts), os.cpu_count() or 1)
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(lambda s: kernel(blocks[s : s + _CHUNK]), starts))
    else:
        parts = [kernel(blocks[s : s + _CHUNK]) for s in starts]
    out = np.concatenate(parts) if parts else np.empty((0, 0), np.uint8)
    return out.reshape(*x.shape[:-1], -1)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """(N,) float -> (N, 2) uint8 little-endian fp16 (round to nearest even)."""
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _round_to(x: np.ndarray, d: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """clip(round(x / d), lo, hi) per sub-block: x (N, S, n), d (N, S)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.clip(np.rint(x / d[..., None]), lo, hi)


def _pack_crumbs(q: np.ndarray) -> np.ndarray:
    """(N, 256) 2-bit codes -> (N, 64): byte 32h + l holds x[128h + 32k + l] at bit 2k."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(N, 256) 4-bit codes -> (N, 128): byte 32c + l holds x[64c + l] low, x[64c + 32 + l] high."""
    q = q.reshape(-1, 4, 2, 32).astype(np.uint8)
    return (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)


def _pack_bit_planes(bits: np.ndarray) -> np.ndarray:
    """(N, 256) 0/1 -> (N, 32): bit b of byte l is x[32b + l]."""
    planes = bits.reshape(-1, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]
    return np.bitwise_or.reduce(planes, axis=1)


# ---- Q2_K ---------------------------------------------------------------------------------------


def _q2_k_blocks(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n * 16, 16)
    levels, scales, mins = make_qkx2_quants(sub, np.abs(sub), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins = scales.reshape(n, 16), mins.reshape(n, 16)
    # 4-bit scale and min codes against the largest of each (zero when nothing is positive)
    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(max_scale[:, None] > 0, np.rint(_F32(15) / max_scale[:, None] * scales), 0)
        mc = np.where(max_min[:, None] > 0, np.rint(_F32(15) / max_min[:, None] * mins), 0)
    sc, mc = np.clip(sc, 0, 15).astype(np.uint8), np.clip(mc, 0, 15).astype(np.uint8)
    d = (max_scale / _F32(15)).astype(np.float16)
    dmin = (max_min / _F32(15)).astype(np.float16)
    # re-round against the decoded scales; sub-blocks whose scale decodes to 0 keep their levels
    dl = d.astype(np.float32)[:, None] * sc
    ml = dmin.astype(np.float32)[:, None] * mc
    q = _round_to(x.reshape(n, 16, 16) + ml[..., None], dl, 0, 3)
    q = np.where(dl[..., None] != 0, q, levels.reshape(n, 16, 16)).reshape(n, QK_K)
    return np.concatenate([sc | mc << 4, _pack_crumbs(q), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    return _chunked(_q2_k_blocks, x)


# ---- Q3_K ---------------------------------------------------------------------------------------


def _pack_q3_scales(codes: np.ndarray) -> np.ndarray:
    """(N, 16) 6-bit codes -> the 12 scale bytes drawn in kquants.py."""
    low = (codes[:, 0:8] & 0x0F) | (codes[:, 8:16] & 0x0F) << 4
    high = (codes >> 4).reshape(-1, 4, 4) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    return np.concatenate([low, np.bitwise_or.reduce(high, axis=1)], axis=1)


def _q3_k_blocks(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    levels, scales = make_q3_quants(x.reshape(n * 16, 16), 4)
    scales = scales.reshape(n, 16)
    idx = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(n), idx]  # signed, largest magnitude
    nonzero = max_scale != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(nonzero, _F32(-32) / max_scale, _F32(0))
        d = np.where(nonzero, _F32(1) / iscale, _F32(0)).astype(np.float16)
    codes = np.clip(np.rint(iscale[:, None] * scales), -32, 31) + 32
    codes = np.where(nonzero[:, None], codes, 0).astype(np.uint8)
    dl = d.astype(np.float32)[:, None] * (codes.astype(np.float32) - 32)
    q = _round_to(x.reshape(n, 16, 16), dl, -4, 3) + 4
    q = np.where(dl[..., None] != 0, q, levels.reshape(n, 16, 16)).reshape(n, QK_K)
    q = q.astype(np.uint8)
    return np.concatenate(
        [_pack_bit_planes(q >> 2), _pack_crumbs(q & 3), _pack_q3_scales(codes), _f16_bytes(d)],
        axis=1,
    )


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    return _chunked(_q3_k_blocks, x)


# ---- Q4_K and Q5_K ------------------------------------------------------------------------------


def _k4_fit(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Shared Q4_K/Q5_K fit: levels (N, 256) in 0..nmax and the 12 scale bytes, d, dmin."""
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    av_x = np.sqrt(np.einsum("ij,ij->i", sub, sub) / _F32(32))
    w = av_x[:, None] + np.abs(sub)  # weights favour large values, floored by the RMS
    levels, scales, mins = make_qkx2_quants(sub, w, nmax, rmin, 0.1, nstep, use_mad=False)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))
        inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))
    ls = np.clip(np.rint(inv_scale[:, None] * scales), 0, 63).astype(np.uint8)
    lm = np.clip(np.rint(inv_min[:, None] * mins), 0, 63).astype(np.uint8)
    d = (max_scale / _F32(63)).astype(np.float16)
    dmin = (max_min / _F32(63)).astype(np.float16)
    dl = d.astype(np.float32)[:, None] * ls
    ml = dmin.astype(np.float32)[:, None] * lm
    q = _round_to(x.reshape(n, 8, 32) + ml[..., None], dl, 0, nmax)
    q = np.where(dl[..., None] != 0, q, levels.reshape(n, 8, 32)).reshape(n, QK_K)
    packed = np.concatenate(
        [
            ls[:, 0:4] | (ls[:, 4:8] >> 4) << 6,
            lm[:, 0:4] | (lm[:, 4:8] >> 4) << 6,
            (ls[:, 4:8] & 0x0F) | (lm[:, 4:8] & 0x0F) << 4,
        ],
        axis=1,
    )
    return q.astype(np.uint8), packed, d, dmin


def _q4_k_blocks(x: np.ndarray) -> np.ndarray:
    q, scales, d, dmin = _k4_fit(x, 15, -1.0, 20)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, _pack_nibbles(q)], axis=1)


def _q5_k_blocks(x: np.ndarray) -> np.ndarray:
    q, scales, d, dmin = _k4_fit(x, 31, -0.5, 15)
    qh = _pack_bit_planes(q >> 4)
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), scales, qh, _pack_nibbles(q & 0x0F)], axis=1
    )


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    return _chunked(_q4_k_blocks, x)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    return _chunked(_q5_k_blocks, x)


# ---- Q6_K ---------------------------------------------------------------------------------------


def _pack_q6(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, 256) 6-bit codes -> ql (N, 128), qh (N, 64) as drawn in kquants.py."""
    q = q.reshape(-1, 2, 4, 32)  # [h, k, l] is element 128h + 32k + l
    lo = q & 0x0F
    ql = lo[:, :, 0:2] | lo[:, :, 2:4] << 4  # [h, k%2, l]: nibble k//2
    hi = (q >> 4) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    qh = np.bitwise_or.reduce(hi, axis=2)
    return ql.reshape(-1, 128), qh.reshape(-1, 64)


def _q6_k_blocks(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    levels, scales = make_qx_quants(x.reshape(n * 16, 16), 32)
    scales = scales.reshape(n, 16)
    idx = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(n), idx]
    zero = np.abs(max_scale) < GROUP_MAX_EPS  # the whole super-block encodes as zeros
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, _F32(0), _F32(-128) / np.where(zero, _F32(1), max_scale))
        d = np.where(zero, _F32(0), _F32(1) / iscale).astype(np.float16)
    codes = np.minimum(np.rint(iscale[:, None] * scales), 127).astype(np.int8)
    dl = d.astype(np.float32)[:, None] * codes
    q = _round_to(x.reshape(n, 16, 16), dl, -32, 31) + 32
    q = np.where(dl[..., None] != 0, q, levels.reshape(n, 16, 16)).reshape(n, QK_K)
    q = np.where(zero[:, None], 0, q).astype(np.uint8)
    ql, qh = _pack_q6(q)
    return np.concatenate([ql, qh, codes.view(np.uint8), _f16_bytes(d)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    return _chunked(_q6_k_blocks, x)
