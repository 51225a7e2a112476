"""The Triton kernels of the grouped MoE matmul (wrapper and layout: kernels/triton_moe.py).

    _moe_mm_kernel    slots sorted by expert into blocks, each block's weight tile decoded once
                      and multiplied on the tensor cores (batches: many slots an expert)
    moe_align_kernel  the slots sorted by expert into blocks (triton_moe_sort.sort_by_expert, one
                      launch where torch took about twenty)
    _moe_gemv_kernel  one slot a program row, its expert's rows read straight from the ids
                      (decode: a few slots, each expert chosen once; no sort, no padded rows)

Imported on first use only (it imports triton), like triton_qkernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_pdl import pdl_wait
from hetero.kernels.triton_qdecode import _decode_tile, _load_step
from hetero.kernels.triton_qkernels import _gemv_rows


@triton.jit(do_not_specialize=["N", "n_chunks", "n_slots", "x_div", "grp_stride", "sb_stride"])
def _moe_mm_kernel(
    x_ptr, y_ptr, sorted_ptr, expert_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    N, n_chunks, n_slots, x_div, x_stride, y_stride,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, BT: tl.constexpr, S: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """acc [BN, BT] = W_e[rows] @ x[slots]^T for one block of BT sorted slots of expert e.

    program_id(0): the block (its BT entries of sorted_ids, all routed to expert_ids[block];
    -1: a block past the used ones, which exits); program_id(1): the tile of BN output rows.
    Expert e's rows are rows e * N .. e * N + N - 1 of the packed planes. A padding entry
    (slot id >= n_slots) reads nothing and stores nothing. Slot s reads x row s // x_div and
    writes y row s.
    """
    F: tl.constexpr = 32 // LB
    E: tl.constexpr = 4 * F
    blk = tl.program_id(0)
    e = tl.load(expert_ptr + blk)
    if e < 0:
        return
    pid_n = tl.program_id(1)
    local = pid_n * BN + tl.arange(0, BN)
    rmask = local < N
    rows = e.to(tl.int64) * N + local
    slots = tl.load(sorted_ptr + blk * BT + tl.arange(0, BT))
    tmask = slots < n_slots
    xrow = (slots // x_div).to(tl.int64)
    kk = tl.arange(0, S * E)
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    for c0 in range(0, n_chunks, S):
        ch = c0 + tl.arange(0, S)
        cmask = ch < n_chunks
        words, high = _load_step(
            codes_ptr, high_ptr, rows, rmask, c0, n_chunks, code_stride, S, LB, HB
        )
        sargs = (
            scale_ptr,
            min_ptr,
            d_ptr,
            dmin_ptr,
            rows,
            rmask,
            c0,
            ch,
            cmask,
            grp_stride,
            sb_stride,
        )
        w = _decode_tile(words, high, zero, sargs, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB)
        k = c0 * E + kk
        xm = (k < n_chunks * E)[:, None] & tmask[None, :]
        xt = tl.load(x_ptr + xrow[None, :] * x_stride + k[:, None], mask=xm, other=0)  # [S*E, BT]
        # the weights rounded to x's dtype, as the reference rounds its dequantized matrix
        acc = tl.dot(w.to(x_ptr.dtype.element_ty), xt, acc, input_precision=PRECISION)
    dst = y_ptr + slots.to(tl.int64)[None, :] * y_stride + local[:, None]
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & tmask[None, :])


@triton.jit
def moe_align_kernel(
    ids_ptr, sorted_ptr, expert_ptr, S, E, n_blocks,
    MAXB, BT: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(S, BS) + 1,): `triton_moe_sort.sort_by_expert_ref`'s layout of the S slots of ids
    (expert ids < E <= BE), exactly: each expert's slots in slot order from the first row of
    its blocks (its count padded to BT), padding and the unused rows S, expert_ids[b] the expert
    of block b or -1.

    Every program counts all the slots (cheap: S is T k). The first cdiv(S, BS) place BS slots
    each: slot i's row is its expert's first row plus the slots of that expert before i. The
    last writes the padding, the unused rows and expert_ids (expert e's blocks, at most MAXB,
    from its first row's block), so that no program waits for another."""
    pid = tl.program_id(0)
    e = tl.arange(0, BE)
    j = tl.arange(0, BS)
    counts = tl.zeros([BE], dtype=tl.int32)
    for c0 in range(0, S, BS):
        v = tl.load(ids_ptr + c0 + j, mask=c0 + j < S, other=-1).to(tl.int32)
        counts += tl.sum((v[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BT - 1) // BT * BT
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    if pid < tl.num_programs(0) - 1:
        i = pid * BS + j
        mine = tl.load(ids_ptr + i, mask=i < S, other=-1).to(tl.int32)
        rank = tl.zeros([BS], dtype=tl.int32)
        for c0 in range(0, pid * BS + BS, BS):  # the slots before each of mine, block by block
            k = c0 + j
            v = tl.load(ids_ptr + k, mask=k < S, other=-2).to(tl.int32)
            same = (v[None, :] == mine[:, None]) & (k[None, :] < i[:, None])
            rank += tl.sum(same.to(tl.int32), axis=1)
        first = tl.sum(tl.where(e[None, :] == mine[:, None], starts[None, :], 0), axis=1)
        tl.store(sorted_ptr + first + rank, i, mask=i < S)
    else:
        # each expert's padding after its slots ([BE, BT]: row e, its count + t < padded)
        t = tl.arange(0, BT)
        pad = (starts + counts)[:, None] + t[None, :]
        tl.store(sorted_ptr + pad, S, mask=(counts[:, None] + t[None, :]) < padded[:, None])
        # expert e's blocks ([BE, 32] at a time: row e, its first block + m below its end)
        for m0 in range(0, MAXB, 32):
            m = m0 + tl.arange(0, 32)
            blk = (starts // BT)[:, None] + m[None, :]
            mine = (m[None, :] < (padded // BT)[:, None]) & (e < E)[:, None]
            tl.store(expert_ptr + blk, tl.zeros([BE, 32], dtype=tl.int32) + e[:, None], mask=mine)
        used = tl.sum(padded, axis=0)
        for r0 in range(used, n_blocks * BT, BS):  # the rows past the used blocks
            tl.store(sorted_ptr + r0 + j, S, mask=r0 + j < n_blocks * BT)
        for b0 in range(used // BT, n_blocks, BS):  # and their blocks
            tl.store(expert_ptr + b0 + j, -1, mask=b0 + j < n_blocks)


@triton.jit(do_not_specialize=["N", "n_chunks", "x_div", "grp_stride", "sb_stride", "zero"])
def _moe_gemv_kernel(
    x_ptr, y_ptr, ids_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    N, n_chunks, x_div, x_stride, y_stride,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, S: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """y[s, tile] = W_e[tile] x[s // x_div] for slot s = program_id(0), e = ids.flat[s],
    tile = program_id(1)'s BN rows: `_qgemv_kernel`'s loop (float32 FMAs on the decoded
    fields, scales factored out of each group's sum) on expert e's rows e * N + r."""
    pdl_wait(PDL)
    s = tl.program_id(0)
    e = tl.load(ids_ptr + s).to(tl.int64)
    local = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = local < N
    rows = e * N + local
    y = _gemv_rows(
        x_ptr + (s // x_div).to(tl.int64) * x_stride, rows, rmask, 0, n_chunks,
        codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
        code_stride, grp_stride, sb_stride, zero,
        LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB, BN, S,
    )  # fmt: skip
    tl.store(y_ptr + s.to(tl.int64) * y_stride + local, y.to(y_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def moe_router_kernel(
    h, w, b, out, E, C, sh, HAS_BIAS: tl.constexpr, BE: tl.constexpr, BC: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, E / BE): out[t, e] = h[t] . w[e] (+ b[e]) for BE experts, in float32."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    em = e < E
    acc = tl.zeros([BE, BC], dtype=tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cm = c < C
        x = tl.load(h + t * sh + c, mask=cm, other=0.0).to(tl.float32)
        wm = em[:, None] & cm[None, :]
        wt = tl.load(w + e.to(tl.int64)[:, None] * C + c[None, :], mask=wm, other=0.0)
        acc += wt * x[None, :]
    logits = tl.sum(acc, axis=1)
    if HAS_BIAS:
        logits += tl.load(b + e, mask=em, other=0.0)
    tl.store(out + t * E + e, logits, mask=em)


@triton.jit
def moe_route_kernel(
    logits, ids_out, w_out, E,
    BE: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, GATING: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T,): token t's K largest logits, largest first (ties: the lower id), and their
    weights: GATING 0, softmax over all E then renormalized over the K where NORM; 1, softmax
    over the K."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    v = tl.load(logits + t * E + e, mask=e < E, other=float("-inf"))
    top = tl.max(v, axis=0)
    denom = tl.sum(tl.where(e < E, tl.exp(v - top), 0.0), axis=0)
    j = tl.arange(0, BK)
    chosen = tl.zeros([BK], dtype=tl.int64)
    vals = tl.full([BK], float("-inf"), dtype=tl.float32)
    rest = v
    for i in tl.static_range(K):
        m = tl.max(rest, axis=0)
        idx = tl.min(tl.where(rest == m, e, BE), axis=0)
        chosen = tl.where(j == i, idx.to(tl.int64), chosen)
        vals = tl.where(j == i, m, vals)
        rest = tl.where(e == idx, float("-inf"), rest)
    jm = j < K
    if GATING == 0:
        w = tl.exp(vals - top) / denom
        if NORM:
            w = w / tl.maximum(tl.sum(tl.where(jm, w, 0.0), axis=0), 6.103515625e-5)
    else:
        x = tl.where(jm, tl.exp(vals - top), 0.0)
        w = x / tl.sum(x, axis=0)
    tl.store(ids_out + t * K + j, chosen, mask=jm)
    tl.store(w_out + t * K + j, w, mask=jm)


@triton.jit
def moe_combine_kernel(
    o, w, out, C, so, sout, K: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False
):
    """Grid (T, C / BC): out[t] = sum_j w[t, j] o[t K + j] in float32, rounded once."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(K):
        wj = tl.load(w + t * K + j)
        acc += wj * tl.load(o + (t * K + j) * so + c, mask=cm, other=0.0).to(tl.float32)
    tl.store(out + t * sout + c, acc.to(out.dtype.element_ty), mask=cm)
