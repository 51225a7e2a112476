"""The Stream-K decode kernel with a row a thread (`streamk`'s "rows" layout; the schedule, the
dp4a and the regrouping are those of `triton_streamk_kernels`).

`qgemv_streamk_kernel` spreads a step's chunks over threads (8 threads a row): each thread pays
for its chunk's scale loads and addresses, 3.3 instructions a weight with dp4a (ptxas, Q4_K,
sm_90), of which 1 is the products. Here a thread takes whole rows: a unit is BN = 32 x warps
rows x `step` codes (256: one K-quant super-block), each thread loading its row's chunks one
16-byte vector at a time ([BN, 4] loads: nothing else to spread but the rows), the super-block's
scales as two vectors and d, dmin once, and the next unit's all of them before this one's math.
A warp's load then touches 32 rows (16 of a 32-byte sector each; the neighbouring chunk's load
takes the other half from L1); the activation words are the same for all 32 (one broadcast).

Imported on first use (imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from hetero.kernels.triton_int_codebook import _table_bytes
from hetero.kernels.triton_qdecode import _shift_to, e8m0_half
from hetero.kernels.triton_streamk_kernels import (
    NO_SPECIALIZE_SK,
    _dp4a,
    _emit,
    _halves,
    _halves_x,
    _next_unit,
    _run,
)


@triton.jit
def _elem(v, i: tl.constexpr, n: tl.constexpr):
    """[BN]: element i of v [BN, n] (n a power of two up to 16, the last dimension held by each
    thread): halved by splits, which only rename registers."""
    out = v
    for level in tl.static_range(4):
        if (n >> level) > 1:
            lo, hi = tl.split(tl.reshape(out, [v.shape[0], n >> (level + 1), 2]))
            if (i >> level) % 2 == 1:
                out = hi
            else:
                out = lo
    return tl.reshape(out, [v.shape[0]])


@triton.jit
def _load_rows_unit(
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr, tile, ks, valid, N, n_chunks,
    code_stride, grp_stride, sb_stride,
    BN: tl.constexpr, S: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, FULL: tl.constexpr,
):  # fmt: skip
    """Unit (tile, ks)'s weights, zeros where not valid: (code words, high words) S-tuples of
    [BN, 4] and [BN, NHW] int32, scales [BN, NG] (and mins), d and dmin [BN] float32."""
    E: tl.constexpr = 128 // LB
    NG: tl.constexpr = (S * E + G - 1) // G  # groups a step
    NHW: tl.constexpr = 4 * HB // LB if HB > 0 else 1
    rows = tile * BN + tl.arange(0, BN)
    c0 = ks * S
    rm = (rows < N) & valid
    base = codes_ptr + rows[:, None] * code_stride + c0 * 4 + tl.arange(0, 4)[None, :]
    hbase = high_ptr + rows[:, None] * (code_stride * HB // LB) + c0 * NHW
    hbase += tl.arange(0, NHW)[None, :]
    words = ()
    high = ()
    for s in tl.static_range(S):
        # no `other`: what masked-off rows hold never reaches y (their sums are not stored)
        if FULL:
            m = rm[:, None]
        else:  # chunks past K must be 0 (the step multiplies them by real activations)
            m = rm[:, None] & (c0 + s < n_chunks)
        words = words + (tl.load(base + 4 * s, mask=m, other=0 if not FULL else None),)
        if HB > 0:
            high = high + (tl.load(hbase + NHW * s, mask=m, other=0 if not FULL else None),)
        else:
            high = high + (tl.zeros([BN, 1], dtype=tl.int32),)
    g0 = c0 * E // G
    gm = rm[:, None]  # (a mask that varies along the groups would split the vector loads)
    if not FULL:
        gm = gm & (g0 + tl.arange(0, NG) < (n_chunks * E + G - 1) // G)[None, :]
    goff = rows[:, None] * grp_stride + g0 + tl.arange(0, NG)[None, :]
    sc = tl.load(scale_ptr + goff, mask=gm, other=0 if not FULL else None)
    mn = sc
    if HAS_MIN and not PACKED_MIN:
        mn = tl.load(min_ptr + goff, mask=gm, other=0 if not FULL else None)
    d = tl.zeros([BN], dtype=tl.float32)
    dmin = d
    if KQUANT:
        sb = rows * sb_stride + (c0 * E) // 256
        d = tl.load(d_ptr + sb, mask=rm).to(tl.float32)
        if HAS_MIN:
            dmin = tl.load(dmin_ptr + sb, mask=rm).to(tl.float32)
    return words, high, sc, mn, d, dmin


@triton.jit
def _lanes(v):
    """[BN, 4] -> its 4 columns [BN] (or [4] -> 4 scalars): splits, which rename registers."""
    if len(v.shape) == 2:
        even, odd = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
    else:
        even, odd = tl.split(tl.reshape(v, [2, 2]))
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    return v0, v1, v2, v3


@triton.jit
def _lane_word(
    w, hw, c: tl.constexpr, j: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr
):  # fmt: skip
    """[BN]: shift j's 4 codes of code word c (lane c), the high bits merged above the low
    ones (hw: the lane's high word; repack.high_bit_places)."""
    J: tl.constexpr = 8 // LB
    if LB == 8:
        q = w
    else:
        q = (w >> (LB * j)) & (((1 << LB) - 1) * 0x01010101)
    if HB > 0:
        h = _shift_to(hw.to(tl.uint32, bitcast=True), HB * ((c * J + j) % (8 // HB)), LB)
        q = q | (h & ((((1 << HB) - 1) << LB) * 0x01010101))
    return q


@triton.jit
def _high_words(h, LB: tl.constexpr, HB: tl.constexpr):
    """The chunk's high words [BN, NHW] -> (word of lanes 0, 1; word of lanes 2, 3)."""
    if HB > 0 and 4 * HB // LB == 2:
        h0, h1 = tl.split(h)
    else:
        h0 = tl.reshape(h, [h.shape[0]])
        h1 = h0
    return h0, h1


@triton.jit
def _chain(q, xh, xl, hi, lo, ASM: tl.constexpr):
    return _dp4a(q, xh, hi, True, ASM), _dp4a(q, xl, lo, False, ASM)


@triton.jit
def _row_units(
    words, high, xb, LB: tl.constexpr, HB: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr
):  # fmt: skip
    """The chunk's integer sums q . m, one [BN] per unit: a 4-tuple (units past NU: 0). Each
    unit's dp4a chain through its lanes into one accumulator a plane. A codebook type (CB > 0)
    multiplies its codes' table values (signed bytes) instead of the codes."""
    J: tl.constexpr = 8 // LB
    w = _lanes(words)
    h01, h23 = _high_words(high, LB, HB)
    hw = (h01, h01, h23, h23)
    xh0 = _lanes(tl.load(xb + tl.arange(0, 4)))
    xl0 = _lanes(tl.load(xb + 4 * J + tl.arange(0, 4)))
    hi = tl.zeros(w[0].shape, dtype=tl.int32)
    lo = hi
    if LB == 8:
        for c in tl.static_range(4):
            hi, lo = _chain(w[c], xh0[c], xl0[c], hi, lo, ASM)
        out = (hi * 256 + lo, 0, 0, 0)
    elif CB > 0:  # 4-bit codes, no high plane
        xh1 = _lanes(tl.load(xb + 4 + tl.arange(0, 4)))
        xl1 = _lanes(tl.load(xb + 4 * J + 4 + tl.arange(0, 4)))
        for c in tl.static_range(4):
            q0, q1 = _table_bytes(w[c], CB, ASM)
            hi = _dp4a(q0, xh0[c], hi, True, ASM, True)
            lo = _dp4a(q0, xl0[c], lo, False, ASM, True)
            hi = _dp4a(q1, xh1[c], hi, True, ASM, True)
            lo = _dp4a(q1, xl1[c], lo, False, ASM, True)
        out = (hi * 256 + lo, 0, 0, 0)
    elif LB == 4 and HB < 2:
        xh1 = _lanes(tl.load(xb + 4 + tl.arange(0, 4)))
        xl1 = _lanes(tl.load(xb + 4 * J + 4 + tl.arange(0, 4)))
        for c in tl.static_range(4):
            hi, lo = _chain(_lane_word(w[c], hw[c], c, 0, LB, HB), xh0[c], xl0[c], hi, lo, ASM)
            hi, lo = _chain(_lane_word(w[c], hw[c], c, 1, LB, HB), xh1[c], xl1[c], hi, lo, ASM)
        out = (hi * 256 + lo, 0, 0, 0)
    elif LB == 4:  # Q6_K: a word a group of 16
        xh1 = _lanes(tl.load(xb + 4 + tl.arange(0, 4)))
        xl1 = _lanes(tl.load(xb + 4 * J + 4 + tl.arange(0, 4)))
        hi1 = hi
        lo1 = hi
        for c in tl.static_range(4):
            g0, g1 = _halves(
                _lane_word(w[c], hw[c], c, 0, LB, HB), _lane_word(w[c], hw[c], c, 1, LB, HB), ASM
            )
            hi, lo = _chain(g0, xh0[c], xl0[c], hi, lo, ASM)
            hi1, lo1 = _chain(g1, xh1[c], xl1[c], hi1, lo1, ASM)
        out = (hi * 256 + lo, hi1 * 256 + lo1, 0, 0)
    else:  # LB 2: the 4 x 4 byte transpose, word g = group g
        out = _units_lb2(w, hw, xb, HB, ASM)
    return out


@triton.jit
def _units_lb2(w, hw, xb, HB: tl.constexpr, ASM: tl.constexpr):
    """`_row_units` for 2-bit codes (Q2_K, Q3_K): 4 groups of 16 a chunk."""
    xh = (
        _lanes(tl.load(xb + tl.arange(0, 4))), _lanes(tl.load(xb + 4 + tl.arange(0, 4))),
        _lanes(tl.load(xb + 8 + tl.arange(0, 4))), _lanes(tl.load(xb + 12 + tl.arange(0, 4))),
    )  # fmt: skip
    xl = (
        _lanes(tl.load(xb + 16 + tl.arange(0, 4))), _lanes(tl.load(xb + 20 + tl.arange(0, 4))),
        _lanes(tl.load(xb + 24 + tl.arange(0, 4))), _lanes(tl.load(xb + 28 + tl.arange(0, 4))),
    )  # fmt: skip
    z = tl.zeros(w[0].shape, dtype=tl.int32)
    h0, l0, h1, l1, h2, l2, h3, l3 = z, z, z, z, z, z, z, z
    for c in tl.static_range(4):
        a, b = _halves_x(
            _lane_word(w[c], hw[c], c, 0, 2, HB), _lane_word(w[c], hw[c], c, 1, 2, HB), ASM
        )
        e, f = _halves_x(
            _lane_word(w[c], hw[c], c, 2, 2, HB), _lane_word(w[c], hw[c], c, 3, 2, HB), ASM
        )
        r0, r2 = _halves(a, e, ASM)
        r1, r3 = _halves(b, f, ASM)
        h0, l0 = _chain(r0, xh[0][c], xl[0][c], h0, l0, ASM)
        h1, l1 = _chain(r1, xh[1][c], xl[1][c], h1, l1, ASM)
        h2, l2 = _chain(r2, xh[2][c], xl[2][c], h2, l2, ASM)
        h3, l3 = _chain(r3, xh[3][c], xl[3][c], h3, l3, ASM)
    return (h0 * 256 + l0, h1 * 256 + l1, h2 * 256 + l2, h3 * 256 + l3)


@triton.jit
def _rows_int_step(
    words, high, sc, mn, d, dmin, xw_ptr, xf_ptr, c0, n_chunks, S: tl.constexpr,
    FULL: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """[BN] float: the unit's share of W x (one thread a row, integer dot products; a codebook
    type's table values, CB > 0)."""
    E: tl.constexpr = 128 // LB
    J: tl.constexpr = 8 // LB
    NU: tl.constexpr = (E + G - 1) // G
    NG: tl.constexpr = (S * E + G - 1) // G
    if PACKED_MIN:  # Q2_K: one byte m << 4 | sc
        mn = sc.to(tl.int32) >> 4
        sc = sc.to(tl.int32) & 15
    if CB == 2:  # MXFP4: the E8M0 byte
        scf = e8m0_half(sc)
    else:
        scf = sc.to(tl.float32)
    mnf = mn.to(tl.float32)
    acc_a = tl.zeros([words[0].shape[0]], dtype=tl.float32)  # sum A' s_b (isum + OFF M)
    acc_b = tl.zeros([words[0].shape[0]], dtype=tl.float32)  # sum B' s_b M
    xw0 = xw_ptr + c0 * (8 * J)  # the step's activation words and floats: one base each,
    xf0 = xf_ptr + c0 * (2 * NU)  # chunk s at a constant offset from it
    for s in tl.static_range(S):
        if FULL:
            xb = xw0 + s * (8 * J)
            xf = xf0 + s * (2 * NU)
        else:  # past K: codes and scales are 0, x any (its floats zeroed below)
            ch = tl.minimum(c0 + s, n_chunks - 1)
            xb = xw_ptr + ch * (8 * J)
            xf = xf_ptr + ch * (2 * NU)
        sums = _row_units(words[s], high[s], xb, LB, HB, CB, ASM)
        for u in tl.static_range(NU):
            s_b, xs = tl.split(tl.load(xf + 2 * u + tl.arange(0, 2)))
            if not FULL:
                xs = tl.where(c0 + s < n_chunks, xs, 0.0)
            v = s_b * sums[u].to(tl.float32)
            if OFF != 0:
                v += OFF * xs
            # group (s E + u E / NU) // G of the step (Q8_0: a group spans two chunks)
            acc_a += _elem(scf, (s * E + u * (E // NU)) // G, NG) * v
            if HAS_MIN:
                acc_b += _elem(mnf, (s * E + u * (E // NU)) // G, NG) * xs
    if KQUANT:
        out = d * acc_a
        if HAS_MIN:
            out -= dmin * acc_b
    else:  # A = d (fp16 scale), B = -m
        out = acc_a
        if HAS_MIN:
            out += acc_b
    return out


# As NO_SPECIALIZE_SK, but grp_stride specialized: divisible by 16, the scale vectors load whole
NO_SPECIALIZE_ROWS = [n for n in NO_SPECIALIZE_SK if n != "grp_stride"]


@triton.jit(do_not_specialize=NO_SPECIALIZE_ROWS)
def qgemv_streamk_rows_kernel(
    x_ptr, xf_ptr, y_ptr, part_ptr, cnt_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    N, n_chunks, KS, U, P, MAXC,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, S: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
    FULL: tl.constexpr,
):  # fmt: skip
    """`qgemv_streamk_kernel`'s grid, schedule and fix-up (integer dot products only, so linear
    codes only: CB = 0) with a row a thread: BN = 32 x num_warps."""
    tl.static_assert(CB == 0, "integer dot products need linear codes")
    u0, u1, tile, ks = _run(U, P, KS, PDL)
    planes = (codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr)
    strides = (code_stride, grp_stride, sb_stride)
    nxt = _load_rows_unit(
        *planes, tile, ks, u0 < u1, N, n_chunks, *strides,
        BN, S, LB, HB, G, KQUANT, HAS_MIN, PACKED_MIN, FULL,
    )  # fmt: skip
    if PDL:
        gdc_wait()
    acc = tl.zeros([BN], dtype=tl.float32)
    for u in range(u0, u1):
        cur = nxt
        tile_n, ks_n, wrap = _next_unit(tile, ks, KS)
        nxt = _load_rows_unit(
            *planes, tile_n, ks_n, u + 1 < u1, N, n_chunks, *strides,
            BN, S, LB, HB, G, KQUANT, HAS_MIN, PACKED_MIN, FULL,
        )  # fmt: skip
        acc += _rows_int_step(
            *cur, x_ptr, xf_ptr, ks * S, n_chunks, S, FULL, LB, HB, G, OFF, KQUANT, HAS_MIN,
            PACKED_MIN, CB, ASM,
        )  # fmt: skip
        end = wrap | (u + 1 == u1)
        if end:
            _emit(acc, y_ptr, part_ptr, cnt_ptr, tile, N, KS, U, P, MAXC, BN)
        acc = tl.where(end, 0.0, acc)
        tile, ks = tile_n, ks_n
