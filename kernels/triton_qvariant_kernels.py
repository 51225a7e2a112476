"""Candidate variants of the packed-GGUF kernels (`triton_qkernels`), for the kernel sweep.

Both keep every load of step i + 1 in flight while step i computes (registers double-buffered),
where the kernels they vary wait a memory latency a step:

    _qgemv_pipe_kernel  decode (`_qgemv_kernel`): the scale planes of the next step are loaded
                        with its code words (the original prefetches the words only, so each
                        step still waited for its scales: one DRAM latency a step, with few steps
                        a program once K is split)
    _qmm_pipe_kernel    tensor cores (`_qmm_kernel`): the next step's code words (and high plane)
                        are loaded before this step's decode and dot (Triton pipelines the loads
                        that feed tl.dot, the activations, but not those decoded first)

Both loop to c_end, not c_begin + chunks_per_split: a short last split runs no empty steps (the
originals' empty steps read the super-block scales d / dmin one row past the row's end, masked
by the row only: past the plane's end for the last row).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_qdecode import _decode_tile, _field, _load_step, e8m0_half
from hetero.kernels.triton_qkernels import NO_SPECIALIZE, _split_k_store


@triton.jit
def _load_scales(
    scale_ptr, min_ptr, d_ptr, dmin_ptr, rows, rmask, c0, c_end, grp_stride, sb_stride,
    S: tl.constexpr, E: tl.constexpr, G: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr,
):  # fmt: skip
    """The raw scale fields of chunks c0 .. c0+S: sc, mn [BN, S, NG] (NG = the groups a chunk
    starts: E / G, or 1 where a group spans chunks) and d, dmin float32 [BN] (1 for legacy
    types). Masked to zero past c_end; nothing converted yet (that waits for the step's use)."""
    NG: tl.constexpr = E // G if E >= G else 1
    j = tl.arange(0, S * NG)
    ch = c0 + j // NG
    if E >= G:
        grp = ch * NG + j % NG
    else:
        grp = ch // (G // E)
    m = rmask[:, None] & (ch < c_end)[None, :]
    gidx = rows[:, None] * grp_stride + grp[None, :]
    sc = tl.load(scale_ptr + gidx, mask=m, other=0)
    mn = sc
    if HAS_MIN and not PACKED_MIN:
        mn = tl.load(min_ptr + gidx, mask=m, other=0)
    d = tl.full([rows.shape[0]], 1.0, tl.float32)
    dmin = d
    if KQUANT:
        dm = rmask & (c0 < c_end)
        sb = rows * sb_stride + (c0 * E) // 256
        d = tl.load(d_ptr + sb, mask=dm, other=0).to(tl.float32)
        if HAS_MIN:
            dmin = tl.load(dmin_ptr + sb, mask=dm, other=0).to(tl.float32)
    BN: tl.constexpr = rows.shape[0]
    return tl.reshape(sc, [BN, S, NG]), tl.reshape(mn, [BN, S, NG]), d, dmin


@triton.jit
def _pick(v, g: tl.constexpr, NG: tl.constexpr):
    """[BN, S, NG] -> [BN, S]: group g of each chunk (splits along a dimension threads hold
    whole, so they only rename registers)."""
    if NG == 1:
        out = tl.reshape(v, [v.shape[0], v.shape[1]])
    elif NG == 2:
        lo, hi = tl.split(v)
        if g == 1:
            out = hi
        else:
            out = lo
    else:  # 4: g = 2 * g1 + g0
        lo, hi = tl.split(tl.reshape(v, [v.shape[0], v.shape[1], 2, 2]))
        if g % 2 == 1:
            half = hi
        else:
            half = lo
        a, b = tl.split(half)
        if g // 2 == 1:
            out = b
        else:
            out = a
    return out


@triton.jit
def _scales_of(
    sc, mn, d, dmin, g: tl.constexpr, NG: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
):  # fmt: skip
    """(A, B) float32 [BN, S, 1] of group g of each chunk, as `_group_scales` forms them."""
    s = _pick(sc, g, NG)
    b = tl.zeros([1, 1], dtype=tl.float32)
    if KQUANT:
        if PACKED_MIN:  # Q2_K: one byte m << 4 | sc
            s = s.to(tl.int32)
            m = s >> 4
            s = s & 15
        a = d[:, None] * s.to(tl.float32)
        if HAS_MIN:
            if not PACKED_MIN:
                m = _pick(mn, g, NG)
            b = dmin[:, None] * m.to(tl.float32)
    else:
        if CB == 2:  # MXFP4: the E8M0 byte
            a = e8m0_half(s)
        else:
            a = s.to(tl.float32)
        if HAS_MIN:
            b = -_pick(mn, g, NG).to(tl.float32)
    return a[:, :, None], b[:, :, None]


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _qgemv_pipe_kernel(
    x_ptr, y_ptr, part_ptr, cnt_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    T, N, n_chunks, chunks_per_split, x_stride, y_stride,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    """`_qgemv_kernel` (same grid, arguments and sums) with the scales prefetched too."""
    F: tl.constexpr = 32 // LB
    E: tl.constexpr = 4 * F
    NG: tl.constexpr = E // G if E >= G else 1
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, n_chunks)
    xc = tl.arange(0, S)[:, None] * E + tl.arange(0, 4)[None, :]  # [S, 4]
    x_row = x_ptr + t * x_stride
    acc = tl.zeros([BN, S, 4], dtype=tl.float32)
    sargs = (scale_ptr, min_ptr, d_ptr, dmin_ptr, rows, rmask)
    n_words, n_high = _load_step(
        codes_ptr, high_ptr, rows, rmask, c_begin, c_end, code_stride, S, LB, HB
    )
    n_sc, n_mn, n_d, n_dmin = _load_scales(
        *sargs, c_begin, c_end, grp_stride, sb_stride, S, E, G, KQUANT, HAS_MIN, PACKED_MIN
    )
    for c0 in range(c_begin, c_end, S):
        words, high, sc, mn, d, dmin = n_words, n_high, n_sc, n_mn, n_d, n_dmin
        n_words, n_high = _load_step(
            codes_ptr, high_ptr, rows, rmask, c0 + S, c_end, code_stride, S, LB, HB
        )
        n_sc, n_mn, n_d, n_dmin = _load_scales(
            *sargs, c0 + S, c_end, grp_stride, sb_stride, S, E, G, KQUANT, HAS_MIN, PACKED_MIN
        )
        cmask = (c0 + tl.arange(0, S)) < c_end
        for f in tl.static_range(F):
            if (4 * f) % G == 0:  # the first field of a group: its scales, fresh sums
                # Group (4f) // G of the chunk (0 where a group spans chunks: Q8_0), passed
                # inline: a constexpr name bound twice in the unrolled loop (Q6_K has two
                # groups a chunk) does not compile
                a, b = _scales_of(
                    sc, mn, d, dmin, (4 * f) // G, NG, KQUANT, HAS_MIN, PACKED_MIN, CB
                )
                qx = tl.zeros([BN, S, 4], dtype=tl.float32)
                xs = tl.zeros([S, 4], dtype=tl.float32)
            xv = tl.load(x_row + c0 * E + 4 * f + xc, mask=cmask[:, None], other=0)
            xv = xv.to(tl.float32)
            qx += _field(words, words >> 16, high, zero, f, LB, HB, OFF, CB) * xv[None, :, :]
            if HAS_MIN:
                xs += xv
            if (4 * (f + 1)) % G == 0 or f == F - 1:  # the group's last field in this chunk
                acc += qx * a
                if HAS_MIN:
                    acc -= b * xs[None, :, :]
    part = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    _split_k_store(
        part, y_ptr + t * y_stride + rows, rmask, part_ptr, t * N + rows, T * N,
        cnt_ptr + pid_n * T + t, pid_k, tl.num_programs(2),
    )  # fmt: skip


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _qmm_pipe_kernel(
    x_ptr, y_ptr, part_ptr, cnt_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    T, N, n_chunks, chunks_per_split, x_stride, y_stride,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, BT: tl.constexpr, S: tl.constexpr, PRECISION: tl.constexpr,
    TRANS: tl.constexpr = False,
):  # fmt: skip
    """`_qmm_kernel` (same grid, arguments and values) with the code words prefetched a step.

    TRANS: acc [BT, BN] = x[ts] @ W[rows]^T, the activations operand A (loaded, so pipelined
    into shared memory) and the decoded tile operand B (Hopper's wgmma reads B from shared
    memory: one store of the tile, no conversion to A's register layout); y stored along N."""
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
    if TRANS:
        acc = tl.zeros([BT, BN], dtype=tl.float32)
    else:
        acc = tl.zeros([BN, BT], dtype=tl.float32)
    n_words, n_high = _load_step(
        codes_ptr, high_ptr, rows, rmask, c_begin, c_end, code_stride, S, LB, HB
    )
    for c0 in range(c_begin, c_end, S):
        words, high = n_words, n_high
        n_words, n_high = _load_step(
            codes_ptr, high_ptr, rows, rmask, c0 + S, c_end, code_stride, S, LB, HB
        )
        ch = c0 + tl.arange(0, S)
        cmask = ch < c_end
        # Written out: the compiler takes no starred items in a tuple display
        sargs = (
            scale_ptr, min_ptr, d_ptr, dmin_ptr, rows, rmask, c0, ch, cmask,
            grp_stride, sb_stride,
        )  # fmt: skip
        w = _decode_tile(words, high, zero, sargs, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB)
        w = w.to(x_ptr.dtype.element_ty)
        k = c0 * E + kk
        if TRANS:
            xm = tmask[:, None] & (k < c_end * E)[None, :]
            xs = tl.load(x_ptr + ts[:, None] * x_stride + k[None, :], mask=xm, other=0)
            acc = tl.dot(xs, tl.trans(w), acc, input_precision=PRECISION)  # [BT, BN]
        else:
            xm = (k < c_end * E)[:, None] & tmask[None, :]
            xt = tl.load(x_ptr + ts[None, :] * x_stride + k[:, None], mask=xm, other=0)
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)  # [BN, BT]
    if TRANS:
        _split_k_store(
            acc, y_ptr + ts[:, None] * y_stride + rows[None, :], tmask[:, None] & rmask[None, :],
            part_ptr, ts[:, None] * N + rows[None, :], T * N, cnt_ptr + tl.program_id(0), pid_k,
            tl.num_programs(1),
        )  # fmt: skip
    else:
        _split_k_store(
            acc, y_ptr + ts[None, :] * y_stride + rows[:, None], rmask[:, None] & tmask[None, :],
            part_ptr, ts[None, :] * N + rows[:, None], T * N, cnt_ptr + tl.program_id(0), pid_k,
            tl.num_programs(1),
        )  # fmt: skip
