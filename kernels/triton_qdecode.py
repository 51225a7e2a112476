"""Decoding packed GGUF words in registers: the building blocks of the kernels in
`triton_qkernels` (layout and formula: `hetero.kernels.repack`).

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
The high-bit plane (Q5_*, Q6_K, Q3_K) is shifted into place next to the low field first. A plane
in the "bytes" arrangement (repack.high_bit_places) comes as int32 words; `_load_step` hands
each lane c its chunk's word c * NHW // 4 as uint32, which tells `_field` where the bits are.

The codebook types (CB > 0: IQ4_NL, IQ4_XS, MXFP4) look their 4-bit code up instead: the 16
int8 values sit in four int32 constants (4 bytes each, little-endian), code bit 3 and bit 2 pick
the word (three selects), and a shift left then an arithmetic shift right extract the byte
sign-extended: no memory access, and exact.

    TABLE[q] = (word[q >> 2] << (24 - 8 (q & 3))) >> 24

    _load_step       a step's code words and high plane
    _field           one field of the words as q + OFF (float32)
    _group_scales    a group's A and B from the scale planes
    _float_chunks    a step's share of y = W x for one token (the decode kernels' loop body)
    _decode_tile     the step's weights [BN, S*E] in element order (through _leaf .. _hex)

Like `triton_qkernels`, imported on first use only (it imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.quant.codebooks import E2M1_DOUBLED, IQ4NL_VALUES


def _table_word(values: tuple[int, ...], w: int) -> tl.constexpr:
    """Values 4w .. 4w+3 of a 16-entry int8 table as one int32 (little-endian bytes)."""
    word = int.from_bytes(bytes(v & 0xFF for v in values[4 * w : 4 * w + 4]), "little")
    return tl.constexpr(word - (1 << 32) if word >= 1 << 31 else word)


_NL0, _NL1, _NL2, _NL3 = (_table_word(IQ4NL_VALUES, w) for w in range(4))  # CB = 1
_FP0, _FP1, _FP2, _FP3 = (_table_word(E2M1_DOUBLED, w) for w in range(4))  # CB = 2


@triton.jit
def _load_step(
    codes_ptr, high_ptr, rows, rmask, c0, c_end, code_stride,
    S: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr,
):  # fmt: skip
    """Chunks c0 .. c0+S (those below c_end) of rows [BN]: the code words [BN, S, 4] int32 and
    the high plane (int32 in the "fields" arrangement, uint32 in the "bytes" one; the words
    again where the type has none).

    Loaded as [BN, 4S] (contiguous along K, so 16-byte vectors with threads along K first) and
    only then split into chunks: the split keeps every thread's 4 words in place. A high plane
    of int32 words is in the "bytes" arrangement: NHW = 4 HB / LB words a chunk, lane c gets
    word c * NHW // 4 (two lanes share a word where NHW is 2, all four where it is 1).
    """
    j = tl.arange(0, 4 * S)
    off = rows[:, None] * code_stride + c0 * 4 + j[None, :]
    m = rmask[:, None] & (c0 + j // 4 < c_end)[None, :]
    words = tl.reshape(tl.load(codes_ptr + off, mask=m, other=0), [rows.shape[0], S, 4])
    high = words
    if HB > 0:
        if high_ptr.dtype.element_ty == tl.int32:
            NHW: tl.constexpr = 4 * HB // LB
            hoff = rows[:, None] * (code_stride * HB // LB) + (c0 + j // 4) * NHW
            hoff += (j % 4) * NHW // 4
            high = tl.load(high_ptr + hoff, mask=m, other=0).to(tl.uint32, bitcast=True)
        else:
            high = tl.load(high_ptr + off, mask=m, other=0).to(tl.int32)
        high = tl.reshape(high, [rows.shape[0], S, 4])
    return words, high


@triton.jit
def _field(
    words, words_hi, high, zero,
    f: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, OFF: tl.constexpr, CB: tl.constexpr,
):  # fmt: skip
    """float32 q + OFF of field f of every word, exact (see the module docstring); for a
    codebook type (CB > 0) the table value of the 4-bit code q.

    `zero` is a run-time 0: with the exponent bits in a register, the compiler emits one LOP3
    (a & mask | c) per code instead of an AND and an OR with two immediates.
    """
    s: tl.constexpr = LB * f
    if CB > 0:
        return _codebook((words >> s) & 15, CB)
    if s + LB + HB <= 23:
        p: tl.constexpr = s
        src = words
    else:
        p: tl.constexpr = s - 16
        src = words_hi
    bits = src & (((1 << LB) - 1) << p)
    if HB > 0:
        hpos: tl.constexpr = p + LB  # the high bits' place above the low field
        if high.dtype == tl.uint32:  # "bytes": lane c's bits at 8k + HB (t % TW), t = cJ + j
            h = _bytes_high(high, f, hpos, LB, HB)
        elif hpos >= HB * f:
            h = high << (hpos - HB * f)
        else:
            h = high >> (HB * f - hpos)
        bits = bits | (h & (((1 << HB) - 1) << hpos))
    v = (bits | (((150 - p) << 23) + zero)).to(tl.float32, bitcast=True)
    return v - ((1 << (23 - p)) - OFF)


@triton.jit
def _shift_to(h, at: tl.constexpr, to: tl.constexpr):
    """h (uint32) with its bit `at` moved to bit `to`, as int32 (one shift, or none)."""
    if at > to:
        h = h >> (at - to)
    elif at < to:
        h = h << (to - at)
    return h.to(tl.int32, bitcast=True)


@triton.jit
def _bytes_high(
    high, f: tl.constexpr, hpos: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr
):  # fmt: skip
    """[BN, S, 4] int32: field f's high bits of every code word moved to bit hpos, from the
    "bytes" plane's lane words (uint32 [BN, S, 4]). The 4 lanes take 4 different shifts, so
    they are split apart, shifted by constants and joined again (a shift by a per-lane vector
    is a variable shift and a select a lane)."""
    J: tl.constexpr = 8 // LB
    TW: tl.constexpr = 8 // HB
    even, odd = tl.split(tl.reshape(high, [high.shape[0], high.shape[1], 2, 2]))
    h0, h2 = tl.split(even)
    h1, h3 = tl.split(odd)
    base: tl.constexpr = 8 * (f // J)
    s0 = _shift_to(h0, base + HB * ((0 * J + f % J) % TW), hpos)
    s1 = _shift_to(h1, base + HB * ((1 * J + f % J) % TW), hpos)
    s2 = _shift_to(h2, base + HB * ((2 * J + f % J) % TW), hpos)
    s3 = _shift_to(h3, base + HB * ((3 * J + f % J) % TW), hpos)
    lanes = tl.join(tl.join(s0, s2), tl.join(s1, s3))  # [BN, S, 2, 2]: lane 2i + j at (i, j)
    return tl.reshape(lanes, [high.shape[0], high.shape[1], 4])


@triton.jit
def _codebook(q, CB: tl.constexpr):
    """float32 TABLE[q] of int32 codes q in 0..15 (the module docstring)."""
    return _codebook_int(q, CB).to(tl.float32)


@triton.jit
def _codebook_int(q, CB: tl.constexpr):
    """int32 TABLE[q] of int32 codes q in 0..15."""
    if CB == 1:
        lo = tl.where((q & 4) != 0, _NL1, _NL0)
        hi = tl.where((q & 4) != 0, _NL3, _NL2)
    else:
        lo = tl.where((q & 4) != 0, _FP1, _FP0)
        hi = tl.where((q & 4) != 0, _FP3, _FP2)
    word = tl.where((q & 8) != 0, hi, lo)
    return (word << (24 - 8 * (q & 3))) >> 24


@triton.jit
def e8m0_half(e):
    """float32 2^(e - 128) of uint8 exponents e, bit for bit as `hetero.quant.codebooks`."""
    e = e.to(tl.int32)
    bits = tl.where(e < 2, 0x00200000 * (e + 1), (e - 1) << 23)  # e < 2: the subnormals
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _group_scales(
    scale_ptr, min_ptr, d_ptr, dmin_ptr, rows, rmask, c0, ch, cmask, grp_stride, sb_stride,
    f: tl.constexpr, LB: tl.constexpr, G: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
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
        a = tl.load(scale_ptr + gidx, mask=m, other=0)
        if CB == 2:  # MXFP4: the E8M0 byte
            a = e8m0_half(a)
        else:
            a = a.to(tl.float32)
        if HAS_MIN:
            b = -tl.load(min_ptr + gidx, mask=m, other=0).to(tl.float32)
    return a[:, :, None], b[:, :, None]


@triton.jit
def _float_chunks(
    acc, words, high, zero, x_row, rows, rmask, c0, c_end,
    scale_ptr, min_ptr, d_ptr, dmin_ptr, grp_stride, sb_stride,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
):  # fmt: skip
    """acc [BN, S, 4] plus chunks c0 .. c0+S (below c_end) of W [rows] times x_row: per group
    sum_k (q_k + OFF) x_k (TABLE[q_k] for a codebook type, CB > 0), then times A, minus
    B * sum_k x_k (the products A (q + OFF) are exact, so this is the reference's sum of x * w
    in another order, skipping the one float32 rounding of w = A (q + OFF) - B: three
    instructions a weight instead of four)."""
    F: tl.constexpr = 32 // LB
    E: tl.constexpr = 4 * F
    BN: tl.constexpr = words.shape[0]
    S: tl.constexpr = words.shape[1]
    ch = c0 + tl.arange(0, S)
    cmask = ch < c_end
    xc = tl.arange(0, S)[:, None] * E + tl.arange(0, 4)[None, :]  # [S, 4]
    for f in tl.static_range(F):
        if (4 * f) % G == 0:  # the first field of a group: its scales, fresh sums
            a, b = _group_scales(
                scale_ptr, min_ptr, d_ptr, dmin_ptr, rows, rmask, c0, ch, cmask,
                grp_stride, sb_stride, f, LB, G, KQUANT, HAS_MIN, PACKED_MIN, CB,
            )  # fmt: skip
            qx = tl.zeros([BN, S, 4], dtype=tl.float32)
            xs = tl.zeros([S, 4], dtype=tl.float32)
        xv = tl.load(x_row + c0 * E + 4 * f + xc, mask=cmask[:, None], other=0).to(tl.float32)
        qx += _field(words, words >> 16, high, zero, f, LB, HB, OFF, CB) * xv[None, :, :]
        if HAS_MIN:
            xs += xv
        if (4 * (f + 1)) % G == 0 or f == F - 1:  # the group's last field in this chunk
            acc += qx * a
            if HAS_MIN:
                acc -= b * xs[None, :, :]
    return acc


@triton.jit
def _leaf(
    words, high, zero, a, b, f: tl.constexpr,
    LB: tl.constexpr, HB: tl.constexpr, OFF: tl.constexpr, HAS_MIN: tl.constexpr,
    CB: tl.constexpr,
):  # fmt: skip
    w = _field(words, words >> 16, high, zero, f, LB, HB, OFF, CB) * a
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
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
):  # fmt: skip
    lo = _leaf(words, high, zero, a, b, f0, LB, HB, OFF, HAS_MIN, CB)
    hi = _leaf(words, high, zero, a, b, f0 + 1, LB, HB, OFF, HAS_MIN, CB)
    return tl.join(lo, hi)


@triton.jit
def _quad(
    words, high, zero, a, b, sargs, f0: tl.constexpr,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
):  # fmt: skip
    if G == 16:
        a, b = _group_scales(*sargs, f0, LB, G, KQUANT, HAS_MIN, PACKED_MIN, CB)
    lo = _pair(words, high, zero, a, b, sargs, f0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB)
    hi = _pair(
        words, high, zero, a, b, sargs, f0 + 2, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB
    )
    return tl.join(lo, hi)


@triton.jit
def _oct(
    words, high, zero, a, b, sargs, f0: tl.constexpr,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
):  # fmt: skip
    if G == 32:
        a, b = _group_scales(*sargs, f0, LB, G, KQUANT, HAS_MIN, PACKED_MIN, CB)
    lo = _quad(words, high, zero, a, b, sargs, f0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB)
    hi = _quad(
        words, high, zero, a, b, sargs, f0 + 4, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB
    )
    return tl.join(lo, hi)


@triton.jit
def _hex(
    words, high, zero, a, b, sargs, f0: tl.constexpr,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
):  # fmt: skip
    lo = _oct(words, high, zero, a, b, sargs, f0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB)
    hi = _oct(
        words, high, zero, a, b, sargs, f0 + 8, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB
    )
    return tl.join(lo, hi)


@triton.jit
def _decode_tile(
    words, high, zero, sargs,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
):  # fmt: skip
    """float32 [BN, S*E]: the step's weights in element order. The joins and the permute only
    rename registers: every thread holds all fields of its words."""
    F: tl.constexpr = 32 // LB
    BN: tl.constexpr = words.shape[0]
    S: tl.constexpr = words.shape[1]
    a = tl.zeros([1, 1, 1], dtype=tl.float32)  # placeholders: the node of a group loads them
    b = a
    if F == 4:  # Q8_0: a chunk is half a group
        a, b = _group_scales(*sargs, 0, LB, G, KQUANT, HAS_MIN, PACKED_MIN, CB)
        w = _quad(
            words, high, zero, a, b, sargs, 0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB
        )
        w = tl.permute(w, (0, 1, 4, 3, 2))
    elif F == 8:
        w = _oct(words, high, zero, a, b, sargs, 0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB)
        w = tl.permute(w, (0, 1, 5, 4, 3, 2))
    else:
        w = _hex(words, high, zero, a, b, sargs, 0, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB)
        w = tl.permute(w, (0, 1, 6, 5, 4, 3, 2))
    return tl.reshape(w, [BN, S * 4 * F])
