"""Triton kernels of the paged KV cache: the fused KV write and paged attention (decode, prefill).

Imported on first use only (it imports triton); the wrappers and registrations are in
kernels/triton_paged.py. Cache layout as kernels/paged.py draws it: k/v [num_slots, KV, D], slot =
block * BS + offset, fp8 scales [num_slots, KV] float32.

FP8 e4m3 is read and written as uint8 bits with integer arithmetic, so the same kernels run on
sm_80 (no fp8 type), sm_89/90 and under the interpreter:

    e4m3fn   s eeee mmm        bias 7, no inf, 0x7f/0xff NaN, subnormals m/8 * 2^-6
    decode   s -> bit 15, eeee mmm -> bits 13..7 of a float16, times 2^(15-7): exact, subnormals
             included (an e4m3 subnormal lands on a float16 subnormal of the same value).
    encode   round to nearest even as torch's .to(float8_e4m3fn): normals from the float32 bits
             (add 0x7ffff + lsb, shift out 20 mantissa bits, rebias the exponent: a carry rolls
             into the exponent), subnormals (|v| < 2^-6) by rounding |v| * 2^9 to an integer
             (RNE through the 2^23 magic number: exact, the product is a power-of-two scaling).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_pdl import pdl_wait

FP8_MAX = tl.constexpr(448.0)  # a global a jitted kernel reads must be constexpr


@triton.jit
def fp8_decode(u):
    """uint8 e4m3fn bits (any int type) -> float32 values."""
    u = u.to(tl.int32)
    bits = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


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
def _load_kv(
    cache, scale_ptr, slot, h, pm,
    KV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Rows `slot` [BN] of head h -> [BN, BD] float32 (masked rows and dims are 0)."""
    d = tl.arange(0, BD)
    m = pm[:, None] & (d[None, :] < D)
    x = tl.load(cache + (slot[:, None] * KV + h) * D + d[None, :], mask=m, other=0)
    if FP8:
        s = tl.load(scale_ptr + slot * KV + h, mask=pm, other=0.0)
        return fp8_decode(x) * s[:, None]
    return x.to(tl.float32)


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
def _online_softmax(qv, kt, vt, keep, scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key tile of flash attention: q [M, BD], k/v [BN, BD], keep [M, BN]; running max
    m_i [M], sum l_i [M] and unnormalized output acc [M, BD] in float32, updated. A row that
    has kept no key yet (a sliding window starts past the tile) keeps m_i = -inf, l_i = 0."""
    sc = _dot(qv, tl.trans(kt), IEEE) * scale  # [M, BN]
    sc = tl.where(keep, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(-inf - 0) = 0, never NaN
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(sc - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(qv.dtype), vt, IEEE)
    return m_new, l_i, acc


@triton.jit
def _window_start(first_limit, window, BN: tl.constexpr):
    """The first key tile (a multiple of BN) rows whose limits are >= first_limit need under a
    sliding window (window 0: the whole context, tile 0)."""
    return tl.where(window > 0, tl.maximum(first_limit - window, 0) // BN * BN, 0)


@triton.jit
def _attend(
    qv, k_cache, v_cache, k_scale, v_scale, block_tables, b, stride_bt, h, lo, hi, limit,
    window, sink, scale,
    KV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """softmax(q K^T) V [M, BD] of query rows qv [M, BD] over keys lo .. hi - 1 of sequence b's
    pages (KV head h), row i seeing the keys below limit[i] (causal: its position + 1) and, with
    window > 0, from limit[i] - window on. SINKS: sink [M] joins each row's softmax without a
    value (kernels/paged_sinks.py). A row that sees no key gives 0."""
    m_i = tl.full([qv.shape[0]], float("-inf"), tl.float32)
    l_i = tl.zeros([qv.shape[0]], tl.float32)
    acc = tl.zeros([qv.shape[0], BD], tl.float32)
    first = tl.where(window > 0, limit - window, -1)  # [M]: keys below it are out of the window
    for n0 in range(lo, hi, BN):
        pos = n0 + tl.arange(0, BN)
        pm = pos < hi
        slot = _slots(block_tables, b, stride_bt, pos, pm, BS)
        kt = _load_kv(k_cache, k_scale, slot, h, pm, KV, D, BD, FP8).to(qv.dtype)
        vt = _load_kv(v_cache, v_scale, slot, h, pm, KV, D, BD, FP8).to(qv.dtype)
        keep = pm[None, :] & (pos[None, :] < limit[:, None]) & (pos[None, :] >= first[:, None])
        m_i, l_i, acc = _online_softmax(qv, kt, vt, keep, scale, m_i, l_i, acc, IEEE)
    if SINKS:  # exp(sink - m_i) joins the sum; a row without keys: exp(+inf) -> 0 output
        l_i = l_i + tl.exp(sink - m_i)
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def _sink_of(sinks, hq, BM: tl.constexpr, SINKS: tl.constexpr):
    """Head hq's sink logit for BM query rows (float32 [BM]; zeros, unused, without sinks)."""
    if SINKS:
        return tl.zeros([BM], tl.float32) + tl.load(sinks + hq).to(tl.float32)
    return tl.zeros([BM], tl.float32)


@triton.jit
def decode_split_kernel(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, part_o, part_ml,
    scale, stride_qt, stride_qh, stride_bt, n_splits, window,
    H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr,
    BD: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (B, KV, splits): the G query heads of KV head h over split s of the sequence's
    context. Each sequence cuts its own length into n_splits runs of whole BN tiles (so a graph
    captured for the longest context splits a short one as finely; splits past the end stay
    empty: m = -inf, l = 0).

    Flash-decoding: each split keeps a running max m, sum l and unnormalized output acc; it
    stores acc [BG, D] and (m, l) to part_o [B, H, splits, D], part_ml [B, H, splits, 2] for
    decode_reduce_kernel. The G heads share each K/V tile (GQA): q is [BG, D] (BG >= 16, padded
    rows 0) so both products are tensor-core dots. With a sliding window (window > 0) the splits
    cut the window's keys, length - window .. length - 1, instead of the whole context.
    """
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(seq_lens + b)
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    split_len = tl.cdiv(tl.cdiv(length - lo, n_splits), BN) * BN
    start = lo + s * split_len
    end = tl.minimum(start + split_len, length)
    g = tl.arange(0, BG)
    d = tl.arange(0, BD)
    gm = g < G
    qm = gm[:, None] & (d[None, :] < D)
    # masked lanes must be 0: a padded dim of q meets a 0 of k, a padded head row is dropped
    qv = tl.load(q + b * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :], mask=qm,
                 other=0.0)  # fmt: skip
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    for n0 in range(start, end, BN):
        pos = n0 + tl.arange(0, BN)
        pm = pos < end
        slot = _slots(block_tables, b, stride_bt, pos, pm, BS)
        kt = _load_kv(k_cache, k_scale, slot, h, pm, KV, D, BD, FP8).to(qv.dtype)
        vt = _load_kv(v_cache, v_scale, slot, h, pm, KV, D, BD, FP8).to(qv.dtype)
        keep = pm[None, :] & (g[:, None] >= 0)  # [BG, BN]
        m_i, l_i, acc = _online_softmax(qv, kt, vt, keep, scale, m_i, l_i, acc, IEEE)
    row = (b * H + h * G + g) * n_splits + s  # [BG]
    tl.store(part_o + row[:, None] * D + d[None, :], acc, mask=qm)
    tl.store(part_ml + row * 2, m_i, mask=gm)
    tl.store(part_ml + row * 2 + 1, l_i, mask=gm)


@triton.jit
def decode_reduce_kernel(
    part_o, part_ml, out, sinks, stride_ot, stride_oh, n_splits,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BSP: tl.constexpr, SINKS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (B, H): combine the splits' (m, l, acc) into softmax(qK) V; SINKS: head hq's sink
    logit joins the denominator. A sequence of length 0 (padding) gives 0, not NaN."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    hq = tl.program_id(1)
    sp = tl.arange(0, BSP)
    d = tl.arange(0, BD)
    sm = sp < n_splits
    row = (b * H + hq) * n_splits + sp
    m = tl.load(part_ml + row * 2, mask=sm, other=float("-inf"))
    l_s = tl.load(part_ml + row * 2 + 1, mask=sm, other=0.0)
    m_all = tl.max(m, axis=0)
    if SINKS:
        sink = tl.load(sinks + hq).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # [BSP]
    om = sm[:, None] & (d[None, :] < D)
    acc = tl.load(part_o + row[:, None] * D + d[None, :], mask=om, other=0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l_s * w, axis=0)
    if SINKS:
        den += tl.exp(sink - m_all)
    o = num / tl.where(den > 0, den, 1.0)
    tl.store(out + b * stride_ot + hq * stride_oh + d, o.to(out.dtype.element_ty), mask=d < D)


@triton.jit
def prefill_kernel(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, q_starts, out,
    scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, window, sinks,
    KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
    SINKS: tl.constexpr,
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
        pos_q + 1, window, sink, scale, KV, D, BD, BS, BN, FP8, IEEE, SINKS,
    )  # fmt: skip
    dst = out + tok[:, None] * stride_ot + hq * stride_oh + d[None, :]
    tl.store(dst, o.to(out.dtype.element_ty), mask=qm)


@triton.jit
def row_tile_kernel(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, tile_lens, out,
    scale, n_rows, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, window, sinks,
    KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
    SINKS: tl.constexpr,
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
        window, sink, scale, KV, D, BD, BS, BN, FP8, IEEE, SINKS,
    )  # fmt: skip
    dst = out + tok[:, None] * stride_ot + hq * stride_oh + d[None, :]
    tl.store(dst, o.to(out.dtype.element_ty), mask=qm)
