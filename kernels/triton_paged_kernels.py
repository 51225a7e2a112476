"""Triton kernels of the paged KV cache: the fused KV write and paged attention (decode, prefill).

Imported on first use only (it imports triton); the wrappers and registrations are in
kernels/triton_paged.py. Cache layout as kernels/paged.py draws it: k/v [num_slots, KV, D], slot =
block * BS + offset, fp8 scales [num_slots, KV] float32.

FP8 e4m3 is stored and loaded as uint8 bits, so the same kernels run on sm_80 (no fp8 type),
sm_89+ and under the interpreter. The attention decodes a tile's codes by the conversion
instruction where the GPU has one (HW: sm_89+, `cvt.rn.f16x2.e4m3x2`), else with integers; the
write encodes with integers (bit for bit torch's rounding):

    e4m3fn   s eeee mmm        bias 7, no inf, 0x7f/0xff NaN, subnormals m/8 * 2^-6
    decode   s -> bit 15, eeee mmm -> bits 13..7 of a float16, times 2^(15-7): exact, subnormals
             included (an e4m3 subnormal lands on a float16 subnormal of the same value); the
             2^8 joins the row's scale, applied to the scores and probabilities (`_kv_tile`).
    encode   round to nearest even as torch's .to(float8_e4m3fn): normals from the float32 bits
             (add 0x7ffff + lsb, shift out 20 mantissa bits, rebias the exponent: a carry rolls
             into the exponent), subnormals (|v| < 2^-6) by rounding |v| * 2^9 to an integer
             (RNE through the 2^23 magic number: exact, the product is a power-of-two scaling).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_fused_kernels import _rotate_head
from hetero.kernels.triton_pdl import pdl_wait

FP8_MAX = tl.constexpr(448.0)  # a global a jitted kernel reads must be constexpr


def tile_dtype(q_dtype, fp8: bool):
    """The attention kernels' DT (`_kv_tile`): the dtype their K / V tiles take for the dots,
    float32 for float32 q, float16 for fp8 codes, else q's own."""
    import torch

    if q_dtype == torch.float32:
        return tl.float32
    return tl.float16 if fp8 or q_dtype == torch.float16 else tl.bfloat16


@triton.jit
def fp8_encode(v):
    """float32 values with |v| <= 448 -> uint8 e4m3fn bits, rounded to nearest even."""
    a = tl.abs(v)
    sign = tl.where(v < 0, 0x80, 0)
    ab = a.to(tl.int32, bitcast=True)
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    code = tl.minimum(code, 0x7E)  # 448 at most (the scale keeps |v| <= 448 up to rounding)
    return (code | sign).to(tl.uint8)


@triton.jit
def _kv_write_one(
    src, cache, scale_ptr, t, h, slot, stride_t, stride_h,
    KV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    d = tl.arange(0, BD)
    dm = d < D
    x = tl.load(src + t * stride_t + h * stride_h + d, mask=dm, other=0.0).to(tl.float32)
    dst = cache + (slot * KV + h) * D + d
    if FP8:
        s = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / FP8_MAX
        tl.store(dst, fp8_encode(tl.math.div_rn(x, s)), mask=dm)
        tl.store(scale_ptr + slot * KV + h, s)
    else:
        tl.store(dst, x.to(cache.dtype.element_ty), mask=dm)


@triton.jit
def kv_write_kernel(
    k, v, k_cache, v_cache, k_scale, v_scale, slots,
    sk_t, sk_h, sv_t, sv_h,
    KV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, KV): quantize token t's head h of k and v and store it at slots[t] (< 0: skip,
    the padding rows of a CUDA-graph batch)."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        _kv_write_one(k, k_cache, k_scale, t, h, slot, sk_t, sk_h, KV, D, BD, FP8)
        _kv_write_one(v, v_cache, v_scale, t, h, slot, sv_t, sv_h, KV, D, BD, FP8)


@triton.jit
def rope_kv_write_kernel(
    q, k, v, cos, sin, qo, ko, k_cache, v_cache, k_scale, v_scale, slots,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc, H, R,
    KV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, NEOX: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, H + KV): head j < H of q rotated into qo [T, H, D], or KV head j - H: k's
    rotated into ko [T, KV, D] (rounded to its dtype, as the rope kernel stores it), then
    it and v quantized and stored at slots[t] (< 0: skipped) as kv_write_kernel does. The
    rope kernel's and the KV write's work in one launch, bit for bit theirs."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cs, sn = cos + t * sc, sin + t * sc
    if j < H:
        _rotate_head(q + t * sq_t + j * sq_h, qo + (t * H + j) * D, cs, sn, R, D, BD, BR, NEOX)
    else:
        _store_new_kv(
            k, v, cs, sn, ko, k_cache, v_cache, k_scale, v_scale, slots, t, j - H, sk_t, sk_h,
            sv_t, sv_h, R, KV, D, BD, BR, NEOX, FP8,
        )  # fmt: skip


@triton.jit
def _store_new_kv(
    k, v, cs, sn, ko, k_cache, v_cache, k_scale, v_scale, slots, t, h, sk_t, sk_h, sv_t, sv_h, R,
    KV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, NEOX: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """Token t's KV head h: k rotated into ko [T, KV, D] (rounded to its dtype, as the rope
    kernel stores it), read back by every thread, then it and v quantized and stored at
    slots[t] (< 0: skipped) as kv_write_kernel does."""
    dst = ko + (t * KV + h) * D
    _rotate_head(k + t * sk_t + h * sk_h, dst, cs, sn, R, D, BD, BR, NEOX)
    tl.debug_barrier()  # the rotated row, stored by all threads, read back by all
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        _kv_write_one(ko, k_cache, k_scale, t, h, slot, KV * D, D, KV, D, BD, FP8)
        _kv_write_one(v, v_cache, v_scale, t, h, slot, sv_t, sv_h, KV, D, BD, FP8)


@triton.jit
def _kv_tile(
    cache, scale_ptr, slot, h, pm,
    KV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, FP8: tl.constexpr, HW: tl.constexpr,
    DT: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Rows `slot` [BN] of head h as (tile [BN, BD] of DT, scale [BN] float32): the rows' values
    are tile * scale[:, None] (masked rows and dims are 0; scale 1 without fp8). An fp8 tile's
    codes decode by the conversion instruction (HW, sm_89+) or as float16 bits from integer
    operations, which hold the value / 256. Unscaled (the decode kernel: its scales applied to
    the tile's scores and probabilities, [G, BN] products, where they were [BN, D] products),
    a tile is its codes' values, exact in float16 (the integer path's 256 joins the scale);
    SCALED (the prefill kernels, whose [M, BN] products outnumber the tile's): the values
    themselves, rounded to DT once, and a scale of 1."""
    d = tl.arange(0, BD)
    m = pm[:, None] & (d[None, :] < D)
    x = tl.load(cache + (slot[:, None] * KV + h) * D + d[None, :], mask=m, other=0)
    one = tl.where(pm, 1.0, 0.0)
    if FP8:
        s = tl.load(scale_ptr + slot * KV + h, mask=pm, other=0.0)
        if HW:
            f = x.to(tl.float8e4nv, bitcast=True)
        else:
            u = x.to(tl.int32)
            f = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
            s = s * 256.0
        if SCALED:
            return (f.to(tl.float32) * s[:, None]).to(DT), one
        return f.to(DT), s
    return x.to(DT), one


@triton.jit
def _q_operand(qv, FP8: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr):
    """(q as the dots' operand, its row scale [M] float32). Against unscaled fp8 tiles (float16)
    the rows of a 16-bit q go to float16 divided by a power of two at most their largest |q|
    (exact for bf16 values within 2^-24 of it: float16's range does not hold bf16's); float32
    q (IEEE), scaled tiles and the 16-bit caches' tiles take q as it is."""
    qs = tl.full([qv.shape[0]], 1.0, tl.float32)
    if FP8 and not SCALED:
        if not IEEE:
            qf = qv.to(tl.float32)
            big = tl.max(tl.abs(qf), axis=1)
            p2 = (big.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
            qs = tl.where(p2 > 0, p2, 1.0)  # a row of zeros (padding) or subnormals: as it is
            qv = (qf * (1.0 / qs)[:, None]).to(tl.float16)
    return qv, qs


@triton.jit
def _slots(block_tables, b, stride_bt, pos, pm, BS: tl.constexpr):
    blk = tl.load(block_tables + b * stride_bt + pos // BS, mask=pm, other=0).to(tl.int64)
    return blk * BS + pos % BS


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _online_softmax(
    qv, qs, kt, ks, vt, vs, keep, scale, m_i, l_i, acc, IEEE: tl.constexpr, SCALED: tl.constexpr
):  # fmt: skip
    """One key tile of flash attention: q [M, BD] with its row scales qs [M] (`_q_operand`),
    k/v [BN, BD] with their row scales ks / vs [BN] (`_kv_tile`), keep [M, BN]; running max
    m_i [M], sum l_i [M] and unnormalized output acc [M, BD] in float32, updated. A row that
    has kept no key yet (a sliding window starts past the tile) keeps m_i = -inf, l_i = 0.
    Unscaled tiles: the probabilities meet V's scales before the dot, divided by the tile's
    largest (so they stay in [0, 1], V's dtype holding them), which multiplies the product.
    SCALED (every scale 1): the plain step, in fewer registers."""
    if SCALED:
        sc = _dot(qv, tl.trans(kt), IEEE) * scale  # [M, BN]
    else:
        sc = _dot(qv, tl.trans(kt), IEEE) * (qs * scale)[:, None] * ks[None, :]
    sc = tl.where(keep, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(-inf - 0) = 0, never NaN
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(sc - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SCALED:
        acc = acc * alpha[:, None] + _dot(p.to(qv.dtype), vt, IEEE)
    else:
        vmax = tl.max(vs, axis=0)
        pv = p * (vs * tl.where(vmax > 0, 1.0 / vmax, 0.0))[None, :]
        acc = acc * alpha[:, None] + _dot(pv.to(vt.dtype), vt, IEEE) * vmax
    return m_new, l_i, acc


@triton.jit
def _window_start(first_limit, window, BN: tl.constexpr):
    """The first key tile (a multiple of BN) rows whose limits are >= first_limit need under a
    sliding window (window 0: the whole context, tile 0)."""
    return tl.where(window > 0, tl.maximum(first_limit - window, 0) // BN * BN, 0)


@triton.jit
def _keys(
    qv, k_cache, v_cache, k_scale, v_scale, block_tables, b, stride_bt, h, lo, hi, limit, first,
    scale,
    KV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    FP8: tl.constexpr, HW: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
    SCALED: tl.constexpr,
):  # fmt: skip
    """Flash attention's (m, l, acc) [M], [M], [M, BD] of query rows qv [M, BD] over keys
    lo .. hi - 1 of sequence b's pages (KV head h), row i seeing keys first[i] .. limit[i] - 1.
    SCALED: the tiles scaled themselves (`_kv_tile`)."""
    m_i = tl.full([qv.shape[0]], float("-inf"), tl.float32)
    l_i = tl.zeros([qv.shape[0]], tl.float32)
    acc = tl.zeros([qv.shape[0], BD], tl.float32)
    qv, qs = _q_operand(qv, FP8, IEEE, SCALED)
    for n0 in range(lo, hi, BN):
        pos = n0 + tl.arange(0, BN)
        pm = pos < hi
        slot = _slots(block_tables, b, stride_bt, pos, pm, BS)
        kt, ks = _kv_tile(k_cache, k_scale, slot, h, pm, KV, D, BD, FP8, HW, DT, SCALED)
        vt, vs = _kv_tile(v_cache, v_scale, slot, h, pm, KV, D, BD, FP8, HW, DT, SCALED)
        keep = pm[None, :] & (pos[None, :] < limit[:, None]) & (pos[None, :] >= first[:, None])
        m_i, l_i, acc = _online_softmax(
            qv, qs, kt, ks, vt, vs, keep, scale, m_i, l_i, acc, IEEE, SCALED
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _attend(
    qv, k_cache, v_cache, k_scale, v_scale, block_tables, b, stride_bt, h, lo, hi, limit,
    window, sink, scale,
    KV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    FP8: tl.constexpr, HW: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
    SINKS: tl.constexpr,
):  # fmt: skip
    """softmax(q K^T) V [M, BD] of query rows qv [M, BD] over keys lo .. hi - 1 of sequence b's
    pages (KV head h), row i seeing the keys below limit[i] (causal: its position + 1) and, with
    window > 0, from limit[i] - window on. SINKS: sink [M] joins each row's softmax without a
    value (kernels/paged_sinks.py). A row that sees no key gives 0."""
    first = tl.where(window > 0, limit - window, -1)  # [M]: keys below it are out of the window
    m_i, l_i, acc = _keys(
        qv, k_cache, v_cache, k_scale, v_scale, block_tables, b, stride_bt, h, lo, hi, limit,
        first, scale, KV, D, BD, BS, BN, FP8, HW, DT, IEEE, True,
    )  # fmt: skip
    return _normalize(m_i, l_i, acc, sink, SINKS)


@triton.jit
def _normalize(m_i, l_i, acc, sink, SINKS: tl.constexpr):
    """acc / l [M, BD]: the softmax's output; SINKS: exp(sink - m_i) joins the sum (a row
    without keys: exp(+inf) -> 0 output, as without a sink)."""
    if SINKS:
        l_i = l_i + tl.exp(sink - m_i)
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def _sink_of(sinks, hq, BM: tl.constexpr, SINKS: tl.constexpr):
    """Head hq's sink logit for BM query rows (float32 [BM]; zeros, unused, without sinks)."""
    if SINKS:
        return tl.zeros([BM], tl.float32) + tl.load(sinks + hq).to(tl.float32)
    return tl.zeros([BM], tl.float32)


@triton.jit
def prefill_kernel(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, q_starts, out,
    scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, window, sinks,
    KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr, HW: tl.constexpr,
    DT: tl.constexpr, IEEE: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """Grid (query tiles, B, H): causal attention of a sequence's new queries (the last q_len of
    its seq_len positions: a cached prefix, then the new tokens, already written) over its pages.
    Query row i sits at position seq_len - q_len + i and sees keys 0 .. that position."""
    mt = tl.program_id(0)
    b = tl.program_id(1)
    hq = tl.program_id(2)
    h = hq // G
    q0 = tl.load(q_starts + b)
    q_len = tl.load(q_starts + b + 1) - q0
    length = tl.load(seq_lens + b)
    first = length - q_len
    rows = mt * BM + tl.arange(0, BM)
    rm = rows < q_len
    d = tl.arange(0, BD)
    qm = rm[:, None] & (d[None, :] < D)
    tok = (q0 + rows).to(tl.int64)
    qv = tl.load(q + tok[:, None] * stride_qt + hq * stride_qh + d[None, :], mask=qm, other=0.0)
    pos_q = first + rows
    hi = tl.where(mt * BM < q_len, tl.minimum(length, first + (mt + 1) * BM), 0)
    lo = _window_start(first + mt * BM + 1, window, BN)
    sink = _sink_of(sinks, hq, BM, SINKS)
    o = _attend(
        qv, k_cache, v_cache, k_scale, v_scale, block_tables, b, stride_bt, h, lo, hi,
        pos_q + 1, window, sink, scale, KV, D, BD, BS, BN, FP8, HW, DT, IEEE, SINKS,
    )  # fmt: skip
    dst = out + tok[:, None] * stride_ot + hq * stride_oh + d[None, :]
    tl.store(dst, o.to(out.dtype.element_ty), mask=qm)


@triton.jit
def row_tile_kernel(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, tile_lens, out,
    scale, n_rows, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, window, sinks,
    KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr, HW: tl.constexpr,
    DT: tl.constexpr, IEEE: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """Grid (row tiles, H): the one-query rows r0 .. r0 + BM - 1 (r0 = BM * program_id(0)) of a
    CUDA-graph step whose tile_lens > 0 (their context lengths) are consecutive rows of one
    prompt chunk, the tile's first row among them (engine/paged_meta.RowTiles): they share its
    block table, so each key tile is read once for all of them, as the prefill kernel reads it
    for a query tile. Row r sees keys 0 .. tile_lens[r] - 1. Other rows are left as they are."""
    mt = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // G
    r0 = mt * BM
    rows = r0 + tl.arange(0, BM)
    lens = tl.load(tile_lens + rows, mask=rows < n_rows, other=0)
    hi = tl.max(lens, axis=0)
    lo = _window_start(tl.min(tl.where(lens > 0, lens, hi), axis=0), window, BN)
    d = tl.arange(0, BD)
    qm = (lens > 0)[:, None] & (d[None, :] < D)
    tok = rows.to(tl.int64)
    qv = tl.load(q + tok[:, None] * stride_qt + hq * stride_qh + d[None, :], mask=qm, other=0.0)
    # rows of length 0 (not this tile's) see no key: unstored
    sink = _sink_of(sinks, hq, BM, SINKS)
    o = _attend(
        qv, k_cache, v_cache, k_scale, v_scale, block_tables, r0, stride_bt, h, lo, hi, lens,
        window, sink, scale, KV, D, BD, BS, BN, FP8, HW, DT, IEEE, SINKS,
    )  # fmt: skip
    dst = out + tok[:, None] * stride_ot + hq * stride_oh + d[None, :]
    tl.store(dst, o.to(out.dtype.element_ty), mask=qm)
