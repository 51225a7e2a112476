"""Integer dot products on the codebook types (IQ4_NL, IQ4_XS, MXFP4): a 4-bit code indexes a
16-entry table of int8 values (repack.CODEBOOKS), so dp4a multiplies the table values, looked up
in registers by byte permutes (llama.cpp's CUDA kernels do the same), not the code bytes.

    _table_bytes  a code word's 8 nibbles -> the table values of its low and of its high
                  nibbles, one signed byte each (PTX prmt; the interpreter: the table selects of
                  triton_qdecode._codebook_int)

Imported on first use (imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_qdecode import _codebook_int
from hetero.quant.codebooks import E2M1_DOUBLED, IQ4NL_VALUES


def _table_asm(values: tuple[int, ...]) -> tl.constexpr:
    """PTX: a code word's 8 nibbles -> ($0: the values of its low nibbles, $1: of its high
    nibbles), one signed byte each in byte order. Nibble bits 0-2 pick an entry of the table's
    low half and of its high half (two prmt over two table words each: prmt selects one of 8
    bytes a nibble), bit 3 picks between the two (a third prmt); a last pair of prmt splits the
    nibble order (lo0 hi0 lo1 hi1 ..) into the low and the high nibbles' words."""
    words = [int.from_bytes(bytes(v & 0xFF for v in values[4 * i : 4 * i + 4]), "little")
             for i in range(4)]  # fmt: skip
    return tl.constexpr(
        "{ .reg .b32 cbt0, cbt1, cbt2, cbt3, cbs, cbm, cbl, cbh, cbr0, cbr1;"
        f" mov.b32 cbt0, {words[0]}; mov.b32 cbt1, {words[1]};"
        f" mov.b32 cbt2, {words[2]}; mov.b32 cbt3, {words[3]};"
        " and.b32 cbs, $2, 0x77777777; and.b32 cbm, $2, 0x88888888;"
        " shr.b32 cbm, cbm, 1; or.b32 cbm, cbm, 0x32103210;"
        " prmt.b32 cbl, cbt0, cbt1, cbs; prmt.b32 cbh, cbt2, cbt3, cbs;"
        " prmt.b32 cbr0, cbl, cbh, cbm; shr.b32 cbs, cbs, 16; shr.b32 cbm, cbm, 16;"
        " prmt.b32 cbl, cbt0, cbt1, cbs; prmt.b32 cbh, cbt2, cbt3, cbs;"
        " prmt.b32 cbr1, cbl, cbh, cbm;"
        " prmt.b32 $0, cbr0, cbr1, 0x6420; prmt.b32 $1, cbr0, cbr1, 0x7531; }"
    )


_TABLE_NL = _table_asm(IQ4NL_VALUES)  # CB = 1
_TABLE_FP = _table_asm(E2M1_DOUBLED)  # CB = 2


@triton.jit
def _table_bytes(w, CB: tl.constexpr, ASM: tl.constexpr):
    """(lo, hi) [BN] int32: the table values of code word w's low nibbles and of its high
    nibbles, a signed byte each (byte i: the nibble of byte i), for dp4a with signed codes."""
    if ASM:
        if CB == 1:
            lo, hi = tl.inline_asm_elementwise(
                _TABLE_NL, "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1
            )
        else:
            lo, hi = tl.inline_asm_elementwise(
                _TABLE_FP, "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1
            )
    else:
        lo = tl.zeros_like(w)
        hi = lo
        for i in tl.static_range(4):
            lo = lo | ((_codebook_int((w >> (8 * i)) & 15, CB) & 255) << (8 * i))
            hi = hi | ((_codebook_int((w >> (8 * i + 4)) & 15, CB) & 255) << (8 * i))
    return lo, hi
