"""The Triton kernel of the grouped MoE matmul (wrapper and layout: kernels/triton_moe.py).

Imported on first use only (it imports triton), like triton_qkernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_qdecode import _decode_tile, _load_step


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
