"""The "qdot" CPU linear: GGUF blocks, read as they are, times int8-quantized activations.

llama.cpp's CPU scheme: the weights stay in their blocks and each block of x is rounded to int8
with a float32 scale (per 32 for the legacy types, per 256 with sums per 16 for the K-quants, as
llama.cpp's q8_0 / q8_K), then blocks multiply as integers in native code (kernels/cpu_qdot.c:
AVX-512 VNNI, AVX2 or NEON dotprod, picked at run time by kernels/native.py; plain C elsewhere;
K-quant products of 32 rows and more on AMX tiles where the CPU has them, cpu_qdot_amx.h).
Every type reads its own GGUF bytes, so a token reads the file's bytes per weight:

    type   bytes/w   type   bytes/w   type   bytes/w   type     bytes/w
    Q4_0   0.5625    Q5_1   0.75      Q4_K   0.5625    IQ4_NL   0.5625
    Q4_1   0.625     Q8_0   1.0625    Q5_K   0.6875    IQ4_XS   0.53125
    Q5_0   0.6875    Q2_K   0.328     Q6_K   0.8203    MXFP4    0.53125
    Q3_K   0.4297

The codebook types (IQ4_NL, IQ4_XS, MXFP4: a 4-bit code indexes 16 int8 values) look their codes
up with a byte shuffle while unpacking; IQ4_XS's 256-blocks take the K-quants' activations (int8
per 256, sums per 16), IQ4_NL and MXFP4's 32-blocks the legacy types'.

Packing at load moves bytes, never changes them: rows in groups of 16 (N padded with zero rows),
each group's blocks along K ("units") with every field's 16 rows side by side (the layout is
drawn in kernels/cpu_qtypes.h), so one 64-byte load holds 4 weights of 16 rows. The kernel's
only rounding is the activations' (x ~ xd * xq per block, |error| <= xd / 2); `qdot_reference`
(kernels/cpu_qdot_ref.py) does the same integer arithmetic in torch. Other types (F16, F32, BF16,
the grid IQ types) run fp16 in "qdot" mode (`cpu_scheme`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from hetero.kernels import cpu_threads, native
from hetero.quant import QuantType, get_quant

_T = GGMLQuantizationType
GROUP = 16  # rows interleaved per group
# type -> its GGUF block's fields in packed order: (byte offset, bytes, element bytes); element
# bytes 2 are the fp16 scales (d, dmin, m) and only they (cpu_linear checks them finite), so
# IQ4_XS's 16-bit scales_h goes as two byte planes
_D, _DMIN = (0, 2, 2), (2, 2, 2)
FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, int, int], ...]] = {
    _T.Q4_0: (_D, (2, 16, 4)),
    _T.Q4_1: (_D, (2, 2, 2), (4, 16, 4)),
    _T.Q5_0: (_D, (2, 4, 4), (6, 16, 4)),
    _T.Q5_1: (_D, (2, 2, 2), (4, 4, 4), (8, 16, 4)),
    _T.Q8_0: (_D, (2, 32, 4)),
    _T.Q2_K: ((80, 2, 2), (82, 2, 2), (0, 16, 1), (16, 64, 4)),
    _T.Q3_K: ((108, 2, 2), (96, 12, 1), (0, 32, 4), (32, 64, 4)),
    _T.Q4_K: (_D, _DMIN, (4, 12, 1), (16, 128, 4)),
    _T.Q5_K: (_D, _DMIN, (4, 12, 1), (16, 32, 4), (48, 128, 4)),
    _T.Q6_K: ((208, 2, 2), (192, 16, 1), (0, 128, 4), (128, 64, 4)),
    _T.IQ4_NL: (_D, (2, 16, 4)),
    _T.IQ4_XS: (_D, (2, 2, 1), (4, 4, 1), (8, 128, 4)),
    _T.MXFP4: ((0, 1, 1), (1, 16, 4)),  # the e8m0 exponent byte, then the codes
}
NATIVE_TYPES = tuple(FIELDS)
# Q6_K's 48 code vectors (32 of ql, then 16 of qh, after its 288-byte head) reordered to the order
# its decode row reads them, one forward stream (Q6K_QL and Q6K_QH in kernels/cpu_qtypes.h)
Q6K_HEAD = 288
Q6K_ORDER = [
    v
    for h in range(2)
    for v in [x for q in range(8) for x in (16 * h + q, 32 + 8 * h + q)]
    + [16 * h + 8 + q for q in range(8)]
]
ISA_NAMES = {
    5: "avx512-vnni + amx (emulated in C)",
    4: "avx512-vnni + amx",
    3: "avx512-vnni",
    2: "avx2",
    1: "neon-dotprod",
    0: "generic C",
}


def cpu_scheme(ggml_type) -> str:
    """The packing "qdot" mode gives a tensor of `ggml_type` (a type, its number or its name):
    "qdot" for the block types the kernel reads, "fp16" for the others."""
    return "qdot" if _type_name(ggml_type) in {t.name for t in NATIVE_TYPES} else "fp16"


def qdot_blocks(ggml_type) -> str:
    """The GGUF block type a tensor of `ggml_type` runs as in "qdot" packing: its own."""
    return _type_name(ggml_type)


def bytes_per_weight(ggml_type) -> float:
    """Bytes a token reads per weight of a `ggml_type` matrix in "qdot" packing (its GGUF's)."""
    qt = get_quant(_T[_type_name(ggml_type)])
    return qt.type_size / qt.block_size


def _type_name(ggml_type) -> str:
    """A GGUF type's name, from the type, its number or the name (any type, supported or not)."""
    return ggml_type if isinstance(ggml_type, str) else _T(int(ggml_type)).name


def load(variant: str | None = None):
    return native.load(variant)


def available() -> bool:
    return native.available()


def isa(variant: str | None = None) -> str:
    """The instruction set the kernels run with (or would, for `variant`)."""
    return ISA_NAMES[load(variant).qdot_isa()]


@dataclass(eq=False)
class QdotWeight:
    """W [n, k] of one GGUF block type, packed: uint8 [groups, k / block, 16 * type_size]."""

    ggml_type: GGMLQuantizationType
    n: int
    k: int
    packed: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    @property
    def block(self) -> int:
        return get_quant(self.ggml_type).block_size


def _rows16(field: torch.Tensor, elem: int) -> torch.Tensor:
    """[N, U, F] bytes of one field -> [G, U, F * 16]: each element's 16 rows side by side."""
    n, u, f = field.shape
    g = field.reshape(n // GROUP, GROUP, u, f // elem, elem).permute(0, 2, 3, 1, 4)
    return g.reshape(n // GROUP, u, f * GROUP)


def _from_rows16(packed: torch.Tensor, size: int, elem: int) -> torch.Tensor:
    """The inverse of _rows16 for one field: [G, U, size * 16] -> [G * 16, U, size]."""
    g, u, _ = packed.shape
    rows = packed.reshape(g, u, size // elem, GROUP, elem).permute(0, 3, 1, 2, 4)
    return rows.reshape(g * GROUP, u, size)


def pack(raw: torch.Tensor, qt: QuantType, n: int, k: int) -> QdotWeight:
    """GGUF bytes of W [n, k] (any shape holding n rows of blocks) -> the kernel's layout."""
    t = qt.ggml_type
    if t not in FIELDS:
        raise ValueError(f"qdot does not read {qt.name} blocks")
    if k % qt.block_size:
        raise ValueError(f"{qt.name}: k = {k} is not whole blocks of {qt.block_size}")
    blocks = raw.reshape(n, k // qt.block_size, qt.type_size)
    pad = -n % GROUP
    if pad:  # zero rows: d = 0, so their weights are 0
        blocks = torch.cat((blocks, blocks.new_zeros(pad, *blocks.shape[1:])))
    parts = [_rows16(blocks[:, :, o : o + s], e) for o, s, e in FIELDS[t]]
    packed = torch.cat(parts, dim=2)
    if t == _T.Q6_K:
        codes = packed[:, :, Q6K_HEAD:].unflatten(2, (-1, 64))
        packed = torch.cat((packed[:, :, :Q6K_HEAD], codes[:, :, Q6K_ORDER].flatten(2)), dim=2)
    return QdotWeight(t, n, k, packed.contiguous())


def gguf_bytes(w: QdotWeight, packed: torch.Tensor | None = None) -> torch.Tensor:
    """The GGUF blocks [n, k / block, type_size] the packed weight holds (bit for bit).
    `packed`: the same bytes elsewhere (a copy on a GPU): undone there, on its device."""
    packed = w.packed if packed is None else packed
    qt = get_quant(w.ggml_type)
    if w.ggml_type == _T.Q6_K:  # the code vectors back in field order
        codes = torch.empty_like(packed[:, :, Q6K_HEAD:]).unflatten(2, (-1, 64))
        codes[:, :, Q6K_ORDER] = packed[:, :, Q6K_HEAD:].unflatten(2, (-1, 64))
        packed = torch.cat((packed[:, :, :Q6K_HEAD], codes.flatten(2)), dim=2)
    out = torch.empty(
        packed.shape[0] * GROUP, w.k // qt.block_size, qt.type_size, dtype=torch.uint8,
        device=packed.device,
    )  # fmt: skip
    at = 0
    for o, s, e in FIELDS[w.ggml_type]:
        out[:, :, o : o + s] = _from_rows16(packed[:, :, at : at + s * GROUP], s, e)
        at += s * GROUP
    return out[: w.n]


def unpack(w: QdotWeight) -> torch.Tensor:
    """The float32 W [n, k] the packed blocks represent (the GGUF's exact dequantization)."""
    from hetero.quant import dequantize

    return dequantize(gguf_bytes(w).reshape(w.n, -1), w.ggml_type, (w.n, w.k))


def activation_block(ggml_type) -> int:
    """Weights per activation scale for a type: its block's, 256 for the K-quants and IQ4_XS
    (llama.cpp's q8_K), else 32 (q8_0)."""
    return 256 if get_quant(ggml_type).block_size == 256 else 32


def quantize_x(x: torch.Tensor, qb: int, variant: str | None = None):
    """x [T, K] float32 -> xq int8 [T, K], xd float32 [T, K/qb], bs int16 [T, K/16], natively."""
    t, k = x.shape
    x = x.contiguous()
    xq = torch.empty(t, k, dtype=torch.int8)
    xd = torch.empty(t, k // qb)
    bs = torch.empty(t, k // 16, dtype=torch.int16)
    ptrs = (xq.data_ptr(), xd.data_ptr(), bs.data_ptr())
    load(variant).qdot_quantize(x.data_ptr(), t, k, qb, *ptrs, cpu_threads.get())
    return xq, xd, bs


def qdot_linear(
    x: torch.Tensor, w: QdotWeight, threads: int = 0, variant: str | None = None
) -> torch.Tensor:
    """x [T, K] float32 -> y [T, n] float32 through the native kernel (x quantized inside)."""
    return linear_ptrs(
        x, int(w.ggml_type), w.n, w.k, w.packed.data_ptr(), threads, load(variant).qdot_linear
    )


def linear_ptrs(x: torch.Tensor, ggml_type: int, n: int, k: int, wptr: int, threads=0, fn=None):
    """qdot_linear on a weight pointer taken once (the model's per-call fast path)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], n)
    if x.shape[0] == 0:
        return y
    fn = fn or load().qdot_linear
    rc = fn(
        ggml_type, wptr, n, k, x.shape[0], x.data_ptr(), y.data_ptr(), threads or cpu_threads.get()
    )
    if rc == -2:
        raise MemoryError("qdot: no memory for the quantized activations")
    if rc:
        raise ValueError(f"qdot: type {ggml_type} with k = {k} is not one the kernel takes")
    return y


def unpack_unit(ggml_type, unit: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """The tile one packed unit unpacks into (bytes, cpu_qtypes.h), for tests."""
    tile = torch.zeros(8192, dtype=torch.uint8)
    unit = unit.contiguous()
    size = load(variant).qdot_unpack_unit(int(ggml_type), unit.data_ptr(), tile.data_ptr())
    if size < 0:
        raise ValueError(f"no tile for type {ggml_type}")
    return tile[:size]


def pool_selftest(n: int, threads: int, variant: str | None = None) -> tuple[int, list[int]]:
    """(workers used, per-worker sums of item index + 1) of a pool job of n items, for tests."""
    sums = (ctypes.c_int64 * 256)()
    used = load(variant).native_pool_selftest(n, threads, ctypes.addressof(sums))
    return used, list(sums)
