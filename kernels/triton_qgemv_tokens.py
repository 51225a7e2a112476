"""The decode kernel for a few tokens at once (batched decode, T = 3 .. GEMV_TOKENS_MAX_T).

`_qgemv_kernel` runs one program per token: at T tokens it decodes every weight T times (the
weight bytes come from L2 after the first, but the decode instructions do not), so at T = 4 it
already ran slower than the tensor-core kernel. Here a program takes TT tokens: it decodes a
weight field once into registers and FMAs it against all TT token rows (llama.cpp's mmvq does the
same for batch <= 8).

Instructions a weight and token, from ptxas for sm_90 (the loop body of a Q4_K step): this kernel
3.4 at TT = 4 and 2.35 at TT = 8 (FFMA about half of them), _qgemv_kernel 5.4; _qmm_kernel 7.3 a
weight whatever T <= 16. At ~32 T instructions/s (132 SMs x 4 schedulers x 32 lanes x ~1.9 GHz) a
4096 x 14336 Q4_K matrix (58.7 M weights, 33 MB: ~12 us at 2.8 TB/s) costs ~24 us of issue at T = 4
and ~33 us at T = 8, against ~42 us measured for _qmm_kernel at T = 4 (which is not issue-bound:
7.3 x 58.7 M would be 13 us) and ~63 us for _qgemv_kernel at T = 4. Hence this path for T = 3 .. 8
(GEMV_TOKENS_MAX_T), to be confirmed on the device: `benchmarks/gpu_qmicro.py` times all three.

Tensors of a step: words [BN, S, 4] int32 (as in _qgemv_kernel), x [TT, S, 4], the per-group sums
qx [TT, BN, S] (word by word: see _fma_words) and acc [TT, BN, S].
The scales are factored out of each group's sum exactly as in _qgemv_kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_qdecode import _field, _group_scales, _load_step
from hetero.kernels.triton_qkernels import NO_SPECIALIZE, _split_k_store


@triton.jit
def _words(v):
    """[A, B, 4] -> its 4 slices [A, B] (word c of each chunk): splits along a dimension each
    thread holds whole, so they only rename registers."""
    even, odd = tl.split(tl.reshape(v, [v.shape[0], v.shape[1], 2, 2]))  # c = 2i + j: j = 0, 1
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def _fma_words(qx, q, xv):
    """qx [TT, BN, S] += sum over the 4 words c of q [BN, S, 4] (c) * xv [TT, S, 4] (c).

    Word by word in 3-D: a [TT, BN, S] product lays its threads over (BN, S) as q's layout does,
    where the 4-D product [TT, BN, S, 4] spread the words over threads (a shared-memory shuffle
    of q for every field)."""
    q0, q1, q2, q3 = _words(q)
    x0, x1, x2, x3 = _words(xv)
    qx += q0[None, :, :] * x0[:, None, :]
    qx += q1[None, :, :] * x1[:, None, :]
    qx += q2[None, :, :] * x2[:, None, :]
    qx += q3[None, :, :] * x3[:, None, :]
    return qx


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _qgemv_tokens_kernel(
    x_ptr, y_ptr, part_ptr, cnt_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    T, N, n_chunks, chunks_per_split, x_stride, y_stride,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, S: tl.constexpr, TT: tl.constexpr,
):  # fmt: skip
    """y[ts, rows] for the TT tokens ts of program_id(0) and the BN rows of program_id(1);
    program_id(2) takes chunks_per_split chunks of K (the split-K fix-up of _split_k_store)."""
    F: tl.constexpr = 32 // LB
    E: tl.constexpr = 4 * F
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    ts = pid_t * TT + tl.arange(0, TT)
    tmask = ts < T
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, n_chunks)
    xc = tl.arange(0, S)[:, None] * E + tl.arange(0, 4)[None, :]  # [S, 4]
    x_tile = x_ptr + ts[:, None, None] * x_stride + xc[None, :, :]  # [TT, S, 4]
    acc = tl.zeros([TT, BN, S], dtype=tl.float32)
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
        ch = c0 + tl.arange(0, S)
        cmask = ch < c_end
        xm = tmask[:, None, None] & cmask[None, :, None]  # [TT, S, 1]
        for f in tl.static_range(F):
            if (4 * f) % G == 0:  # the first field of a group: its scales, fresh sums
                a, b = _group_scales(
                    scale_ptr, min_ptr, d_ptr, dmin_ptr, rows, rmask, c0, ch, cmask,
                    grp_stride, sb_stride, f, LB, G, KQUANT, HAS_MIN, PACKED_MIN, CB,
                )  # fmt: skip
                qx = tl.zeros([TT, BN, S], dtype=tl.float32)
                xs = tl.zeros([TT, S], dtype=tl.float32)
            xv = tl.load(x_tile + c0 * E + 4 * f, mask=xm, other=0).to(tl.float32)
            q = _field(words, words >> 16, high, zero, f, LB, HB, OFF, CB)  # [BN, S, 4]
            qx = _fma_words(qx, q, xv)
            if HAS_MIN:
                xs += tl.sum(xv, axis=2)
            if (4 * (f + 1)) % G == 0 or f == F - 1:  # the group's last field in this chunk
                # a, b [BN, S, 1]: summing the unit axis drops it without a reshape
                acc += qx * tl.sum(a, axis=2)[None, :, :]
                if HAS_MIN:
                    acc -= tl.sum(b, axis=2)[None, :, :] * xs[:, None, :]
    part = tl.sum(acc, axis=2)  # [TT, BN]
    _split_k_store(
        part, y_ptr + ts[:, None] * y_stride + rows[None, :], tmask[:, None] & rmask[None, :],
        part_ptr, ts[:, None] * N + rows[None, :], T * N,
        cnt_ptr + pid_n * tl.num_programs(0) + pid_t, pid_k, tl.num_programs(2),
    )  # fmt: skip
