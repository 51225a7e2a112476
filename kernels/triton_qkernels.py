"""Triton kernels over packed GGUF weights (layout and formula: `hetero.kernels.repack`).

A program walks W [N, K] in steps of BN rows x S chunks (a chunk: 4 code words, E codes). One
16-byte load per row and chunk gives a thread the words [BN, S, 4]; field f of them is the
weights of elements chunk*E + 4f + c, c < 4, so a static loop over f decodes the step in place:

    v_f  = bitcast(word & (mask << p) | (150 - p) << 23)     (one LOP3; p: the field's bit)
         = 2^(23-p) + q      exactly: the code lands in the mantissa of a float whose exponent
                             makes one mantissa step worth 1 (an int -> float conversion runs at
                             a quarter of the integer rate)
    qf_f = v_f - (2^(23-p) - OFF) = q + OFF                   (exact)
    w_f  = qf_f * A - B                                       (A, B per group: the references')

(The decode kernel never forms w_f: it sums qf_f * x over a group, then applies A and B once.)

Fields whose bits would leave the 23-bit mantissa are read from word >> 16 (one shift a word).
The high-bit plane (Q5_*, Q6_K, Q3_K) is shifted into place next to the low field first.

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


@triton.jit
def _load_step(
    codes_ptr, high_ptr, rows, rmask, c0, c_end, code_stride,
    S: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr,
):  # fmt: skip
    """Chunks c0 .. c0+S (those below c_end) of rows [BN]: the code words [BN, S, 4] int32 and
    the high plane (int32; the words again where the type has none).

    Loaded as [BN, 4S] (contiguous along K, so 16-byte vectors with threads along K first) and
    only then split into chunks: the split keeps every thread's 4 words in place.
    """
    j = tl.arange(0, 4 * S)
    off = rows[:, None] * code_stride + c0 * 4 + j[None, :]
    m = rmask[:, None] & (c0 + j // 4 < c_end)[None, :]
    words = tl.reshape(tl.load(codes_ptr + off, mask=m, other=0), [rows.shape[0], S, 4])
    high = words
    if HB > 0:
        high = tl.load(high_ptr + off, mask=m, other=0).to(tl.int32)
        high = tl.reshape(high, [rows.shape[0], S, 4])
    return words, high


@triton.jit
def _field(
    words, words_hi, high, zero,
    f: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, OFF: tl.constexpr,
):  # fmt: skip
    """float32 q + OFF of field f of every word, exact (see the module docstring).

    `zero` is a run-time 0: with the exponent bits in a register, the compiler emits one LOP3
    (a & mask | c) per code instead of an AND and an OR with two immediates.
    """
    s: tl.constexpr = LB * f
    if s + LB + HB <= 23:
        p: tl.constexpr = s
        src = words
    else:
        p: tl.constexpr = s - 16
        src = words_hi
    bits = src & (((1 << LB) - 1) << p)
    if HB > 0:
        hpos: tl.constexpr = p + LB  # the high bits' place above the low field
        if hpos >= HB * f:
            h = high << (hpos - HB * f)
        else:
            h = high >> (HB * f - hpos)
        bits = bits | (h & (((1 << HB) - 1) << hpos))
    v = (bits | (((150 - p) << 23) + zero)).to(tl.float32, bitcast=True)
    return v - ((1 << (23 - p)) - OFF)


@triton.jit
def _group_scales(
    scale_ptr, min_ptr, d_ptr, dmin_ptr, rows, rmask, c0, ch, cmask, grp_stride, sb_stride,
    f: tl.constexpr, LB: tl.constexpr, G: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr,
):  # fmt: skip
    """(A, B) float32 [BN, S, 1] of the group holding field f of chunks ch [S] (B: only with
    mins). A chunk holds E / G groups (E >= G), or is part of one (Q8_0: E = 16, G = 32).

    The callers' steps never cross a 256-code super-block, so d and dmin are one value a row:
    [BN] loads, cheap to place in any layout (the [BN, S] ones cost a layout conversion).
    """
    E: tl.constexpr = 4 * (32 // LB)
    if E >= G:
        grp = ch * (E // G) + (4 * f) // G
    else:
        grp = ch // (G // E)
    m = rmask[:, None] & cmask[None, :]
    gidx = rows[:, None] * grp_stride + grp[None, :]
    b = tl.zeros([1, 1], dtype=tl.float32)  # unused unless HAS_MIN
    if KQUANT:
        sb = rows * sb_stride + (c0 * E) // 256
        d = tl.load(d_ptr + sb, mask=rmask, other=0).to(tl.float32)[:, None]
        sc = tl.load(scale_ptr + gidx, mask=m, other=0)
        if PACKED_MIN:  # Q2_K: one byte m << 4 | sc
            sc = sc.to(tl.int32)
            mn = sc >> 4
            sc = sc & 15
        a = d * sc.to(tl.float32)
        if HAS_MIN:
            if not PACKED_MIN:
                mn = tl.load(min_ptr + gidx, mask=m, other=0)
            dmin = tl.load(dmin_ptr + sb, mask=rmask, other=0).to(tl.float32)[:, None]
            b = dmin * mn.to(tl.float32)
    else:
        a = tl.load(scale_ptr + gidx, mask=m, other=0).to(tl.float32)
        if HAS_MIN:
            b = -tl.load(min_ptr + gidx, mask=m, other=0).to(tl.float32)
    return a[:, :, None], b[:, :, None]


@triton.jit
def _leaf(
    words, high, zero, a, b, f: tl.constexpr,
    LB: tl.constexpr, HB: tl.constexpr, OFF: tl.constexpr, HAS_MIN: tl.constexpr,
):  # fmt: skip
    w = _field(words, words >> 16, high, zero, f, LB, HB, OFF) * a
    if HAS_MIN:
        w = w - b
    return w


# Fields f0 .. f0+n-1 dequantized and joined into [BN, S, 4, 2, ..., 2]: one trailing 2 per bit
# of f - f0, the most significant last. The node whose n fields make exactly one group (4n = G)
# loads the group's scales. (Triton compiles no recursion: one function per level.)


@triton.jit
def _pair(
    words, high, zero, a, b, sargs, f0: tl.constexpr,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr,
):  # fmt: skip
    lo = _leaf(words, high, zero, a, b, f0, LB, HB, OFF, HAS_MIN)
    hi = _leaf(words, high, zero, a, b, f0 + 1, LB, HB, OFF, HAS_MIN)
    return tl.join(lo, hi)


@triton.jit
def _quad(
    words, high, zero, a, b, sargs, f0: tl.constexpr,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr,
):  # fmt: skip
    if G == 16:
        a, b = _group_scales(*sargs, f0, LB, G, KQUANT, HAS_MIN, PACKED_MIN)
    lo = _pair(words, high, zero, a, b, sargs, f0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
    hi = _pair(words, high, zero, a, b, sargs, f0 + 2, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
    return tl.join(lo, hi)


@triton.jit
def _oct(
    words, high, zero, a, b, sargs, f0: tl.constexpr,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr,
):  # fmt: skip
    if G == 32:
        a, b = _group_scales(*sargs, f0, LB, G, KQUANT, HAS_MIN, PACKED_MIN)
    lo = _quad(words, high, zero, a, b, sargs, f0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
    hi = _quad(words, high, zero, a, b, sargs, f0 + 4, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
    return tl.join(lo, hi)


@triton.jit
def _hex(
    words, high, zero, a, b, sargs, f0: tl.constexpr,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr,
):  # fmt: skip
    lo = _oct(words, high, zero, a, b, sargs, f0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
    hi = _oct(words, high, zero, a, b, sargs, f0 + 8, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
    return tl.join(lo, hi)


@triton.jit
def _decode_tile(
    words, high, zero, sargs,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr,
):  # fmt: skip
    """float32 [BN, S*E]: the step's weights in element order. The joins and the permute only
    rename registers: every thread holds all fields of its words."""
    F: tl.constexpr = 32 // LB
    BN: tl.constexpr = words.shape[0]
    S: tl.constexpr = words.shape[1]
    a = tl.zeros([1, 1, 1], dtype=tl.float32)  # placeholders: the node of a group loads them
    b = a
    if F == 4:  # Q8_0: a chunk is half a group
        a, b = _group_scales(*sargs, 0, LB, G, KQUANT, HAS_MIN, PACKED_MIN)
        w = _quad(words, high, zero, a, b, sargs, 0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
        w = tl.permute(w, (0, 1, 4, 3, 2))
    elif F == 8:
        w = _oct(words, high, zero, a, b, sargs, 0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
        w = tl.permute(w, (0, 1, 5, 4, 3, 2))
    else:
        w = _hex(words, high, zero, a, b, sargs, 0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
        w = tl.permute(w, (0, 1, 6, 5, 4, 3, 2))
    return tl.reshape(w, [BN, S * 4 * F])


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


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _qgemv_kernel(
    x_ptr, y_ptr, part_ptr, cnt_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    T, N, n_chunks, chunks_per_split, x_stride, y_stride,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr,
    BN: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    """y[t, rows] for t = program_id(0) (adjacent programs share a weight tile: one DRAM read);
    program_id(2) takes chunks_per_split chunks of K (see _split_k_store).

    The scales are factored out of each group's sum: sum_k (q_k + OFF) x_k, then times A, minus
    B * sum_k x_k. The products A * (q + OFF) are exact, so this is the reference's sum of
    x * w in another order (it skips the one float32 rounding of w = A(q + OFF) - B), for three
    instructions a weight instead of four: decode is as much instruction- as memory-bound.
    """
    F: tl.constexpr = 32 // LB
    E: tl.constexpr = 4 * F
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
        ch = c0 + tl.arange(0, S)
        cmask = ch < c_end
        for f in tl.static_range(F):
            if (4 * f) % G == 0:  # the first field of a group: its scales, fresh sums
                a, b = _group_scales(
                    scale_ptr, min_ptr, d_ptr, dmin_ptr, rows, rmask, c0, ch, cmask,
                    grp_stride, sb_stride, f, LB, G, KQUANT, HAS_MIN, PACKED_MIN,
                )  # fmt: skip
                qx = tl.zeros([BN, S, 4], dtype=tl.float32)
                xs = tl.zeros([S, 4], dtype=tl.float32)
            xv = tl.load(x_row + c0 * E + 4 * f + xc, mask=cmask[:, None], other=0)
            xv = xv.to(tl.float32)
            qx += _field(words, words >> 16, high, zero, f, LB, HB, OFF) * xv[None, :, :]
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
def _qmm_kernel(
    x_ptr, y_ptr, part_ptr, cnt_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    T, N, n_chunks, chunks_per_split, x_stride, y_stride,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr,
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
        w = _decode_tile(words, high, zero, sargs, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
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
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr,
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
    w = _decode_tile(words, high, zero, sargs, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
    k = c0 * E + tl.arange(0, S * E)
    optr = out_ptr + rows.to(tl.int64)[:, None] * out_stride + k[None, :]
    tl.store(
        optr, w.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (k < n_chunks * E)[None, :]
    )
