"""Load-time repacking of GGUF quantized blocks into a layout GPU kernels read with wide loads.

GGUF blocks interleave fp16 scales with the codes (Q4_0: 18-byte blocks, Q6_K: 210), so their
codes sit at 2-byte-aligned addresses in an order chosen for CPU SIMD. `repack` splits a weight
W [N, K] into planes, each row-major over N:

    codes  int32 [N, K*LB/32]  the low LB bits of every code, in chunks of 4 words (16 bytes):
                               F = 32/LB fields a word, E = 4F codes a chunk, and field f of word
                               c of chunk h holds element h*E + 4f + c. For LB = 4 (E = 32):

           word c:  | e28+c | e24+c | e20+c | e16+c | e12+c | e8+c | e4+c | e0+c |  (bits 31..0)

                               so field f of the chunk's 4 words is 4 consecutive elements: a
                               kernel turns one 16-byte load into F vectors of 4 weights without
                               moving data between threads.
    high   int8/int16 [N, K*LB/32]  the HB high bits of the same codes, F*HB bits a code word
                               (Q5_*: 8, Q6_K and Q3_K: 16), in one of two arrangements:
                               "fields": code word c's own value, field f at bits f*HB;
                               "bytes": the chunk's 4*F*HB bits as NHW = 4*HB/LB int32 words
                               read by integer dot products (`high_bit_places` draws it)
    scale  [N, K/G]            per-group scale: fp16 d (legacy types) or the K-quant sub-block
                               code sc (uint8; int8 for Q6_K and Q3_K, whose sc - 32 is stored)
    minv   [N, K/G]            per-group min: fp16 m (Q4_1, Q5_1) or the K-quant code m (uint8)
    d, dmin fp16 [N, K/256]    K-quant super-block scales

Q2_K keeps its byte m << 4 | sc in `scale` (no `minv`): the kernel splits it.

Every type then dequantizes with one formula, the references' float32 operations in their order:

    q = low | high << LB                       (unsigned integer code)
    A = d                  (legacy)  or  d * sc      (K-quants; float32, as the references do)
    B = -m                 (Q4_1/Q5_1) or  dmin * mn (K-quants with mins)
    w = A * (q + OFF) - B                      (OFF folds the code offset: Q4_0 -8, Q6_K -32 ...)

A * (q + OFF) is exact in float32 for every type (at most 11 + 7 + 6 significant bits), so fused
or unfused, the one rounding left is that of the - B, exactly as in the references: the values
are bit-identical to `hetero.quant.dequantize` (checked by `dequantize_packed` in the tests).

The codebook types (CB > 0) keep 4-bit codes that index a 16-entry int8 table instead:

    w = A * TABLE[q]       CB = 1: IQ4_NL's values (IQ4_NL: A = d; IQ4_XS: A = d * (ls - 32),
                                   the 6-bit group scale stored as int8 ls - 32, like Q3_K's)
                           CB = 2: MXFP4's doubled E2M1 values; A = 2^(e - 128) from the E8M0
                                   byte e, kept as it is in `scale` (uint8) and decoded in-kernel
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from hetero.quant import get_quant
from hetero.quant.bits import bit_planes, crumbs, le_bits, low_high_nibbles
from hetero.quant.codebooks import E2M1_DOUBLED, IQ4NL_VALUES, codebook, e8m0_half, iq4_xs_scales
from hetero.quant.kquants import k4_scale_min, q3_k_scales

_T = GGMLQuantizationType
QK_K = 256


@dataclass(frozen=True)
class QSpec:
    """How one GGUF type maps onto the packed planes (see the module docstring)."""

    low_bits: int  # LB: bits per code in `codes` (2, 4 or 8)
    high_bits: int  # HB: bits per code in `high` (0, 1 or 2)
    group: int  # G: codes sharing one scale (16 or 32)
    offset: int  # OFF in w = A * (q + OFF) - B
    kquant: bool  # A = d * sc with d per 256-element super-block
    has_min: bool  # a B term
    packed_min: bool = False  # Q2_K: scale byte = mn << 4 | sc
    codebook: int = 0  # CB: 0 linear codes; 1 IQ4_NL values; 2 MXFP4 (E2M1 values, E8M0 scale)

    @property
    def high_dtype(self) -> torch.dtype:
        """One value a code word: (32 / LB) * HB bits."""
        return torch.int8 if (32 // self.low_bits) * self.high_bits == 8 else torch.int16


SPECS: dict[GGMLQuantizationType, QSpec] = {
    _T.Q4_0: QSpec(4, 0, 32, -8, kquant=False, has_min=False),
    _T.Q4_1: QSpec(4, 0, 32, 0, kquant=False, has_min=True),
    _T.Q5_0: QSpec(4, 1, 32, -16, kquant=False, has_min=False),
    _T.Q5_1: QSpec(4, 1, 32, 0, kquant=False, has_min=True),
    _T.Q8_0: QSpec(8, 0, 32, -128, kquant=False, has_min=False),  # codes stored as q + 128
    _T.Q2_K: QSpec(2, 0, 16, 0, kquant=True, has_min=True, packed_min=True),
    _T.Q3_K: QSpec(2, 1, 16, -4, kquant=True, has_min=False),
    _T.Q4_K: QSpec(4, 0, 32, 0, kquant=True, has_min=True),
    _T.Q5_K: QSpec(4, 1, 32, 0, kquant=True, has_min=True),
    _T.Q6_K: QSpec(4, 2, 16, -32, kquant=True, has_min=False),
    _T.IQ4_NL: QSpec(4, 0, 32, 0, kquant=False, has_min=False, codebook=1),
    _T.IQ4_XS: QSpec(4, 0, 32, 0, kquant=True, has_min=False, codebook=1),
    _T.MXFP4: QSpec(4, 0, 32, 0, kquant=False, has_min=False, codebook=2),
}
CODEBOOKS = {1: IQ4NL_VALUES, 2: E2M1_DOUBLED}  # CB -> the table its codes index


def spec_of(ggml_type: GGMLQuantizationType | int | str) -> QSpec:
    qt = get_quant(ggml_type)
    spec = SPECS.get(qt.ggml_type)
    if spec is None:
        known = ", ".join(t.name for t in SPECS)
        raise ValueError(f"{qt.name} has no packed GPU layout; packable types: {known}")
    return spec


def packable(ggml_type: GGMLQuantizationType | int | str) -> bool:
    try:
        return get_quant(ggml_type).ggml_type in SPECS
    except ValueError:
        return False


@dataclass(eq=False)
class PackedWeight:
    """A weight W [N, K] from GGUF blocks in the planes above (all on one device)."""

    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]  # (N, K)
    codes: torch.Tensor
    scale: torch.Tensor
    high: torch.Tensor | None = None
    minv: torch.Tensor | None = None
    d: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    high_layout: str = "fields"  # how `high` arranges its bits: "fields" or "bytes"

    @property
    def spec(self) -> QSpec:
        return SPECS[self.ggml_type]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def planes(self) -> list[torch.Tensor]:
        return [
            t
            for t in (self.codes, self.high, self.scale, self.minv, self.d, self.dmin)
            if t is not None
        ]

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads to use the whole weight once."""
        return sum(t.numel() * t.element_size() for t in self.planes())

    def to(self, device: torch.device | str) -> PackedWeight:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PackedWeight(
            self.ggml_type, self.shape, move(self.codes), move(self.scale), move(self.high),
            move(self.minv), move(self.d), move(self.dmin), self.high_layout,
        )  # fmt: skip


def chunk_codes(low_bits: int) -> int:
    """E: codes in one 4-word chunk of the `codes` plane."""
    return 4 * (32 // low_bits)


def _pack_fields(q: torch.Tensor, low_bits: int, bits: int) -> torch.Tensor:
    """Codes (n, K) uint8 < 2^bits, chunked as the LB-bit plane -> (n, K*LB/32) words of F*bits
    bits (int8, int16 or int32: the two's-complement pattern of sum_f code_f << f*bits), one a
    code word. Built byte by byte in uint8 and viewed as the word type (little-endian): a few
    passes over the codes' own bytes, where int64 sums took eight times the memory (the repack
    of a streamed layer's experts on the GPU runs this per prompt step)."""
    n, per_word = q.shape[0], 32 // low_bits
    per_byte, nbytes = 8 // bits, per_word * bits // 8
    fields = q.to(torch.uint8).reshape(n, -1, per_word, 4).transpose(2, 3)  # (n, chunk, c, f)
    fields = fields.reshape(*fields.shape[:3], nbytes, per_byte)
    packed = fields[..., 0].contiguous()  # a copy: the view is strided wherever per_byte > 1
    for m in range(1, per_byte):
        packed |= fields[..., m] << (m * bits)
    dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32}[nbytes]
    return packed.contiguous().view(dtype).reshape(n, -1)


def high_bit_places(low_bits: int, high_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The "bytes" arrangement of a chunk's high bits: (word [E], bit [E]) of element e's HB
    bits among the chunk's NHW = 4*HB/LB int32 high words.

    An integer dot product reads byte k of code word c shifted right by LB*j (J = 8/LB shifts):
    the codes of elements 4(kJ + j) + c, k = 0..3 ("combo" t = cJ + j). Their high bits sit in
    byte k of high word t // TW, at bit HB*(t % TW) of that byte (TW = 8/HB combos a byte), so
    one shift and one mask put them above the low bits of all 4 bytes at once. Q6_K (LB 4,
    HB 2): byte k of word 0 holds the crumbs of combos 0..3 (c = 0, 1), word 1 of combos 4..7:

        word u, byte k:  | t=4u+3 | t=4u+2 | t=4u+1 | t=4u+0 |   (bits 7..0; crumb = 2 bits)
    """
    j_count, tw = 8 // low_bits, 8 // high_bits
    e = torch.arange(4 * (32 // low_bits))
    c, f = e % 4, e // 4
    t = c * j_count + f % j_count
    return t // tw, 8 * (f // j_count) + high_bits * (t % tw)


def _pack_high_bytes(hq: torch.Tensor, low_bits: int, high_bits: int) -> torch.Tensor:
    """High codes (n, K) < 2^HB -> uint8 (n, chunks, 4 NHW): the "bytes" arrangement's words,
    byte by byte (little-endian). Each byte holds 8 / HB codes at bits 0, HB, ..: the codes are
    put in byte order, then shifted and added in uint8 (no int64 copies)."""
    n, k = hq.shape
    e_count = 4 * (32 // low_bits)
    word, bit = high_bit_places(low_bits, high_bits)
    order = torch.argsort((word * 4 + bit // 8) * 8 + bit % 8)  # by byte, then place in it
    tw = 8 // high_bits
    places = (bit % 8)[order].reshape(-1, tw)
    assert bool((places == torch.arange(tw) * high_bits).all())  # every byte filled alike
    v = hq.reshape(n, k // e_count, e_count)[:, :, order.to(hq.device)].to(torch.uint8)
    v = v.reshape(n, k // e_count, -1, tw)
    out = v[..., 0].clone()
    for j in range(1, tw):
        out |= v[..., j] << (high_bits * j)
    return out


def _unpack_high_bytes(high: torch.Tensor, low_bits: int, high_bits: int) -> torch.Tensor:
    """Inverse of `_pack_high_bytes` from the stored plane: int32 high codes (n, K)."""
    n = high.shape[0]
    word, bit = (t.to(high.device) for t in high_bit_places(low_bits, high_bits))
    words = high.contiguous().view(torch.int32).reshape(n, -1, 4 * high_bits // low_bits)
    vals = (words.to(torch.int64)[:, :, word] >> bit) & ((1 << high_bits) - 1)
    return vals.reshape(n, -1).to(torch.int32)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block: (n_blocks,) float16 (bits copied, not rounded)."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).reshape(-1)


def _codes(t: GGMLQuantizationType, b: torch.Tensor) -> torch.Tensor:
    """(n, type_size) blocks -> (n, block_size) uint8 unsigned codes q in element order."""
    n = b.shape[0]
    if t in (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.IQ4_NL, _T.MXFP4):
        lo = {_T.Q4_0: 2, _T.Q4_1: 4, _T.Q5_0: 6, _T.Q5_1: 8, _T.IQ4_NL: 2, _T.MXFP4: 1}[t]
        q = low_high_nibbles(b[:, lo : lo + 16].unsqueeze(1)).reshape(n, 32)
        if t in (_T.Q5_0, _T.Q5_1):
            q = q | (le_bits(b[:, lo - 4 : lo]) << 4)
        return q
    if t == _T.Q8_0:
        return (b[:, 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    if t == _T.Q2_K:
        return crumbs(b[:, 16:80].reshape(n, 2, 32)).reshape(n, QK_K)
    if t == _T.Q3_K:
        low = crumbs(b[:, 32:96].reshape(n, 2, 32)).reshape(n, QK_K)
        return low | (bit_planes(b[:, 0:32]).reshape(n, QK_K) << 2)
    if t == _T.Q4_K:
        return low_high_nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, QK_K)
    if t == _T.IQ4_XS:  # 8 groups laid out as Q4_0's
        return low_high_nibbles(b[:, 8:136].reshape(n, 8, 16)).reshape(n, QK_K)
    if t == _T.Q5_K:
        low = low_high_nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, QK_K)
        return low | (bit_planes(b[:, 16:48]).reshape(n, QK_K) << 4)
    if t == _T.Q6_K:
        low = low_high_nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
        high = crumbs(b[:, 128:192].reshape(n, 2, 32))
        return (low | (high << 4)).reshape(n, QK_K)
    raise AssertionError(t)


def _scales(t: GGMLQuantizationType, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-block scale fields, each (n_blocks, groups per block) or (n_blocks,)."""
    if t in (_T.Q4_0, _T.Q5_0, _T.Q8_0, _T.IQ4_NL):
        return {"scale": _f16(b, 0)}
    if t == _T.MXFP4:
        return {"scale": b[:, 0]}
    if t == _T.IQ4_XS:
        return {"scale": iq4_xs_scales(b).to(torch.int8), "d": _f16(b, 0)}
    if t in (_T.Q4_1, _T.Q5_1):
        return {"scale": _f16(b, 0), "minv": _f16(b, 2)}
    if t == _T.Q2_K:
        return {"scale": b[:, 0:16], "d": _f16(b, 80), "dmin": _f16(b, 82)}
    if t == _T.Q3_K:
        return {"scale": q3_k_scales(b[:, 96:108]), "d": _f16(b, 108)}
    if t in (_T.Q4_K, _T.Q5_K):
        sc, mn = k4_scale_min(b[:, 4:16])
        return {"scale": sc, "minv": mn, "d": _f16(b, 0), "dmin": _f16(b, 2)}
    if t == _T.Q6_K:
        return {"scale": b[:, 192:208].view(torch.int8), "d": _f16(b, 208)}
    raise AssertionError(t)


def repack(
    qweight: torch.Tensor,
    ggml_type: GGMLQuantizationType | int | str,
    shape: tuple[int, int],
    high_layout: str = "fields",
) -> PackedWeight:
    """GGUF bytes uint8 [N, row_bytes] of a weight W [N, K] -> PackedWeight on the same device
    (`high_layout`: the high plane's arrangement, "fields" or "bytes")."""
    if high_layout not in ("fields", "bytes"):
        raise ValueError(f"high_layout must be 'fields' or 'bytes', got {high_layout!r}")
    if sys.byteorder != "little":
        raise RuntimeError("the packed layout assumes a little-endian host and device")
    qt = get_quant(ggml_type)
    spec = spec_of(qt.ggml_type)
    n, k = (int(s) for s in shape)
    if qweight.dtype != torch.uint8:
        raise ValueError(f"{qt.name} weight must be uint8 GGUF bytes, got {qweight.dtype}")
    if k % qt.block_size:
        raise ValueError(f"{qt.name}: K={k} is not a multiple of the block size {qt.block_size}")
    n_blocks = n * (k // qt.block_size)
    if qweight.numel() != n_blocks * qt.type_size:
        raise ValueError(
            f"{qt.name}: {qweight.numel()} bytes do not hold a [{n}, {k}] weight "
            f"({n_blocks} blocks of {qt.type_size} bytes)"
        )
    blocks = qweight.reshape(n_blocks, qt.type_size)
    if k % chunk_codes(spec.low_bits):
        raise ValueError(f"{qt.name}: K={k} is not a multiple of {chunk_codes(spec.low_bits)}")
    q = _codes(qt.ggml_type, blocks).reshape(n, k)
    lb = spec.low_bits
    codes = _pack_fields(q & ((1 << lb) - 1), lb, lb)
    high = None
    if spec.high_bits and high_layout == "bytes":
        high = _pack_high_bytes(q >> lb, lb, spec.high_bits).reshape(n, -1).view(spec.high_dtype)
    elif spec.high_bits:
        high = _pack_fields(q >> lb, lb, spec.high_bits)
    fields = {
        name: f.reshape(n, -1).contiguous() for name, f in _scales(qt.ggml_type, blocks).items()
    }
    return PackedWeight(
        qt.ggml_type, (n, k), codes.contiguous(), high=high, high_layout=high_layout, **fields
    )


def _unpack_fields(words: torch.Tensor, low_bits: int, bits: int) -> torch.Tensor:
    """Inverse of `_pack_fields`: one value a code word (n, m) -> int32 codes (n, K)."""
    n, per_word = words.shape[0], 32 // low_bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int64) * bits
    fields = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (n, m, f)
    return fields.reshape(n, -1, 4, per_word).transpose(2, 3).reshape(n, -1).to(torch.int32)


def dequantize_packed(pw: PackedWeight) -> torch.Tensor:
    """float32 [N, K] from the packed planes with the kernels' formula, in torch (the test oracle
    that the layout still holds the references' values bit for bit)."""
    spec, (n, k) = pw.spec, pw.shape
    q = _unpack_fields(pw.codes, spec.low_bits, spec.low_bits)
    if pw.high is not None and pw.high_layout == "bytes":
        q = q | (_unpack_high_bytes(pw.high, spec.low_bits, spec.high_bits) << spec.low_bits)
    elif pw.high is not None:
        q = q | (_unpack_fields(pw.high, spec.low_bits, spec.high_bits) << spec.low_bits)
    if spec.codebook:
        q = codebook(CODEBOOKS[spec.codebook], q.device)[q.long()].reshape(n, -1, spec.group)
    else:
        q = (q + spec.offset).to(torch.float32).reshape(n, -1, spec.group)
    if spec.codebook == 2:
        return (q * e8m0_half(pw.scale).unsqueeze(-1)).reshape(n, k)
    if spec.kquant:
        assert pw.d is not None
        per_super = QK_K // spec.group
        d = pw.d.to(torch.float32).repeat_interleave(per_super, dim=1)
        sc = pw.scale.to(torch.int32)
        mn = sc >> 4 if spec.packed_min else pw.minv
        sc = sc & 15 if spec.packed_min else sc
        a = d * sc.to(torch.float32)
        b = None
        if spec.has_min:
            assert pw.dmin is not None and mn is not None
            b = pw.dmin.to(torch.float32).repeat_interleave(per_super, dim=1) * mn.to(torch.float32)
    else:
        a = pw.scale.to(torch.float32)
        b = -pw.minv.to(torch.float32) if pw.minv is not None else None
    w = q * a.unsqueeze(-1)
    if b is not None:
        w = w - b.unsqueeze(-1)
    return w.reshape(n, k)
