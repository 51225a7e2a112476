"""Stream-K decode kernel over packed GGUF weights (wrappers, schedule and layouts:
`hetero.kernels.streamk`; the packed planes: `repack`; the integer activations: `xquant`).

One token, y = W x: a program walks a contiguous run of work units, each BN rows x S chunks of
K, row tile after row tile (unit u = tile * KS + ks); the P programs (all resident at once) get
runs of equal length, so no SM idles at the end of a wave, whatever N and K. A row tile's sum is
finished in registers where one program holds all its units, else by the split-K fix-up.

Per unit, two ways to multiply (INT_DOT):

    float   the float decode of `_qgemv_kernel` (triton_qdecode._field: three instructions a
            weight: a LOP3 into a float's mantissa, a subtraction, an FMA)
    integer dp4a on the codes: the word (c >> LB*q) & mask holds 4 codes, one per byte; against a
            word of 4 activation bytes (xquant) one dp4a sums their products. The high plane
            ("bytes" arrangement) is merged by one shift and one LOP3 a word. Q6_K, Q2_K, Q3_K
            regroup bytes first so that a word stays in one group of 16. Per group:
            A s_b (256 sum q hi + sum q lo + OFF sum m) - B s_b sum m

Imported on first use (imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from hetero.kernels.triton_qdecode import _float_chunks, _load_step, _shift_to
from hetero.kernels.triton_qkernels import _split_k_store


@triton.jit
def _dp4a(
    a, b, acc, SIGNED_B: tl.constexpr, ASM: tl.constexpr, SIGNED_A: tl.constexpr = False
):  # fmt: skip
    """acc + sum over bytes i of a_i * b_i (a's bytes unsigned, or signed: the codebook types'
    table values; b's signed or unsigned). ASM: the PTX instruction; else the same integer sum
    in plain ops (the interpreter)."""
    if ASM:
        args = [a, b, acc]
        if SIGNED_A and SIGNED_B:
            r = tl.inline_asm_elementwise(
                "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", args, tl.int32, True, 1
            )
        elif SIGNED_A:
            r = tl.inline_asm_elementwise(
                "dp4a.s32.u32 $0, $1, $2, $3;", "=r,r,r,r", args, tl.int32, True, 1
            )
        elif SIGNED_B:
            r = tl.inline_asm_elementwise(
                "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", args, tl.int32, True, 1
            )
        else:
            r = tl.inline_asm_elementwise(
                "dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r", args, tl.int32, True, 1
            )
    else:
        r = acc
        for i in tl.static_range(4):
            if SIGNED_A:
                ai = (a << (24 - 8 * i)) >> 24
            else:
                ai = (a >> (8 * i)) & 255
            if SIGNED_B:
                bi = (b << (24 - 8 * i)) >> 24
            else:
                bi = (b >> (8 * i)) & 255
            r = r + ai * bi
    return r


@triton.jit
def _code_word(words, high, j: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr):
    """[BN, S, 4] int32: shift j's bytes of each code word, the high bits merged above the low
    ones (byte k: the code of element 4(kJ + j) + c)."""
    J: tl.constexpr = 8 // LB
    if LB == 8:
        q = words
    else:
        q = (words >> (LB * j)) & (((1 << LB) - 1) * 0x01010101)
    if HB > 0:  # lane c's bits at HB (t % TW) of each byte, t = cJ + j
        even, odd = tl.split(tl.reshape(high, [high.shape[0], high.shape[1], 2, 2]))
        h0, h2 = tl.split(even)
        h1, h3 = tl.split(odd)
        TW: tl.constexpr = 8 // HB
        s0 = _shift_to(h0, HB * ((0 * J + j) % TW), LB)  # constant shifts, lane by lane
        s1 = _shift_to(h1, HB * ((1 * J + j) % TW), LB)
        s2 = _shift_to(h2, HB * ((2 * J + j) % TW), LB)
        s3 = _shift_to(h3, HB * ((3 * J + j) % TW), LB)
        h = tl.reshape(tl.join(tl.join(s0, s2), tl.join(s1, s3)), q.shape)
        q = q | (h & ((((1 << HB) - 1) << LB) * 0x01010101))
    return q


@triton.jit
def _prmt(a, b, sel: tl.constexpr, ASM: tl.constexpr):
    """Bytes of (a, b) (bytes 0-3: a's, 4-7: b's) picked by the 4 nibbles of sel, low first
    (PTX prmt; the interpreter: shifts and masks)."""
    if ASM:
        out = tl.inline_asm_elementwise(
            f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
            pack=1,
        )  # fmt: skip
    else:
        out = tl.zeros_like(a)
        for i in tl.static_range(4):
            k: tl.constexpr = (sel >> (4 * i)) & 7
            if k < 4:
                byte = (a >> (8 * k)) & 255
            else:
                byte = (b >> (8 * (k - 4))) & 255
            out = out | (byte << (8 * i))
    return out


@triton.jit
def _halves(lo, hi, ASM: tl.constexpr):
    """Words of bytes (lo0 lo1 hi0 hi1) and (lo2 lo3 hi2 hi3): a word of 4 bytes split by
    groups of 16 elements (Q6_K)."""
    return _prmt(lo, hi, 0x5410, ASM), _prmt(lo, hi, 0x7632, ASM)


@triton.jit
def _dot_word(q, xw_ptr, xoff, w: tl.constexpr, J: tl.constexpr, hi, lo, ASM: tl.constexpr):
    """(hi, lo) + dp4a of code words q [BN, S, 4] with the hi and lo activation words w of the
    step's chunks (xoff [S, 4]: each chunk's first activation word + c)."""
    xh = tl.load(xw_ptr + xoff + 4 * w)[None, :, :]
    xl = tl.load(xw_ptr + xoff + (4 * J + 4 * w))[None, :, :]
    return _dp4a(q, xh, hi, True, ASM), _dp4a(q, xl, lo, False, ASM)


@triton.jit
def _isum(hi, lo):
    """[BN, S] int32: sum q m = 256 sum q hi + sum q lo over the 4 code words."""
    return tl.sum(hi * 256 + lo, axis=2)


@triton.jit
def _halves_x(lo, hi, ASM: tl.constexpr):
    """Byte-interleave: (lo0 hi0 lo2 hi2) and (lo1 hi1 lo3 hi3)."""
    return _prmt(lo, hi, 0x6240, ASM), _prmt(lo, hi, 0x7351, ASM)


@triton.jit
def _unit_value(
    isum, g: tl.constexpr, xf_ptr, chs, rows, rmask, ch, cmask, c0,
    scale_ptr, min_ptr, d_ptr, dmin_ptr, grp_stride, sb_stride,
    LB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr,
):  # fmt: skip
    """[BN, S] float: unit g of each chunk, A s_b (isum + OFF M) - B s_b M, with A and B as
    `triton_qdecode._group_scales` forms them.

    The scale loads are [BN, S] with the row stride unspecialized: the compiler lays them out
    one element a thread, threads along S first, which is the integer sums' layout (a layout
    of their own would move the sums through shared memory every step).
    """
    E: tl.constexpr = 128 // LB
    NU: tl.constexpr = (E + G - 1) // G  # units a chunk (a unit: one scale's codes)
    if E >= G:  # no division: it would hide from the compiler that grp runs along S
        grp = ch * NU + g
    else:
        grp = ch // (G // E)
    m = rmask[:, None] & cmask[None, :]
    gidx = rows[:, None] * grp_stride + grp[None, :]
    sc = tl.load(scale_ptr + gidx, mask=m, other=0)
    fo = (chs * NU + g) * 2
    s_b = tl.load(xf_ptr + fo)[None, :]
    xs = tl.load(xf_ptr + fo + 1)[None, :]
    if KQUANT:
        sb = rows * sb_stride + (c0 * E) // 256
        d = tl.load(d_ptr + sb, mask=rmask, other=0).to(tl.float32)[:, None]
        if PACKED_MIN:  # Q2_K: one byte m << 4 | sc
            sc = sc.to(tl.int32)
            mn = sc >> 4
            sc = sc & 15
        val = (d * sc.to(tl.float32)) * (s_b * isum.to(tl.float32) + OFF * xs)
        if HAS_MIN:
            if not PACKED_MIN:
                mn = tl.load(min_ptr + gidx, mask=m, other=0)
            dmin = tl.load(dmin_ptr + sb, mask=rmask, other=0).to(tl.float32)[:, None]
            val -= (dmin * mn.to(tl.float32)) * xs
    else:
        val = sc.to(tl.float32) * (s_b * isum.to(tl.float32) + OFF * xs)
        if HAS_MIN:
            val += tl.load(min_ptr + gidx, mask=m, other=0).to(tl.float32) * xs
    return val


@triton.jit
def _int_step(
    words, high, xw_ptr, xf_ptr, rows, rmask, c0, n_chunks,
    scale_ptr, min_ptr, d_ptr, dmin_ptr, grp_stride, sb_stride,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """[BN, S] float: each chunk's share of W x by integer dot products (xquant's layout)."""
    J: tl.constexpr = 8 // LB
    S: tl.constexpr = words.shape[1]
    ch = c0 + tl.arange(0, S)
    cmask = ch < n_chunks
    chs = tl.where(cmask, ch, 0)
    xoff = chs[:, None] * (8 * J) + tl.arange(0, 4)[None, :]  # [S, 4]
    z = tl.zeros(words.shape, dtype=tl.int32)
    uargs = (xf_ptr, chs, rows, rmask, ch, cmask, c0, scale_ptr, min_ptr, d_ptr, dmin_ptr)
    sargs = (grp_stride, sb_stride)  # (a tuple turns constexprs into tensors: passed apart)
    if LB == 8:
        hi, lo = _dot_word(_code_word(words, high, 0, LB, HB), xw_ptr, xoff, 0, J, z, z, ASM)
        acc = _unit_value(_isum(hi, lo), 0, *uargs, *sargs, LB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
    elif LB == 4 and HB < 2:
        hi, lo = _dot_word(_code_word(words, high, 0, LB, HB), xw_ptr, xoff, 0, J, z, z, ASM)
        hi, lo = _dot_word(_code_word(words, high, 1, LB, HB), xw_ptr, xoff, 1, J, hi, lo, ASM)
        acc = _unit_value(_isum(hi, lo), 0, *uargs, *sargs, LB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
    elif LB == 4:  # Q6_K: two groups of 16 a chunk
        g0, g1 = _halves(
            _code_word(words, high, 0, LB, HB), _code_word(words, high, 1, LB, HB), ASM
        )
        hi, lo = _dot_word(g0, xw_ptr, xoff, 0, J, z, z, ASM)
        acc = _unit_value(_isum(hi, lo), 0, *uargs, *sargs, LB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
        hi, lo = _dot_word(g1, xw_ptr, xoff, 1, J, z, z, ASM)
        acc += _unit_value(
            _isum(hi, lo), 1, *uargs, *sargs, LB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN
        )
    else:  # LB 2: a 4 x 4 byte transpose, word g = group g
        a, b = _halves_x(
            _code_word(words, high, 0, LB, HB), _code_word(words, high, 1, LB, HB), ASM
        )
        c, d = _halves_x(
            _code_word(words, high, 2, LB, HB), _code_word(words, high, 3, LB, HB), ASM
        )
        r0, r2 = _halves(a, c, ASM)
        r1, r3 = _halves(b, d, ASM)
        hi, lo = _dot_word(r0, xw_ptr, xoff, 0, J, z, z, ASM)
        acc = _unit_value(_isum(hi, lo), 0, *uargs, *sargs, LB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN)
        hi, lo = _dot_word(r1, xw_ptr, xoff, 1, J, z, z, ASM)
        acc += _unit_value(
            _isum(hi, lo), 1, *uargs, *sargs, LB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN
        )
        hi, lo = _dot_word(r2, xw_ptr, xoff, 2, J, z, z, ASM)
        acc += _unit_value(
            _isum(hi, lo), 2, *uargs, *sargs, LB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN
        )
        hi, lo = _dot_word(r3, xw_ptr, xoff, 3, J, z, z, ASM)
        acc += _unit_value(
            _isum(hi, lo), 3, *uargs, *sargs, LB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN
        )
    return acc


@triton.jit
def _float_step(
    words, high, zero, x_ptr, rows, rmask, c0, n_chunks,
    scale_ptr, min_ptr, d_ptr, dmin_ptr, grp_stride, sb_stride,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
):  # fmt: skip
    """[BN, S] float: each chunk's share of W x by the float decode (`_qgemv_kernel`'s, the
    codebook types' table lookup included)."""
    acc = tl.zeros(words.shape, dtype=tl.float32)
    acc = _float_chunks(
        acc, words, high, zero, x_ptr, rows, rmask, c0, n_chunks, scale_ptr, min_ptr, d_ptr,
        dmin_ptr, grp_stride, sb_stride, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB,
    )  # fmt: skip
    return tl.sum(acc, axis=2)


@triton.jit
def _load_unit(
    codes_ptr, high_ptr, tile, ks, valid, N, n_chunks, code_stride,
    BN: tl.constexpr, S: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr,
):  # fmt: skip
    """The code words [BN, S, 4] (and high words) of unit (tile, ks); zeros where not valid."""
    rows = tile * BN + tl.arange(0, BN)
    return _load_step(
        codes_ptr, high_ptr, rows, (rows < N) & valid, ks * S, n_chunks, code_stride, S, LB, HB
    )


@triton.jit
def _tile_programs(tile, KS, U, P):
    """(first, count): the programs whose runs hold units of row tile `tile`. Program p runs
    units [p U // P, (p + 1) U // P), so unit v is in program ceil((v + 1) P / U) - 1."""
    t0 = tile.to(tl.int64) * KS
    first = ((t0 + 1) * P + U - 1) // U - 1
    last = ((t0 + KS) * P + U - 1) // U - 1
    return first, last - first + 1


@triton.jit
def _run(U, P, KS, PDL: tl.constexpr):
    """(u0, u1, tile, ks): this program's run of units [u0, u1) and its first unit. With PDL
    the next kernel may launch now (its programs wait for this one's end before reading)."""
    pid = tl.program_id(0)
    u0 = (pid.to(tl.int64) * U // P).to(tl.int32)
    u1 = ((pid + 1).to(tl.int64) * U // P).to(tl.int32)
    if PDL:
        gdc_launch_dependents()
    return u0, u1, u0 // KS, u0 % KS


@triton.jit
def _next_unit(tile, ks, KS):
    """(tile, ks, whether the tile ends here) of the unit after (tile, ks)."""
    wrap = ks + 1 == KS
    return tile + wrap.to(tl.int32), tl.where(wrap, 0, ks + 1), wrap


@triton.jit
def _emit(val, y_ptr, part_ptr, cnt_ptr, tile, N, KS, U, P, MAXC, BN: tl.constexpr):
    """Row tile `tile`'s sum over this program's units (val [BN]) to y, through the fix-up
    when other programs hold units of it too (contributor index: program - first)."""
    rows = tile * BN + tl.arange(0, BN)
    first, count = _tile_programs(tile, KS, U, P)
    _split_k_store(
        val, y_ptr + rows, rows < N, part_ptr, tile.to(tl.int64) * MAXC * BN + tl.arange(0, BN),
        BN, cnt_ptr + tile, tl.program_id(0) - first, count,
    )  # fmt: skip


# Run-time sizes that would otherwise compile a variant each (divisibility by 16)
NO_SPECIALIZE_SK = ["N", "n_chunks", "KS", "U", "P", "MAXC", "grp_stride", "sb_stride", "zero"]


@triton.jit(do_not_specialize=NO_SPECIALIZE_SK)
def qgemv_streamk_kernel(
    x_ptr, xf_ptr, y_ptr, part_ptr, cnt_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    N, n_chunks, KS, U, P, MAXC,
    code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, S: tl.constexpr, INT_DOT: tl.constexpr, ASM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Grid (P,): y [N] = W x for one token. x_ptr: xquant's words (INT_DOT, with its floats
    at xf_ptr) or x itself. part [tiles, MAXC, BN] float32 and one counter a tile: the fix-up
    of tiles shared by programs (`_split_k_store`, contributor index pid - first).

    With PDL (programmatic dependent launch), the first unit's weights load before the wait
    for the previous kernel: only x, y and the fix-up buffers depend on it. The codebook types
    (CB > 0) take the float decode only: dp4a sums linear codes (`streamk.config_ok`)."""
    tl.static_assert(CB == 0 or not INT_DOT, "integer dot products need linear codes")
    u0, u1, tile, ks = _run(U, P, KS, PDL)
    nxt_w, nxt_h = _load_unit(
        codes_ptr, high_ptr, tile, ks, u0 < u1, N, n_chunks, code_stride, BN, S, LB, HB
    )
    if PDL:
        gdc_wait()
    acc = tl.zeros([BN, S], dtype=tl.float32)
    for u in range(u0, u1):
        words, high = nxt_w, nxt_h
        tile_n, ks_n, wrap = _next_unit(tile, ks, KS)
        nxt_w, nxt_h = _load_unit(
            codes_ptr, high_ptr, tile_n, ks_n, u + 1 < u1, N, n_chunks, code_stride, BN, S, LB, HB
        )
        rows = tile * BN + tl.arange(0, BN)
        rmask = rows < N
        planes = (scale_ptr, min_ptr, d_ptr, dmin_ptr, grp_stride, sb_stride)
        if INT_DOT:
            acc += _int_step(
                words, high, x_ptr, xf_ptr, rows, rmask, ks * S, n_chunks, *planes,
                LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, ASM,
            )  # fmt: skip
        else:
            acc += _float_step(
                words, high, zero, x_ptr, rows, rmask, ks * S, n_chunks, *planes,
                LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB,
            )  # fmt: skip
        end = wrap | (u + 1 == u1)
        if end:
            _emit(tl.sum(acc, axis=1), y_ptr, part_ptr, cnt_ptr, tile, N, KS, U, P, MAXC, BN)
        acc = tl.where(end, 0.0, acc)
        tile, ks = tile_n, ks_n
