"""Activations in block fixed point, laid out for integer dot products with packed GGUF codes.

The integer decode kernel (`triton_streamk`) multiplies weight codes by activations with dp4a:
four 8-bit products summed into an int32 in one instruction, where the float kernels spend three
instructions on every weight. So the activations x [T, K] go to integers first, per block of 32
(one shared power-of-two scale, as a K-quant group shares one):

    s_b = 2^(e_b - 15)        e_b: the exponent of max |x| over the block (frexp's)
    m_i = round(x_i / s_b)    |m_i| <= 32767, exact for every x_i within 7 binades of the block's
                              largest (a bf16 value has 8 significant bits); below, rounded to
                              2^-15 of the block's largest: well under bf16's own 2^-9
    m_i = 256 hi_i + lo_i     hi signed, lo unsigned: two bytes, two dp4a per word of codes

and sum_i q_i x_i = s_b (256 sum q_i hi_i + sum q_i lo_i), exact in int32.

Layout (one token; E = 128 / LB codes a chunk of the packed codes, J = 8 / LB):

    words  int32 [K/E, 2, J, 4]   per chunk: the hi words, then the lo words; word (q, c) holds
                                  the bytes of the 4 elements that dp4a meets in byte 0..3 of the
                                  kernel's word q of code word c (`dot_elements`)
    floats f32 [K/GU, 2]          per unit of GU = min(G, E) elements (codes of one weight scale
                                  and one block): (s_b, s_b * sum of the unit's m)

The kernel's word q of code word c is (c >> LB*q) & mask: bytes k = 0..3 hold the elements
4(kJ + q) + c. Where a chunk holds several groups of one scale (Q6_K: 2 groups of 16 in 32 codes;
Q2_K, Q3_K: 4 of 16 in 64), the kernel regroups those bytes so that each word stays in one group
(word q holds group q); `dot_elements` gives the order either way. A unit never crosses a block
of 32, and the order keeps each block's elements together, so the block maxima and the unit sums
are taken over contiguous runs of the permuted x.

`xquant_ref` is the torch reference; `xquant` runs the Triton kernel on CUDA (or under the
interpreter) and equals the reference bit for bit. Fused with the op that makes x, so that the
quantization costs no launch of its own: `add_rms_norm_xquant` (the norms before q|k|v and
gate|up) and `silu_mul_xquant` (the down projection's input), each with its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero.kernels.pdl import pdl_launch

BLOCK = 32  # elements sharing one power-of-two scale
_MAGIC = 12582912.0  # 1.5 * 2^23: v + _MAGIC rounds v to an integer (half to even), |v| < 2^22
_MAGIC_BITS = 0x4B400000


@dataclass(frozen=True)
class XLayout:
    """The integer layout of activations for weights of LB-bit codes in groups of G."""

    low_bits: int
    group: int

    @property
    def chunk(self) -> int:  # E
        return 128 // self.low_bits

    @property
    def shifts(self) -> int:  # J: words of 4 codes a code word yields
        return 8 // self.low_bits

    @property
    def unit(self) -> int:  # GU
        return min(self.group, self.chunk)

    @property
    def regroup(self) -> bool:
        """Whether the kernel regroups bytes so that each word holds one group."""
        return self.chunk > self.group


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """Activations [rows, K] already in xquant's layout for an integer GEMV: made by the op that
    produced them (the kernels' `quantize_input` hooks: an activation and its quantization in
    one launch), so no launch of their own quantizes them. dtype: the activations' (the
    output's)."""

    words: torch.Tensor
    floats: torch.Tensor
    layout: XLayout
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[0], self.words.shape[1] * self.layout.chunk

    @property
    def device(self) -> torch.device:
        return self.words.device


def dot_elements(layout: XLayout) -> torch.Tensor:
    """int64 [E]: the chunk-local element of each (q, c, byte i), in that order (x's order)."""
    j_count, e = layout.shifts, torch.arange(layout.chunk)
    q, c, i = e // 16, (e // 4) % 4, e % 4
    if not layout.regroup:  # bytes k = i of shift q: fields iJ + q
        return 4 * (i * j_count + q) + c
    if j_count == 2:  # Q6_K: word q = bytes 2q, 2q+1 of shifts 0 and 1 (i = 2 shift + byte)
        return 16 * q + 8 * (i % 2) + 4 * (i // 2) + c
    return 16 * q + 4 * i + c  # LB 2: word q = byte q of shifts 0..3 (i = shift)


def xquant_ref(x: torch.Tensor, layout: XLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float -> (words int32 [T, K/E, 2, J, 4], floats float32 [T, K/GU, 2])."""
    t, k = x.shape
    e = layout.chunk
    if k % e or k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {max(e, BLOCK)}")
    perm = dot_elements(layout).to(x.device)
    xp = x.float().reshape(t, k // e, e)[:, :, perm].reshape(t, k // BLOCK, BLOCK)
    m, s_b = _fixed_point(xp)
    mc = m.reshape(t, k // e, e)
    words = torch.stack([_bytes_to_words(mc >> 8), _bytes_to_words(mc)], dim=2)
    words = words.reshape(t, k // e, 2, layout.shifts, 4)
    gu = layout.unit
    msum = m.reshape(t, k // gu, gu).sum(-1).float()
    s_u = s_b.repeat_interleave(BLOCK // gu, dim=1) if gu < BLOCK else s_b
    return words.contiguous(), torch.stack([s_u, s_u * msum], dim=-1).contiguous()


def _fixed_point(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [T, nb, 32] float32 -> (m int32 [T, nb, 32], s_b float32 [T, nb]) by exponent
    bits (the kernel's arithmetic: every step exact but the one rounding of x / s_b)."""
    amax = xb.abs().amax(-1)
    expo = ((amax.view(torch.int32) >> 23) & 255).clamp(15, 254)  # biased; tiny blocks: 15
    up = ((268 - expo) << 23).view(torch.float32)  # 2^(141 - expo) = 1 / s_b
    s_b = ((expo - 14) << 23).view(torch.float32)  # 2^(expo - 141)
    v = xb * up.unsqueeze(-1)
    m = (v + _MAGIC).view(torch.int32) - _MAGIC_BITS
    return m.clamp(-32767, 32767), s_b


def _bytes_to_words(b: torch.Tensor) -> torch.Tensor:
    """int32 bytes [..., n] (low 8 bits used) -> int32 words [..., n/4], byte i at bits 8i."""
    b = (b & 255).reshape(*b.shape[:-1], -1, 4).to(torch.int64)
    shifts = torch.arange(0, 32, 8, device=b.device)
    w = (b << shifts).sum(-1)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def xquant(x: torch.Tensor, layout: XLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """`xquant_ref` by the Triton kernel (x [T, K] with unit stride along K)."""
    from hetero.kernels.triton_xquant_kernels import xquant_kernel

    t, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    words, floats = xquant_buffers(t, k, layout, x.device)
    span = 256 if layout.chunk <= 256 else layout.chunk  # a program: whole chunks and blocks
    xquant_kernel[(t, -(-k // span))](
        x, words, floats, k, x.stride(0),
        LB=layout.low_bits, GU=layout.unit, REGROUP=layout.regroup, SPAN=span, num_warps=2,
        **pdl_launch(x),
    )  # fmt: skip
    return words, floats


def xquant_buffers(t: int, k: int, layout: XLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(words, floats) for t rows of K elements in `layout`, unwritten (a kernel fills them)."""
    e = layout.chunk
    if k % e or k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {max(e, BLOCK)}")
    words = torch.empty(t, k // e, 2, layout.shifts, 4, dtype=torch.int32, device=device)
    return words, torch.empty(t, k // layout.unit, 2, dtype=torch.float32, device=device)


def add_rms_norm_xquant_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    layout: XLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(words, floats) of rms_norm(x + residual) * weight, and x + residual (x without one): the
    norm before a linear of the integer kernel, as `add_rms_norm_ref` then `xquant_ref`."""
    from hetero.kernels.reference import add_rms_norm_ref, rms_norm_ref

    if residual is None:
        normed, total = rms_norm_ref(x, weight, eps), x
    else:
        normed, total = add_rms_norm_ref(x, residual, weight, eps)
    return (*xquant_ref(normed, layout), total)


def add_rms_norm_xquant(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    layout: XLayout, layout2: XLayout | None = None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`add_rms_norm_xquant_ref` in one launch (x, residual [T, K] with unit stride along K):
    (words, floats, total). layout2: the norm quantized in it too, in the same launch:
    (words, floats, words2, floats2, total)."""
    from hetero.kernels.triton_xquant_kernels import add_rms_norm_xquant_kernel

    t, k = x.shape
    words, floats = xquant_buffers(t, k, layout, x.device)
    total = x if residual is None else torch.empty_like(x)
    res = x if residual is None else residual
    chunk = max(layout.chunk, layout2.chunk if layout2 else 0)
    span = 256 if chunk <= 256 else chunk
    two = {}
    words2, floats2 = words, floats
    if layout2 is not None:
        words2, floats2 = xquant_buffers(t, k, layout2, x.device)
        two = dict(TWO=True, LB2=layout2.low_bits, GU2=layout2.unit, REGROUP2=layout2.regroup)
    add_rms_norm_xquant_kernel[(t, -(-k // span))](
        x, res, weight, total, words, floats, words2, floats2, eps, k, x.stride(0),
        res.stride(0), total.stride(0), LB=layout.low_bits, GU=layout.unit,
        REGROUP=layout.regroup, SPAN=span, BK=1 << max(0, k - 1).bit_length(),
        ADD=residual is not None, num_warps=4, **two, **pdl_launch(x),
    )  # fmt: skip
    if layout2 is None:
        return words, floats, total
    return words, floats, words2, floats2, total


def silu_mul_xquant_ref(
    gate: torch.Tensor, up: torch.Tensor, layout: XLayout, activation: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(words, floats) of silu(gate) * up (or gpt-oss's clamped SwiGLU, activation
    "swiglu_oai"): the feed-forward's input to its down projection. The activation in float32,
    rounded to the input's dtype once (as the fused kernel: bfloat16 arithmetic op by op would
    round the clamped SwiGLU four times, two steps of bfloat16 from it)."""
    from hetero.kernels.moe import swiglu_oai
    from hetero.kernels.reference import silu_mul_ref

    act = silu_mul_ref if activation == "silu" else swiglu_oai
    return xquant_ref(act(gate.float(), up.float()).to(gate.dtype), layout)


def silu_mul_xquant(
    gate: torch.Tensor, up: torch.Tensor, layout: XLayout, activation: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul_xquant_ref` in one launch (gate, up [T, F] with unit stride along F: e.g. the
    halves of one fused gate|up output); the SwiGLU rounded once, as its Triton kernel."""
    from hetero.kernels.moe import OAI_ALPHA, OAI_LIMIT
    from hetero.kernels.triton_xquant_kernels import gated_xquant_kernel

    if activation not in ("silu", "swiglu_oai"):
        raise ValueError(f"activation {activation!r} is not one of silu, swiglu_oai")
    t, f = gate.shape
    words, floats = xquant_buffers(t, f, layout, gate.device)
    span = 256 if layout.chunk <= 256 else layout.chunk
    gated_xquant_kernel[(t, -(-f // span))](
        gate, up, words, floats, f, gate.stride(0), up.stride(0), OAI_ALPHA, OAI_LIMIT,
        LB=layout.low_bits, GU=layout.unit, REGROUP=layout.regroup, SPAN=span,
        SWIGLU=activation == "swiglu_oai", num_warps=2, **pdl_launch(gate),
    )  # fmt: skip
    return words, floats
