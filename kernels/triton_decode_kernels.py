"""Triton kernel of flash-decoding over the paged KV cache (one query a sequence): the decode
kernel, its merge of a sequence's splits and the reduce kernel that merges them instead where
asked. Imported on first use only (it imports triton); the wrapper is
kernels/triton_paged.paged_decode. The key loop, the fp8 tiles and the rotation-and-store it
shares with the prefill kernels are in kernels/triton_paged_kernels.py (the cache layout and
the fp8 arithmetic are described there).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_fused_kernels import _rotate_head
from hetero.kernels.triton_paged_kernels import _keys, _normalize, _store_new_kv
from hetero.kernels.triton_pdl import pdl_wait
from hetero.kernels.triton_xquant_kernels import _dot_element, _store_span


@triton.jit
def _splits_of(length, lo, n_splits, min_split, BN: tl.constexpr):
    """(splits, keys a split) of a sequence whose keys are lo .. length - 1: at most n_splits
    (the grid's), at least min_split keys each, whole BN tiles. At least one split (a length
    of 0 gives one empty split: m = -inf, l = 0, output 0)."""
    n = tl.maximum(tl.minimum(n_splits, tl.cdiv(length - lo, min_split)), 1)
    return n, tl.cdiv(tl.cdiv(length - lo, n), BN) * BN


@triton.jit
def decode_split_kernel(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, part_o, part_ml, out, sinks,
    cnt, words, floats, scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, n_splits,
    min_split, window,
    k_new, v_new, cos, sin, qo, ko, slots, sk_t, sk_h, sv_t, sv_h, sc, R,
    H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr,
    BD: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr,
    HW: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, SINKS: tl.constexpr,
    MERGE: tl.constexpr, BH: tl.constexpr, MC: tl.constexpr,
    XQ: tl.constexpr = False, LB: tl.constexpr = 4, GU: tl.constexpr = 32,
    REGROUP: tl.constexpr = False,
    ROPE: tl.constexpr = False, BR: tl.constexpr = 64, NEOX: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (B, KV, n_splits): the G query heads of KV head h over split s of the sequence's
    context. Each sequence cuts its own keys into its own number of splits (`_splits_of`: a
    graph is captured with the grid of its longest context, and a short context takes fewer
    splits, at least min_split keys each); the grid's splits past them return at once.

    Flash-decoding: each split keeps a running max m, sum l and unnormalized output acc. A
    sequence of one split writes softmax(qK) V to out itself. Else each split stores acc
    [G, D] and (m, l) to part_o [B, H, n_splits, D], part_ml [B, H, n_splits, 2], and with
    MERGE the last of the sequence's splits to finish (a counter a KV head, `cnt`, reset by
    it) merges them into out (`_merge`): one launch; without MERGE decode_reduce_kernel does.
    The G heads share each K/V tile (GQA): q is [BG, D] (BG >= 16, padded rows 0) so both
    products are tensor-core dots. With a sliding window (window > 0) the splits cut the
    window's keys, length - window .. length - 1, instead of the whole context. SINKS: head
    hq's sink logit (sinks [H] float32) joins each softmax's sum. XQ (with MERGE): the program
    that writes a KV head's G output heads also quantizes them for the linear after
    (`_xquant_heads`: xquant's words and floats in layout LB, GU, REGROUP), so that no launch
    of its own does. ROPE: q and the new token's k are not yet rotated, nor k and v stored:
    each program rotates its G heads of q (into qo, read back: `_rope_write`), and the split
    that holds the new key (position length - 1), the only one to read it, first rotates k
    into ko and stores it and v at slots[b] (< 0: padding, skipped): the rope_kv_write
    kernel's work, bit for bit, without a launch of its own.
    """
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(seq_lens + b)
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    n, split_len = _splits_of(length, lo, n_splits, min_split, BN)
    if s < n:
        start = lo + s * split_len
        end = tl.minimum(start + split_len, length)
        g = tl.arange(0, BG)
        d = tl.arange(0, BD)
        gm = g < G
        qm = gm[:, None] & (d[None, :] < D)
        if ROPE:
            holds_new = s == (length - 1 - lo) // tl.maximum(split_len, 1)  # the new key's split
            _rope_write(
                q, k_new, v_new, cos, sin, qo, ko, k_cache, v_cache, k_scale, v_scale, slots,
                b, h, holds_new, stride_qt, stride_qh, sk_t, sk_h, sv_t, sv_h, sc, R,
                H, KV, G, D, BD, BR, NEOX, FP8,
            )  # fmt: skip
            qsrc = qo + b * H * D + (h * G + g)[:, None] * D + d[None, :]
        else:
            qsrc = q + b * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :]
        # masked lanes must be 0: a padded dim of q meets a 0 of k, a padded head row is dropped
        qv = tl.load(qsrc, mask=qm, other=0.0)
        m_i, l_i, acc = _keys(
            qv, k_cache, v_cache, k_scale, v_scale, block_tables, b, stride_bt, h, start, end,
            tl.full([BG], end, tl.int32), tl.full([BG], -1, tl.int32), scale,
            KV, D, BD, BS, BN, FP8, HW, DT, IEEE, False,
        )  # fmt: skip
        hq = h * G + g  # [BG]
        if n == 1:  # the whole context here: normalize and store
            sink = m_i  # (unread without sinks)
            if SINKS:
                sink = tl.load(sinks + hq, mask=gm, other=0.0)
            o = _normalize(m_i, l_i, acc, sink, SINKS)
            dst = out + b * stride_ot + hq[:, None] * stride_oh + d[None, :]
            tl.store(dst, o.to(out.dtype.element_ty), mask=qm)
            if XQ:
                _xquant_heads(out, words, floats, b, h * G, stride_ot, stride_oh, H, G, D, LB,
                              GU, REGROUP)  # fmt: skip
        else:
            row = (b * H + hq) * n_splits + s  # [BG]
            tl.store(part_o + row[:, None] * D + d[None, :], acc, mask=qm)
            tl.store(part_ml + row * 2, m_i, mask=gm)
            tl.store(part_ml + row * 2 + 1, l_i, mask=gm)
            if MERGE:  # every thread's partials stored before one thread bumps the counter
                tl.debug_barrier()
                arrived = tl.atomic_add(cnt + b * KV + h, 1, sem="acq_rel", scope="gpu")
                if arrived == n - 1:
                    _merge(
                        part_o, part_ml, out, sinks, b, h * G, n, stride_ot, stride_oh,
                        n_splits, H, G, BH, D, BD, MC, SINKS,
                    )  # fmt: skip
                    if XQ:
                        _xquant_heads(out, words, floats, b, h * G, stride_ot, stride_oh, H, G,
                                      D, LB, GU, REGROUP)  # fmt: skip
                    tl.atomic_xchg(cnt + b * KV + h, 0, sem="relaxed", scope="gpu")


@triton.jit
def _rope_write(
    q, k_new, v_new, cos, sin, qo, ko, k_cache, v_cache, k_scale, v_scale, slots, b, h, last,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc, R,
    H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BR: tl.constexpr, NEOX: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Sequence b's query heads h G .. h G + G - 1 rotated into qo [B, H, D] (every split of
    the KV head writes the same values; each reads back its own), and where `last` its KV head
    h: k rotated into ko [B, KV, D], then k and v stored at slots[b], as rope_kv_write_kernel
    does; the program's stores made visible to all its threads."""
    t = b.to(tl.int64)
    cs, sn = cos + t * sc, sin + t * sc
    for gi in tl.static_range(G):
        src = q + t * sq_t + (h * G + gi) * sq_h
        _rotate_head(src, qo + (t * H + h * G + gi) * D, cs, sn, R, D, BD, BR, NEOX)
    if last:
        _store_new_kv(
            k_new, v_new, cs, sn, ko, k_cache, v_cache, k_scale, v_scale, slots, t, h, sk_t,
            sk_h, sv_t, sv_h, R, KV, D, BD, BR, NEOX, FP8,
        )  # fmt: skip
    tl.debug_barrier()


@triton.jit
def _xquant_heads(
    out, words, floats, b, h0, stride_ot, stride_oh,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, LB: tl.constexpr, GU: tl.constexpr,
    REGROUP: tl.constexpr,
):  # fmt: skip
    """Heads h0 .. h0 + G - 1 of out's row b (just stored by this program, read back in the
    integer dot's order: the values the next linear's own quantization would read) to xquant's
    words and floats for a row of H * D elements: the G * D elements are whole chunks and
    blocks of 32 (`paged_decode` checks)."""
    E: tl.constexpr = 128 // LB
    SPAN: tl.constexpr = G * D
    tl.debug_barrier()  # every thread's stores of the heads before any thread reads them
    idx = tl.arange(0, SPAN)
    el = (idx // E) * E + _dot_element(idx % E, LB, GU, REGROUP)  # head-group-local element
    x = tl.load(out + b * stride_ot + (h0 + el // D) * stride_oh + el % D).to(tl.float32)
    _store_span(x, words, floats, b, h0 * D, H * D, E, GU, SPAN)


@triton.jit
def _merge(
    part_o, part_ml, out, sinks, b, h0, n, stride_ot, stride_oh, n_splits,
    H: tl.constexpr, NH: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    MC: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """Query heads h0 .. h0 + NH - 1 of sequence b (BH: NH to a power of two): their first n
    splits' (m, l, acc) merged into softmax(qK) V and stored to out. The heads' partials load
    together, MC splits at a time, merged as they come (a running max, as the splits' own
    loops): one round trip to L2 for up to MC splits (other programs wrote them: the loads
    skip L1). A sequence without keys gives 0, not NaN."""
    hh = tl.arange(0, BH)
    hm = hh < NH
    d = tl.arange(0, BD)
    base = (b * H + h0 + hh) * n_splits  # [BH]
    m_run = tl.full([BH], float("-inf"), tl.float32)
    den = tl.zeros([BH], tl.float32)
    num = tl.zeros([BH, BD], tl.float32)
    for c in range(0, n, MC):
        sc = c + tl.arange(0, MC)
        r = base[:, None] + sc[None, :]  # [BH, MC]
        sm = hm[:, None] & (sc[None, :] < n)
        m = tl.load(part_ml + r * 2, mask=sm, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_ml + r * 2 + 1, mask=sm, other=0.0, cache_modifier=".cg")
        om = sm[:, :, None] & (d[None, None, :] < D)
        acc = tl.load(part_o + r[:, :, None] * D + d[None, None, :], mask=om, other=0.0,
                      cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m_run, tl.max(m, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_run - m_use)  # 0 while nothing was kept
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_use[:, None]))  # [BH, MC]
        den = den * alpha + tl.sum(l_s * w, axis=1)
        num = num * alpha[:, None] + tl.sum(acc * w[:, :, None], axis=1)
        m_run = m_new
    if SINKS:  # the sink joins the sum, both rescaled to the larger of it and the max
        sink = tl.load(sinks + h0 + hh, mask=hm, other=0.0).to(tl.float32)
        m_fin = tl.maximum(m_run, sink)
        f = tl.exp(m_run - m_fin)  # 0 where nothing was kept
        den = den * f + tl.exp(sink - m_fin)
        num = num * f[:, None]
    o = num / tl.where(den > 0, den, 1.0)[:, None]
    dst = out + b * stride_ot + (h0 + hh)[:, None] * stride_oh + d[None, :]
    tl.store(dst, o.to(out.dtype.element_ty), mask=hm[:, None] & (d[None, :] < D))


@triton.jit
def decode_reduce_kernel(
    part_o, part_ml, out, sinks, seq_lens, stride_ot, stride_oh, n_splits, min_split, window,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, MC: tl.constexpr,
    SINKS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (B, H): a query head's splits (as many as decode_split_kernel cut its sequence
    into) merged (`_merge`), for decode_split_kernel without MERGE; a sequence of one split was
    written by it."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    length = tl.load(seq_lens + b)
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    n, _ = _splits_of(length, lo, n_splits, min_split, BN)
    if n > 1:
        _merge(
            part_o, part_ml, out, sinks, b, tl.program_id(1), n, stride_ot, stride_oh, n_splits,
            H, 1, 1, D, BD, MC, SINKS,
        )  # fmt: skip
