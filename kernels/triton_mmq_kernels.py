"""Triton kernels of the integer tensor-core matmul (wrapper and layout: kernels/mmq.py).

    q8_rows_kernel   x [R, K] -> int8 codes, a float32 scale and the scaled code sum of every
                     block of 32 (llama.cpp's q8_1 blocks)
    moe_mmq_kernel   one block of BT slots sorted by expert times a tile of BN rows of the
                     expert's K-quant weight (Q4_K, Q5_K, Q6_K): each chunk of 32 codes as int8
                     on the tensor cores against the slots' int8 activations, the group scales
                     and mins applied to the int32 sums

Imported on first use only (it imports triton), like triton_moe_kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def q8_rows_kernel(
    x_ptr, q_ptr, s_ptr, sum_ptr, n_blocks, x_stride, q_stride, s_stride, BB: tl.constexpr
):  # fmt: skip
    """Grid (R, blocks / BB): row r's blocks of 32, q = round(x / s) (half away from zero),
    s = amax / 127, sum = s * sum(q) (s = 0 and q = 0 for a block of zeros)."""
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BB + tl.arange(0, BB)
    bm = b < n_blocks
    j = tl.arange(0, 32)
    x = tl.load(x_ptr + r * x_stride + b[:, None] * 32 + j[None, :], mask=bm[:, None], other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    a = tl.floor(tl.abs(x) * inv[:, None] + 0.5)
    q = tl.where(x < 0, -a, a)
    s = amax / 127.0
    tl.store(q_ptr + r * q_stride + b[:, None] * 32 + j[None, :], q.to(tl.int8), mask=bm[:, None])
    tl.store(s_ptr + r * s_stride + b, s, mask=bm)
    tl.store(sum_ptr + r * s_stride + b, s * tl.sum(q, axis=1), mask=bm)


@triton.jit(do_not_specialize=["N", "n_chunks", "n_slots", "x_div", "grp_stride", "sb_stride"])
def moe_mmq_kernel(
    xq_ptr, sx_ptr, sum_ptr, y_ptr, sorted_ptr, expert_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    N, n_chunks, n_slots, x_div, xq_stride, sx_stride, y_stride,
    code_stride, grp_stride, sb_stride,
    HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr, HAS_MIN: tl.constexpr,
    BN: tl.constexpr, BT: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    """y[slots, tile] = W_e[tile] x[slots]^T for one block of BT sorted slots of expert e
    (program_id(0): the block, -1 past the used ones; program_id(1): the tile of BN rows).

    A chunk (4 code words, 32 codes: field f of word c is element 4f + c) becomes an int8
    [BN, 32] tile in the order p = 8c + f, and the slots' int8 codes are read in that order, so
    one int8 dot gives each row's integer sum over the chunk; a step takes S chunks (at most a
    super-block of 256: one d a row) as one batched dot [S, BN, 32] x [S, 32, BT]. A chunk
    holds NG = 32 / G groups (Q6_K: 2 of 16): the activations then enter the dot NG times side
    by side, each copy zero outside its group, so the dot's NG * BT columns are the groups'
    sums. Then per group acc += d sc sx sum(q x_q) (- dmin m sum(x) with mins): the
    references' W = d sc (q + OFF) - dmin m, up to float32 rounding and the activations' 8-bit
    codes.
    """
    NG: tl.constexpr = 32 // G
    blk = tl.program_id(0)
    e = tl.load(expert_ptr + blk)
    if e < 0:
        return
    local = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = local < N
    rows = e.to(tl.int64) * N + local
    slots = tl.load(sorted_ptr + blk * BT + tl.arange(0, BT))
    tmask = slots < n_slots
    xrow = (slots // x_div).to(tl.int64)
    p = tl.arange(0, 32)
    elem = 4 * (p % 8) + p // 8  # position p = 8c + f holds element 4f + c
    lane = tl.arange(0, 4)
    shifts = 4 * tl.arange(0, 8)
    grp = (4 * (p % 8)) // G  # the group (of the chunk's NG) of position p's element
    sel = grp[None, :, None, None] == tl.arange(0, NG)[None, None, :, None]  # [1, 32, NG, 1]
    sj = tl.arange(0, S)
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    for c0 in range(0, n_chunks, S):
        ch = c0 + sj  # [S]
        cm = ch < n_chunks
        woff = rows[None, :, None] * code_stride + (ch * 4)[:, None, None] + lane[None, None, :]
        wm = cm[:, None, None] & rmask[None, :, None]
        words = tl.load(codes_ptr + woff, mask=wm, other=0)  # [S, BN, 4]
        q = (words[:, :, :, None] >> shifts[None, None, None, :]) & 15  # [S, BN, 4, 8]
        if HB > 0:  # the "fields" arrangement: code word c's high bits, field f at bit HB f
            hi = tl.load(high_ptr + woff, mask=wm, other=0).to(tl.int32)
            hs = HB * tl.arange(0, 8)
            h = (hi[:, :, :, None] >> hs[None, None, None, :]) & ((1 << HB) - 1)
            q = q | (h << 4)
        w = tl.reshape(q + OFF, [S, BN, 32]).to(tl.int8)
        k = ch[:, None] * 32 + elem[None, :]  # [S, 32]
        xm = cm[:, None, None] & tmask[None, None, :]
        xt = tl.load(
            xq_ptr + xrow[None, None, :] * xq_stride + k[:, :, None], mask=xm, other=0
        )  # [S, 32, BT] int8
        sxm = cm[:, None] & tmask[None, :]
        sx = tl.load(sx_ptr + xrow[None, :] * sx_stride + ch[:, None], mask=sxm, other=0.0)
        d = tl.load(d_ptr + rows * sb_stride + (c0 * 32) // 256, mask=rmask, other=0)
        if NG == 1:
            c = tl.dot(w, xt, out_dtype=tl.int32)  # [S, BN, BT]
            sm = cm[:, None] & rmask[None, :]
            sc = tl.load(scale_ptr + rows[None, :] * grp_stride + ch[:, None], mask=sm, other=0)
            part = c.to(tl.float32) * sc.to(tl.float32)[:, :, None] * sx[:, None, :]
        else:
            xop = tl.where(sel, xt[:, :, None, :], 0)  # [S, 32, NG, BT]
            xop = tl.reshape(xop, [S, 32, NG * BT]).to(tl.int8)
            c = tl.reshape(tl.dot(w, xop, out_dtype=tl.int32), [S, BN, NG, BT])
            g = ch[:, None, None] * NG + tl.arange(0, NG)[None, None, :]  # [S, 1, NG]
            sm = cm[:, None, None] & rmask[None, :, None]
            sc = tl.load(scale_ptr + rows[None, :, None] * grp_stride + g, mask=sm, other=0)
            part = tl.sum(c.to(tl.float32) * sc.to(tl.float32)[:, :, :, None], axis=2)
            part = part * sx[:, None, :]
        acc += tl.sum(part, axis=0) * d.to(tl.float32)[:, None]
        if HAS_MIN:  # (G = 32: one group a chunk)
            mm = cm[:, None] & rmask[None, :]
            mn = tl.load(min_ptr + rows[None, :] * grp_stride + ch[:, None], mask=mm, other=0)
            dmin = tl.load(dmin_ptr + rows * sb_stride + (c0 * 32) // 256, mask=rmask, other=0)
            sums = tl.load(sum_ptr + xrow[None, :] * sx_stride + ch[:, None], mask=sxm, other=0.0)
            m = tl.sum(mn.to(tl.float32)[:, :, None] * sums[:, None, :], axis=0)  # [BN, BT]
            acc -= dmin.to(tl.float32)[:, None] * m
    dst = y_ptr + slots.to(tl.int64)[None, :] * y_stride + local[:, None]
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & tmask[None, :])
