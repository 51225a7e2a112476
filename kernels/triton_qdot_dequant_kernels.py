"""Triton kernel: the CPU's qdot packing (kernels/cpu_qdot.py) read on a GPU, as dense rows.

Wrapper and the layout: `hetero.kernels.triton_qdot_dequant`. A program decodes units (16 rows x
one GGUF block along K) of one row group: the packing's word fields load as [16 rows, words]
int32 tiles (word w of row r at field + (16 w + r) * 4 bytes), its fp16 fields as [16] halves,
its byte fields (the K-quants' scales) byte by byte. Every value is the reference's float32
(hetero.quant.dequantize): A q exact in float32 (at most 11 + 8 + 6 significant bits), one
rounding where a min is subtracted or added, then rounded to the output's dtype.

Imported on first use (imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

# the types this kernel decodes (GGML type numbers), as TYPE
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14


@triton.jit
def _half(h16_ptr, at, r):
    """The fp16 field at byte `at` of the unit, row r: float32 [16]."""
    return tl.load(h16_ptr + at // 2 + r).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _bytes2(words):
    """int32 words [R, W] -> their bytes [R, 4 W] (uint8 values in int32, low byte first)."""
    b = (words[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 255
    return tl.reshape(b, [words.shape[0], words.shape[1] * 4])


@triton.jit
def _bytes3(words):
    """int32 words [R, A, W] -> their bytes [R, A, 4 W]."""
    b = (words[:, :, :, None] >> (tl.arange(0, 4) * 8)[None, None, None, :]) & 255
    return tl.reshape(b, [words.shape[0], words.shape[1], words.shape[2] * 4])


@triton.jit
def _words(w32_ptr, at, r, NW: tl.constexpr):
    """[16, NW] int32: the word field at byte `at` of the unit (word w of row r at w * 16 + r)."""
    return tl.load(w32_ptr + at // 4 + tl.arange(0, NW)[None, :] * 16 + r[:, None])


@triton.jit
def _k4_scale_min(u8_ptr, at, r, s):
    """(sc, m) [16, S] int32 of sub-blocks s [S] from the 12 scale bytes at byte `at` (byte j
    of row r at j * 16 + r): llama.cpp's get_scale_min_k4."""
    low = s < 4
    base = u8_ptr + at + r[:, None]
    c = tl.load(base + s[None, :] * 16).to(tl.int32)  # byte s
    a = tl.load(base + (s[None, :] + 4) * 16).to(tl.int32)  # byte s + 4
    e = tl.load(base + tl.where(low, 0, s - 4)[None, :] * 16).to(tl.int32)  # byte s - 4
    lo = low[None, :]
    sc = tl.where(lo, c & 63, (a & 15) | ((e >> 6) << 4))
    m = tl.where(lo, a & 63, (a >> 4) | ((c >> 6) << 4))
    return sc, m


@triton.jit
def _store2(out_ptr, rows, rmask, out_stride, cols, v):
    """v [16, C] at out[rows, cols [C]]."""
    ptr = out_ptr + (rows.to(tl.int64) * out_stride)[:, None] + cols[None, :]
    tl.store(ptr, v.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _store3(out_ptr, rows, rmask, out_stride, cols, v):
    """v [16, A, C] at out[rows, cols [A, C]]."""
    ptr = out_ptr + (rows.to(tl.int64) * out_stride)[:, None, None] + cols[None, :, :]
    tl.store(ptr, v.to(out_ptr.dtype.element_ty), mask=rmask[:, None, None])


@triton.jit
def _legacy_unit(u8_ptr, h16_ptr, w32_ptr, unit, r, TYPE: tl.constexpr):
    """[16, 32] float32: a 32-block's weights (Q4_0 .. Q8_0), element order."""
    d = _half(h16_ptr, unit, r)[:, None]
    l = tl.arange(0, 16)[None, :]
    if TYPE == 8:  # Q8_0: d, then 32 int8 codes (8 words)
        b = _bytes2(_words(w32_ptr, unit + 32, r, 8))
        q = ((b << 24) >> 24).to(tl.float32)  # signed bytes
        return d * q
    if TYPE == 2 or TYPE == 6:  # Q4_0 / Q5_0: d [, qh], 16 code bytes
        at = unit + 32
    else:  # Q4_1 / Q5_1: d, m [, qh], codes
        at = unit + 64
    if TYPE == 6 or TYPE == 7:
        qh = tl.load(w32_ptr + at // 4 + r)[:, None]  # one 32-bit word: bit j = element j
        at += 64
    b = _bytes2(_words(w32_ptr, at, r, 4))  # [16, 16]: element l low nibble, l + 16 high
    lo = b & 15
    hi = b >> 4
    if TYPE == 6 or TYPE == 7:
        lo = lo | (((qh >> l) & 1) << 4)
        hi = hi | (((qh >> (l + 16)) & 1) << 4)
    if TYPE == 2:
        lo, hi = lo - 8, hi - 8
    if TYPE == 6:
        lo, hi = lo - 16, hi - 16
    if TYPE == 3 or TYPE == 7:
        m = _half(h16_ptr, unit + 32, r)[:, None]
        v_lo = d * lo.to(tl.float32) + m
        v_hi = d * hi.to(tl.float32) + m
    else:
        v_lo = d * lo.to(tl.float32)
        v_hi = d * hi.to(tl.float32)
    return tl.reshape(tl.permute(tl.join(v_lo, v_hi), [0, 2, 1]), [16, 32])


@triton.jit(do_not_specialize=["N", "U", "out_stride", "g0"])
def qdot_dequant_kernel(
    out_ptr, u8_ptr, h16_ptr, w32_ptr, N, U, out_stride, g0,
    TYPE: tl.constexpr, UNIT: tl.constexpr, UB: tl.constexpr,
):  # fmt: skip
    """Grid (row groups, ceil(U / UB)): out[16 (g0 + gi) + r - 16 g0, K cols] = W of rows
    [16 g0, ...) in out's dtype, U units (blocks) a row, UNIT bytes a unit. The three pointers
    are views of the same packed bytes (uint8, int16 and int32). Row n of group g is out's row
    16 (g - g0) + r; rows at or past N (the packing's zero padding) are not written."""
    gi = tl.program_id(0)
    g = g0 + gi
    r = tl.arange(0, 16)
    rows = gi * 16 + r
    rmask = g * 16 + r < N
    for ub in tl.static_range(UB):
        u = tl.program_id(1) * UB + ub
        if u < U:
            unit = (g.to(tl.int64) * U + u) * UNIT
            if TYPE == 12 or TYPE == 13:  # Q4_K / Q5_K: d, dmin, 12 scale bytes [, qh], qs
                d = _half(h16_ptr, unit, r)
                dmin = _half(h16_ptr, unit + 32, r)
                sub = tl.arange(0, 4)  # 64-element chunks; sub-blocks 2 c (low nibbles), 2 c + 1
                sc0, m0 = _k4_scale_min(u8_ptr, unit + 64, r, 2 * sub)
                sc1, m1 = _k4_scale_min(u8_ptr, unit + 64, r, 2 * sub + 1)
                at = unit + 256
                if TYPE == 13:
                    qh = _bytes2(_words(w32_ptr, at, r, 8))  # [16, 32]: qh[l]
                    at += 512
                w = tl.load(  # [16, 4 chunks, 8 words]: qs[32 c + l], l = 4 word + byte
                    w32_ptr + at // 4 + (tl.arange(0, 4)[:, None] * 8
                                         + tl.arange(0, 8)[None, :])[None, :, :] * 16
                    + r[:, None, None]
                )  # fmt: skip
                b = _bytes3(w)  # [16, 4, 32]
                lo = b & 15
                hi = b >> 4
                if TYPE == 13:
                    sh = (2 * sub)[None, :, None]
                    lo = lo | (((qh[:, None, :] >> sh) & 1) << 4)
                    hi = hi | (((qh[:, None, :] >> (sh + 1)) & 1) << 4)
                a0 = (d[:, None] * sc0.to(tl.float32))[:, :, None]
                a1 = (d[:, None] * sc1.to(tl.float32))[:, :, None]
                b0 = (dmin[:, None] * m0.to(tl.float32))[:, :, None]
                b1 = (dmin[:, None] * m1.to(tl.float32))[:, :, None]
                cols = u * 256 + sub[:, None] * 64 + tl.arange(0, 32)[None, :]
                _store3(out_ptr, rows, rmask, out_stride, cols, a0 * lo.to(tl.float32) - b0)
                _store3(out_ptr, rows, rmask, out_stride, cols + 32, a1 * hi.to(tl.float32) - b1)
            elif TYPE == 14:  # Q6_K: d, 16 int8 scales, then ql and qh (reordered: _q6k_words)
                d = _half(h16_ptr, unit, r)[:, None, None]
                h = tl.arange(0, 2)
                l = tl.arange(0, 32)
                wq = tl.arange(0, 8)
                # ql word of (half h, part p, word w): 16 h + 8 p + w; qh word: 32 + 8 h + w
                qh = _bytes3(_q6k_words(w32_ptr, unit, r, (32 + 8 * h)[:, None] + wq[None, :]))
                for k in tl.static_range(4):
                    v = (16 * h + 8 * (k % 2))[:, None] + wq[None, :]
                    ql = _bytes3(_q6k_words(w32_ptr, unit, r, v))
                    q = ((ql >> (4 * (k // 2))) & 15) | (((qh >> (2 * k)) & 3) << 4)
                    si = (8 * h + 2 * k)[:, None] + (l // 16)[None, :]  # [2, 32]
                    sc = tl.load(u8_ptr + unit + 32 + si[None, :, :] * 16 + r[:, None, None])
                    a = d * sc.to(tl.int8, bitcast=True).to(tl.float32)
                    cols = u * 256 + (128 * h + 32 * k)[:, None] + l[None, :]
                    _store3(out_ptr, rows, rmask, out_stride, cols, a * (q - 32).to(tl.float32))
            else:  # the 32-blocks
                v = _legacy_unit(u8_ptr, h16_ptr, w32_ptr, unit, r, TYPE)
                _store2(out_ptr, rows, rmask, out_stride, u * 32 + tl.arange(0, 32), v)


@triton.jit
def _q6k_words(w32_ptr, unit, r, v):
    """[16, *v.shape] int32: Q6_K's code words v (0-31 ql, 32-47 qh, in field order) of the
    unit's 16 rows, where the packing put them: vector v at position Q6K_POS(v) after the
    288-byte head, 64 bytes a vector (kernels/cpu_qdot.py Q6K_ORDER). Position of v: its half
    h = v in 0-15 or 32-39 -> 0, else 1; within a half's 24 vectors, ql words q in 0-7 of the
    half's first 8 at 2 q, the qh word q at 2 q + 1, the half's ql words 8-15 at 16 + q."""
    hq = tl.where(v < 32, v // 16, (v - 32) // 8)
    q = tl.where(v < 32, v % 16, (v - 32) % 8)
    pos = tl.where(v < 32, tl.where(q < 8, 2 * q, 8 + q), 2 * q + 1) + 24 * hq
    return tl.load(w32_ptr + (unit + 288) // 4 + pos[None, :, :] * 16 + r[:, None, None])
