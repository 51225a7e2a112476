"""Torch references: the truth every faster kernel is tested against.

Shapes: T tokens, H query heads, KV key/value heads, D head dim, C model width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero.kernels.registry import register


@register("rms_norm", "torch")
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., C] -> [..., C]; computed in float32 whatever x's dtype, as llama.cpp does."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


@register("add_rms_norm", "torch")
def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add before a norm: (rms_norm(x + residual), x + residual), [..., C] each;
    the sum is rounded to x's dtype before it is normalized (what the unfused model does)."""
    total = x + residual
    return rms_norm_ref(total, weight, eps), total


@register("rope", "torch")
def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate the first 2*R dims of each head.

    x: [T, H, D]; cos, sin: [T, R] (R = rope_dim / 2). style "normal" pairs (x[2i], x[2i+1])
    (GGML's default, for which llama GGUFs store q/k permuted); "neox" pairs (x[i], x[i+R]).
    """
    r = cos.shape[-1]
    rot, rest = x[..., : 2 * r].float(), x[..., 2 * r :]
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "normal":
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    elif style == "neox":
        a, b = rot[..., :r], rot[..., r:]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    else:
        raise ValueError(f"rope style {style!r} is not one of normal, neox")
    return torch.cat((out.to(x.dtype), rest), dim=-1) if rest.shape[-1] else out.to(x.dtype)


@register("qk_norm_rope", "torch")
def qk_norm_rope_ref(
    q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
    cos: torch.Tensor, sin: torch.Tensor, style: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Qwen3's per-head RMSNorm of q [T, H, D] and k [T, KV, D] (weights wq, wk [D]), each
    rounded to the dtype, then rotated: (rope(rms_norm(q)), rope(rms_norm(k)))."""
    return tuple(  # type: ignore[return-value]
        rope_ref(rms_norm_ref(x, w, eps), cos, sin, style) for x, w in ((q, wq), (k, wk))
    )


@register("silu_mul", "torch")
def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, both [T, F]."""
    return F.silu(gate) * up


@register("qlinear", "torch")
def qlinear_ref(
    x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, shape: tuple[int, int]
) -> torch.Tensor:
    """y = x @ W^T with W [N, K] kept in GGUF blocks (qweight: the file's bytes), x [T, K]."""
    from hetero.quant import dequantize

    w = dequantize(qweight, ggml_type, shape).to(x.dtype)
    return x @ w.t()


@register("embed", "torch")
def embed_ref(
    ids: torch.Tensor, qweight: torch.Tensor, ggml_type: int, shape: tuple[int, int]
) -> torch.Tensor:
    """Rows `ids` of a [V, C] table in GGUF blocks: dequantize only the rows asked for."""
    from hetero.quant import dequantize

    rows = qweight[ids]
    return dequantize(rows, ggml_type, (ids.shape[0], shape[1]))


@register("attention", "torch")
def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float
) -> torch.Tensor:
    """Causal attention of T new queries over L cached keys of one sequence.

    q: [T, H, D]; k, v: [L, KV, D] with query t at absolute position q_start + t, so it sees keys
    0 .. q_start + t. GQA: H is a multiple of KV. Returns [T, H, D].
    """
    t, h, _ = q.shape
    length, kv, _ = k.shape
    group = h // kv
    qf = q.float().transpose(0, 1)  # [H, T, D]
    kf = k.float().transpose(0, 1).repeat_interleave(group, 0)  # [H, L, D]
    vf = v.float().transpose(0, 1).repeat_interleave(group, 0)
    pos_q = torch.arange(q_start, q_start + t, device=q.device)[:, None]
    mask = torch.arange(length, device=q.device)[None, :] <= pos_q  # [T, L]
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(q.dtype)
