"""Triton kernels over packed GGUF weights (layout and formula: `hetero.kernels.repack`; the
in-register decoding of the words, shared with the variants: `triton_qdecode`).

    _qgemv_kernel    decode: y[t] = W x[t] for a few tokens, float32 FMAs, split K in one launch
    _qmm_kernel      prefill: y^T = W x^T on the tensor cores, the weight tile as operand A
                     (split K too when its tiles are fewer than the SMs)
    _dequant_kernel  W -> a dense [N, K] matrix (fp32/bf16/fp16) for cuBLAS at large T

This module imports triton; `triton_qmatmul` imports it on first use, so that importing the kernel
registry never initializes triton (its interpreter mode is fixed when triton is first imported).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_qdecode import _decode_tile, _float_chunks, _load_step


@triton.jit
def _split_k_store(val, y_ptrs, mask, part_ptr, poff, slice_size, cnt, pid_k, split):
    """Store `val` (a program's sum over its share of K) to y, or with split > 1 add the splits.

    Each program stores its partial (float32 [split, ...] at pid_k * slice_size + poff) and bumps
    the tile's counter; the last of the split to arrive adds the partials in split order
    (deterministic), writes y and resets the counter for the next launch. Every thread's partial
    is stored before one thread releases the counter (the CTA barrier, then a gpu-scope acq_rel
    atomic); the last program reads the others' through L2.
    """
    if split == 1:
        tl.store(y_ptrs, val.to(y_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k * slice_size + poff, val, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == split - 1:
            total = tl.zeros_like(val)
            for s in range(split):
                p = part_ptr + s * slice_size + poff
                total += tl.load(p, mask=mask, other=0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")


# Only the strides that set vector widths are specialized (divisibility by 16); the rest would
# compile one variant per shape for nothing. (The matmul kernels' run-time arguments.)
NO_SPECIALIZE = [
    *("T", "N", "n_chunks", "chunks_per_split", "y_stride", "grp_stride", "sb_stride", "zero")
]


@triton.jit
def _gemv_rows(
    x_row, rows, rmask, c_begin, c_end,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    """[BN] float32: chunks c_begin .. c_end of W[rows] times the token x_row, S chunks a step
    (the decode kernels' loop)."""
    acc = tl.zeros([BN, S, 4], dtype=tl.float32)
    # The next step's words are loaded before this step's math (a two-deep software pipeline:
    # twice the bytes in flight per thread; the compiler does not pipeline loads that feed no dot)
    nxt_words, nxt_high = _load_step(
        codes_ptr, high_ptr, rows, rmask, c_begin, c_end, code_stride, S, LB, HB
    )
    # To c_end: a short last split runs no empty steps (whose scale loads, masked by the row
    # only, read d / dmin past the plane for the last row)
    for c0 in range(c_begin, c_end, S):
        words, high = nxt_words, nxt_high
        nxt_words, nxt_high = _load_step(
            codes_ptr, high_ptr, rows, rmask, c0 + S, c_end, code_stride, S, LB, HB
        )
        acc = _float_chunks(
            acc, words, high, zero, x_row, rows, rmask, c0, c_end, scale_ptr, min_ptr, d_ptr,
            dmin_ptr, grp_stride, sb_stride, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB,
        )  # fmt: skip
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _qgemv_kernel(
    x_ptr, y_ptr, part_ptr, cnt_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    T, N, n_chunks, chunks_per_split, x_stride, y_stride,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    """y[t, rows] for t = program_id(0) (adjacent programs share a weight tile: one DRAM read);
    program_id(2) takes chunks_per_split chunks of K (see _split_k_store).

    The scales are factored out of each group's sum (`_float_chunks`): three instructions a
    weight instead of four; decode is as much instruction- as memory-bound.
    """
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, n_chunks)
    part = _gemv_rows(
        x_ptr + t * x_stride, rows, rmask, c_begin, c_end,
        codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
        code_stride, grp_stride, sb_stride, zero,
        LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB, BN, S,
    )  # fmt: skip
    _split_k_store(
        part, y_ptr + t * y_stride + rows, rmask, part_ptr, t * N + rows, T * N,
        cnt_ptr + pid_n * T + t, pid_k, tl.num_programs(2),
    )  # fmt: skip


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _qmm_kernel(
    x_ptr, y_ptr, part_ptr, cnt_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    T, N, n_chunks, chunks_per_split, x_stride, y_stride,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, BT: tl.constexpr, S: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """acc [BN, BT] = W[rows] @ x[ts]^T, S chunks of K a step: the decoded tile is operand A.

    program_id(0) is the (row tile, token tile); the token tiles of one row tile are adjacent in
    launch order, so each weight tile comes from DRAM once and x (small) from L2. With few tiles
    (small T) program_id(1) splits K, as in the decode kernel.
    """
    F: tl.constexpr = 32 // LB
    E: tl.constexpr = 4 * F
    n_t = tl.cdiv(T, BT)
    pid_n = tl.program_id(0) // n_t
    pid_t = tl.program_id(0) % n_t
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    ts = pid_t * BT + tl.arange(0, BT)
    tmask = ts < T
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, n_chunks)
    kk = tl.arange(0, S * E)
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    for c0 in range(c_begin, c_end, S):  # not past c_end: see _qgemv_kernel
        ch = c0 + tl.arange(0, S)
        cmask = ch < c_end
        words, high = _load_step(
            codes_ptr, high_ptr, rows, rmask, c0, c_end, code_stride, S, LB, HB
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
        # Rounded to x's dtype exactly as the reference rounds its dequantized matrix.
        k = c0 * E + kk
        xm = (k < c_end * E)[:, None] & tmask[None, :]
        xt = tl.load(x_ptr + ts[None, :] * x_stride + k[:, None], mask=xm, other=0)  # [S*E, BT]
        acc = tl.dot(w.to(x_ptr.dtype.element_ty), xt, acc, input_precision=PRECISION)
    _split_k_store(
        acc, y_ptr + ts[None, :] * y_stride + rows[:, None], rmask[:, None] & tmask[None, :],
        part_ptr, ts[None, :] * N + rows[:, None], T * N, cnt_ptr + tl.program_id(0), pid_k,
        tl.num_programs(1),
    )  # fmt: skip


@triton.jit(do_not_specialize=["N", "n_chunks", "grp_stride", "sb_stride", "zero"])
def _dequant_kernel(
    out_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    N, n_chunks, out_stride,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    """out[rows, chunks] = W in out's dtype (float32: the reference's bits; bf16/fp16: those
    bits rounded to nearest even, as torch's .to() rounds them)."""
    F: tl.constexpr = 32 // LB
    E: tl.constexpr = 4 * F
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    c0 = tl.program_id(1) * S
    ch = c0 + tl.arange(0, S)
    cmask = ch < n_chunks
    words, high = _load_step(codes_ptr, high_ptr, rows, rmask, c0, n_chunks, code_stride, S, LB, HB)
    sargs = (scale_ptr, min_ptr, d_ptr, dmin_ptr, rows, rmask, c0, ch, cmask, grp_stride, sb_stride)
    w = _decode_tile(words, high, zero, sargs, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB)
    k = c0 * E + tl.arange(0, S * E)
    optr = out_ptr + rows.to(tl.int64)[:, None] * out_stride + k[None, :]
    tl.store(
        optr, w.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (k < n_chunks * E)[None, :]
    )
