"""The sorted MoE blocks of 4- and 6-bit codes on the tensor cores, the weights decoded where
the tensor cores read them (Gluon: Triton's language with explicit layouts).

`_moe_mm_kernel` (triton_moe_kernels) decodes a step's weights in element order and Triton
hands them to the tensor cores through shared memory (a store and an ldmatrix of every decoded
weight, each a 16-bit float: on the H200 the L1 / shared pipe was its busiest unit, 71%, and
about four instructions a weight went into the decode). Here every thread loads exactly the
code words whose weights it holds in the mma.sync A fragments (m16n8k16, bf16 / fp16), decodes
them in its registers and multiplies; nothing of the weights touches shared memory.

The fragment layout: a thread (lane l, g = l / 4, t = l % 4) of a warp's 16 rows holds, for one
k-step of 16, rows g and g + 8 at columns 2t, 2t + 1, 2t + 8, 2t + 9: four 32-bit registers, each
a pair of columns (2p, 2p + 1), p = t or t + 4. A 4-bit code word holds fields f and f + 4 in its
bits 4f and 4f + 16, so one shift and one LOP3 make both as 16-bit floats BIAS + q (MAGIC: the
exponent where a mantissa step is 1; exact). A step is 4 chunks of 32 codes, thread t takes
chunk t whole (its 4 words in one 16-byte load, its 32 elements of x in four), and k-step
(s_hi, w), 8 of them, is

    pair p = 4 p4 + t   =  (word w of chunk t >> 4 (2 s_hi + p4)) & 0x000F000F | MAGIC
    column 2p + h       =  element 16h + 8 s_hi + 4 p4 + w of chunk t

x's fragments are those elements of its loaded chunk: registers renamed, no data moved (the
layout conversions are asserted trivial at compile time). Two packed FMAs finish the weights,
two at a time: (BIAS + q) - (BIAS - OFF) = q + OFF (exact), then (q + OFF) A - B with A and B of
the group rounded to the 16-bit type. That last rounding (relative 2^-9 in bf16 on A, the same
on B) is the one difference from the references' formula A (q + OFF) - B in float32 rounded
once. Q6_K's two high bits a code come from its high plane ("fields" arrangement), shifted next
to the low ones, and a pair's halves lie in the chunk's two groups of 16: each takes its own A.

Types: Q4_K, Q4_0, Q4_1 and Q6_K, 16-bit x, K in steps of 128, sm_80 and later. Gluon compiles
but does not run under Triton's interpreter: tests/kernels/test_gluon_moe.py compiles it for each
target architecture on any machine and compares it with the reference where CUDA is.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


@gluon.jit
def _bf16x2_fma(a, b, c, FP16: gl.constexpr):
    """a * b + c on pairs of 16-bit floats packed in int32 words, rounded once (PTX fma)."""
    if FP16:
        return gl.inline_asm_elementwise(
            "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], gl.int32, True, 1
        )
    return gl.inline_asm_elementwise(
        "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], gl.int32, True, 1
    )


@gluon.jit
def _pack2(v, FP16: gl.constexpr):
    """float32 v -> the int32 word of (v, v) as 16-bit floats, rounded to nearest."""
    if FP16:
        return gl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $1, $1;", "=r,r", [v], gl.int32, True, 1
        )
    return gl.inline_asm_elementwise(
        "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,r", [v], gl.int32, True, 1
    )


@gluon.jit
def _pack2x(lo, hi, FP16: gl.constexpr):
    """float32 (lo, hi) -> the int32 word of the two as 16-bit floats, lo in the low half."""
    if FP16:
        return gl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], gl.int32, True, 1
        )
    return gl.inline_asm_elementwise(
        "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], gl.int32, True, 1
    )


@gluon.jit
def _shl(v, n: gl.constexpr):
    """v << n, or v >> -n for n < 0 (a constant shift either way)."""
    if n >= 0:
        return v << n
    return v >> (-n)


@gluon.jit
def _halves(w, HT: gl.constexpr):
    """int32 [R, C] pairs -> [R, 2C] of dtype HT: column 2p + h is half h of pair p."""
    if HT == gl.float16:
        lo, hi = gl.inline_asm_elementwise(
            "mov.b32 {$0, $1}, $2;", "=h,=h,r", [w], (gl.float16, gl.float16), True, 1
        )
    else:
        lo, hi = gl.inline_asm_elementwise(
            "mov.b32 {$0, $1}, $2;", "=h,=h,r", [w], (gl.bfloat16, gl.bfloat16), True, 1
        )
    return gl.reshape(gl.join(lo, hi), [w.shape[0], 2 * w.shape[1]])


@functools.cache  # (built once a shape: a prompt's eager calls would rebuild them a layer)
def tile_layouts(warps: int, m_tiles: int, bt: int) -> tuple:
    """(W, S, X) linear layouts of a step's loads for `moe_mm_mma_kernel`, BN = 16 warps
    m_tiles rows: W [BN, 4, 4] code words (row, chunk t, word), S [BN, 4] the chunks' scales,
    X [BT, 4, 32] x (slot column, chunk t, element). Lane l holds chunk t = l % 4 of rows
    (or slot columns) l / 4 (+ 8 in a register), as the mma.sync fragments place them; a
    chunk's 4 words, and its 32 elements of x, in one thread's registers (16-byte loads)."""
    lanes = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
    warp_rows = [[16 << i, 0] for i in range(warps.bit_length() - 1)]
    tile_rows = [[8, 0]] + [[16 * warps << i, 0] for i in range(m_tiles.bit_length() - 1)]
    bn = 16 * warps * m_tiles
    s = gl.DistributedLinearLayout(tile_rows, lanes, warp_rows, [], [bn, 4])
    w = gl.DistributedLinearLayout(
        [[0, 0, 1], [0, 0, 2]] + [b + [0] for b in tile_rows],
        [b + [0] for b in lanes], [b + [0] for b in warp_rows], [], [bn, 4, 4],
    )  # fmt: skip
    cols = [[8 << i, 0, 0] for i in range((bt // 8).bit_length() - 1)]
    x = gl.DistributedLinearLayout(
        [[0, 0, 1 << i] for i in range(5)] + cols,
        [b + [0] for b in lanes], [[0, 0, 0]] * len(warp_rows), [], [bt, 4, 32],
    )  # fmt: skip
    return w, s, x


@gluon.jit
def _range3(n: gl.constexpr, dim: gl.constexpr, L: gl.constexpr):
    """arange(n) placed along dim of a rank-3 layout L, broadcastable against it."""
    if dim == 0:
        r = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        return r[:, None, None]
    elif dim == 1:
        r = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
        return r[None, :, None]
    else:
        r = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
        return r[None, None, :]


@gluon.jit
def _split4(v):
    """[.., 4] -> its 4 slices [..] (register renames: the dimension is in one thread)."""
    v = gl.reshape(v, v.shape[:-1] + [2, 2])
    lo, hi = gl.split(v)
    w0, w2 = gl.split(lo)
    w1, w3 = gl.split(hi)
    return w0, w1, w2, w3


@gluon.jit
def _b_operand(xs, s_hi: gl.constexpr, w: gl.constexpr, B_L: gl.constexpr):
    """The B fragment [16, BT] of k-step (s_hi, w) from the step's x [BT, 4, 32]: column kk =
    8 p4 + 2t + h is element 16h + 8 s_hi + 4 p4 + w of chunk t."""
    bt: gl.constexpr = xs.shape[0]
    v = gl.reshape(xs, [bt, 4, 2, 2, 2, 4])  # n, t, h, s_hi, p4, w
    v = gl.permute(v, [0, 1, 2, 4, 3, 5])  # n, t, h, p4, s_hi, w
    v = gl.reshape(v, [bt, 4, 2, 2, 2, 2, 2])  # .., s_hi, w1, w0
    v0, v1 = gl.split(v)
    v = v1 if w % 2 == 1 else v0
    v0, v1 = gl.split(v)
    v = v1 if w // 2 == 1 else v0
    v0, v1 = gl.split(v)
    v = v1 if s_hi == 1 else v0  # [BT, t, h, p4]
    v = gl.permute(v, [3, 1, 2, 0])  # p4, t, h, n
    return gl.convert_layout(gl.reshape(v, [16, bt]), B_L, assert_trivial=True)


@gluon.jit
def _spread_high(h):
    """int16 high words (field f's 2 bits at 2f) -> int32 with fields 4..7 moved up by 8: field
    f' < 4 at bit 2f', field f' + 4 at bit 2f' + 16, as the pairs of low codes lie."""
    h = h.to(gl.int32) & 0xFFFF
    return (h & 0x00FF) | ((h & 0xFF00) << 8)


@gluon.jit
def _words4(words, S_L: gl.constexpr):
    """[BN, 4, 4] words (row, chunk t, word) -> its 4 words [BN, 4] in S_L (register renames:
    a chunk's words are in one thread)."""
    w0, w1, w2, w3 = _split4(words)
    w0 = gl.convert_layout(w0, S_L, assert_trivial=True)
    w1 = gl.convert_layout(w1, S_L, assert_trivial=True)
    w2 = gl.convert_layout(w2, S_L, assert_trivial=True)
    w3 = gl.convert_layout(w3, S_L, assert_trivial=True)
    return w0, w1, w2, w3


@gluon.jit
def _neg_bias(OFF: gl.constexpr, FP16: gl.constexpr, BN: gl.constexpr, S_L: gl.constexpr):
    """The pair (OFF - BIAS, OFF - BIAS) as 16-bit floats, [BN, 4]: BIAS + q plus it is q + OFF
    (BIAS: the exponent of MAGIC's pair, where a mantissa step is 1)."""
    BIAS: gl.constexpr = 1024.0 if FP16 else 128.0
    return _pack2(gl.full([BN, 4], OFF - BIAS, gl.float32, S_L), FP16)


@gluon.jit
def _scale_loads(
    s_base, m_base, d_base, dm_base, c0, g_off, sb_off,
    G: gl.constexpr, KQUANT: gl.constexpr, HAS_MIN: gl.constexpr,
):  # fmt: skip
    """The step's scale fields as stored, (sc, sc2, d, dmin, mn): sc [BN, 4] the chunks' first
    groups', sc2 their second's (G 16), d and dmin [BN] (K-quants), mn [BN, 4] (types with
    mins); a field the type lacks is sc again (never read). `_scale_pairs` finishes them: apart,
    a kernel can load a step ahead and do the arithmetic when the step comes."""
    GC: gl.constexpr = 32 // G  # groups a chunk
    sc = gl.load(s_base + GC * c0 + g_off)
    sc2 = sc
    d = sc
    dmin = sc
    mn = sc
    if KQUANT:
        d = gl.load(d_base + c0 // 8 + sb_off)
        if G == 16:  # the chunk's second group
            sc2 = gl.load(s_base + (GC * c0 + 1) + g_off)
        if HAS_MIN:
            dmin = gl.load(dm_base + c0 // 8 + sb_off)
            mn = gl.load(m_base + c0 + g_off)
    elif HAS_MIN:
        mn = gl.load(m_base + c0 + g_off)
    return sc, sc2, d, dmin, mn


@gluon.jit
def _scale_pairs(
    sc, sc2, d, dmin, mn,
    G: gl.constexpr, KQUANT: gl.constexpr, HAS_MIN: gl.constexpr, FP16: gl.constexpr,
    BN: gl.constexpr, S_L: gl.constexpr,
):  # fmt: skip
    """(A, -B) of the step's chunks [BN, 4] as pairs of 16-bit floats (G 16: a pair's halves
    from the chunk's two groups), w = (q + OFF) A - B, from `_scale_loads`' fields."""
    if KQUANT:
        df = d.to(gl.float32)[:, None]
        a = df * sc.to(gl.float32)
        if G == 16:
            a_hi = df * sc2.to(gl.float32)
        if HAS_MIN:
            b = dmin.to(gl.float32)[:, None] * mn.to(gl.float32)
    else:
        a = sc.to(gl.float32)
        if HAS_MIN:
            b = -mn.to(gl.float32)
    if G == 16:
        a2 = _pack2x(a, a_hi, FP16)
    else:
        a2 = _pack2(a, FP16)
    if HAS_MIN:
        nb2 = _pack2(-b, FP16)
    else:
        nb2 = gl.zeros([BN, 4], gl.int32, S_L)
    return a2, nb2


@gluon.jit
def _step_scales(
    s_base, m_base, d_base, dm_base, c0, g_off, sb_off,
    G: gl.constexpr, KQUANT: gl.constexpr, HAS_MIN: gl.constexpr, FP16: gl.constexpr,
    BN: gl.constexpr, S_L: gl.constexpr,
):  # fmt: skip
    """`_scale_pairs` of `_scale_loads`: step c0's (A, -B) pairs [BN, 4]."""
    sc, sc2, d, dmin, mn = _scale_loads(
        s_base, m_base, d_base, dm_base, c0, g_off, sb_off, G, KQUANT, HAS_MIN
    )
    return _scale_pairs(sc, sc2, d, dmin, mn, G, KQUANT, HAS_MIN, FP16, BN, S_L)


@gluon.jit
def _a_fragment(q0, q1, a2, nb2, neg_bias, FP16: gl.constexpr, A_L: gl.constexpr):
    """The A fragment [BN, 16] of one k-step from its pairs q0 (p4 = 0), q1 (p4 = 1): int32
    [BN, 4] words of two codes as BIAS + q 16-bit floats; two packed FMAs make (q + OFF) A - B,
    pair p = 4 p4 + t."""
    HT: gl.constexpr = gl.float16 if FP16 else gl.bfloat16
    ONE2: gl.constexpr = 0x3C003C00 if FP16 else 0x3F803F80
    q0 = _bf16x2_fma(_bf16x2_fma(q0, ONE2, neg_bias, FP16), a2, nb2, FP16)
    q1 = _bf16x2_fma(_bf16x2_fma(q1, ONE2, neg_bias, FP16), a2, nb2, FP16)
    q = gl.reshape(gl.permute(gl.join(q0, q1), [0, 2, 1]), [q0.shape[0], 8])
    return gl.convert_layout(_halves(q, HT), A_L, assert_trivial=True)


@gluon.jit
def moe_mm_mma_kernel(
    x_ptr, y_ptr, sorted_ptr, expert_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    N, n_chunks, n_slots, x_div, x_stride, y_stride,
    code_stride, grp_stride, sb_stride,
    HB: gl.constexpr, G: gl.constexpr, OFF: gl.constexpr, KQUANT: gl.constexpr,
    HAS_MIN: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, WARPS: gl.constexpr,
    W_L: gl.constexpr, S_L: gl.constexpr, X_L: gl.constexpr,
):  # fmt: skip
    """`_moe_mm_kernel`'s contract (program (block, tile of BN rows)), 4 chunks (128 codes) a
    step, n_chunks a multiple of 4. BN = 16 WARPS m-tiles: each warp repeats its 16-row
    fragment over the m-tiles, which share its x fragments. Thread t of a lane quad takes chunk
    t of the step, whole: k-step (s_hi, w) of the 8 is word w of each thread's chunk shifted by
    4 (2 s_hi + p4), pair p = 4 p4 + t. Rows past N read the expert's row N - 1 and padding
    slots x's row 0 (their sums are never stored): the loop reads without masks.

    HB 2 (Q6_K: G 16, the high plane in the "fields" arrangement, an int16 a code word): each
    pair's two high-bit fields are shifted next to its low codes (two more instructions a pair),
    and the pair's halves, in the chunk's two groups of 16, take their own group's scale."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    HT: gl.constexpr = x_ptr.dtype.element_ty
    FP16: gl.constexpr = HT == gl.float16
    MAGIC: gl.constexpr = 0x64006400 if FP16 else 0x43004300
    GC: gl.constexpr = 32 // G  # groups a chunk

    blk = gl.program_id(0)
    e = gl.load(expert_ptr + blk)
    if e < 0:
        return
    pid_n = gl.program_id(1)
    row0 = e.to(gl.int64) * N  # the expert's first row
    # code words [BN, 4, 4]: row r (clamped into the expert), chunk t, word
    r3 = gl.minimum(pid_n * BN + _range3(BN, 0, W_L), N - 1)
    w_off = r3 * code_stride + _range3(4, 1, W_L) * 4 + _range3(4, 2, W_L)
    # scales [BN, 4]: row r, chunk t (its first group)
    r2 = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, S_L)), N - 1)
    t2 = gl.arange(0, 4, layout=gl.SliceLayout(0, S_L))
    g_off = r2[:, None] * grp_stride + GC * t2[None, :]
    sb_off = r2 * sb_stride
    # x [BT, 4, 32]: slot column n, chunk t, element
    slots = gl.load(sorted_ptr + blk * BT + _range3(BT, 0, X_L))
    xrow = gl.where(slots < n_slots, slots // x_div, 0)
    x_off = xrow * x_stride + _range3(4, 1, X_L) * 32 + _range3(32, 2, X_L)
    w_base = codes_ptr + row0 * code_stride
    h_base = high_ptr + row0 * code_stride
    s_base = scale_ptr + row0 * grp_stride
    m_base = min_ptr + row0 * grp_stride
    d_base = d_ptr + row0 * sb_stride
    dm_base = dmin_ptr + row0 * sb_stride
    neg_bias = _neg_bias(OFF, FP16, BN, S_L)
    acc = gl.zeros([BN, BT], gl.float32, MMA)
    for c0 in range(0, n_chunks, 4):
        words = gl.load(w_base + c0 * 4 + w_off)
        xs = gl.load(x_ptr + c0 * 32 + x_off)
        a2, nb2 = _step_scales(
            s_base, m_base, d_base, dm_base, c0, g_off, sb_off, G, KQUANT, HAS_MIN, FP16, BN, S_L
        )
        w0, w1, w2, w3 = _words4(words, S_L)
        if HB > 0:
            h0, h1, h2, h3 = _words4(_spread_high(gl.load(h_base + c0 * 4 + w_off)), S_L)
        for s_hi in gl.static_range(2):
            for w in gl.static_range(4):
                if w == 0:
                    ww = w0
                    if HB > 0:
                        hh = h0
                elif w == 1:
                    ww = w1
                    if HB > 0:
                        hh = h1
                elif w == 2:
                    ww = w2
                    if HB > 0:
                        hh = h2
                else:
                    ww = w3
                    if HB > 0:
                        hh = h3
                q0 = ((ww >> (8 * s_hi)) & 0x000F000F) | MAGIC
                q1 = ((ww >> (8 * s_hi + 4)) & 0x000F000F) | MAGIC
                if HB > 0:  # field f's high bits (at 2f of hh) to bits 4, 5 of its code
                    q0 = q0 | (_shl(hh, 4 - 2 * (2 * s_hi)) & 0x00300030)
                    q1 = q1 | (_shl(hh, 4 - 2 * (2 * s_hi + 1)) & 0x00300030)
                wa = _a_fragment(q0, q1, a2, nb2, neg_bias, FP16, A_L)
                acc = mma_v2(wa, _b_operand(xs, s_hi, w, B_L), acc)
    r_o = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    slots_o = gl.load(sorted_ptr + blk * BT + gl.arange(0, BT, layout=gl.SliceLayout(0, MMA)))
    dst = y_ptr + slots_o.to(gl.int64)[None, :] * y_stride + r_o[:, None]
    mask = (r_o < N)[:, None] & (slots_o < n_slots)[None, :]
    gl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=mask)
