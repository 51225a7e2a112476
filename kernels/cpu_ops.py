"""CPU versions of the small per-layer ops: fewer, cheaper torch calls than the references.

On a CPU decode step the matmuls read the weights once and everything else is many tiny ops
(~20 per layer on [1, 576]-sized tensors), so an op's fixed cost (dispatch, allocation, a dtype
conversion) matters more than its arithmetic. These keep each reference's semantics and
signature and are tested against it (tests/kernels/test_cpu_ops.py):

- paged KV reads gather with `index_select` on a flat slot list (3-4x cheaper than advanced
  indexing on CPU, measured), dequantize fp8 through a 256-entry table (torch's e4m3 -> float
  conversion is a scalar loop on CPU), and drop the mask when every context has the same length;
- the KV write copies rows with `index_copy_`;
- RMSNorm is torch's fused `rms_norm` (one op instead of five);
- RoPE of the "normal" (adjacent pairs) style is one complex multiply.

Shapes: T tokens, H query heads, KV key/value heads, D head dim, B sequences, L context length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero.kernels.paged import FP8, _causal, quantize_fp8
from hetero.kernels.reference import rope_ref
from hetero.kernels.registry import register


def on_cpu(device: torch.device) -> bool:
    return device.type == "cpu"


# e4m3 byte -> float32 value (NaN codes stay NaN); gathering from it dequantizes in one op
_FP8_TABLE = torch.arange(256, dtype=torch.uint8).view(FP8).float()


def read_rows(cache: torch.Tensor, scale: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx [n] (int64) of a cache [slots, KV, D] -> float32 [n, KV, D]."""
    if cache.dtype == FP8:
        codes = cache.view(torch.uint8).index_select(0, idx).long()
        return _FP8_TABLE[codes] * scale.index_select(0, idx)[..., None]
    rows = cache.index_select(0, idx)
    return rows if rows.dtype == torch.float32 else rows.float()


@register("kv_write", "cpu", priority=1, supports=on_cpu)
def kv_write_cpu(k_cache, v_cache, k_scale, v_scale, slots, k, v) -> None:
    """kv_write_ref with row copies: k, v [T, KV, D] into slots [T] of the caches."""
    if k_cache.dtype == FP8:
        kq, ks = quantize_fp8(k)
        vq, vs = quantize_fp8(v)
        k_scale.index_copy_(0, slots, ks)
        v_scale.index_copy_(0, slots, vs)
        # index_copy_ has no fp8 kernel: copy the bytes
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, kq, vq))
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


@register("paged_attention", "cpu", priority=1, supports=on_cpu)
def paged_attention_cpu(q, k_cache, v_cache, k_scale, v_scale, meta, scale: float):
    """paged_attention_ref with cheaper reads; q [T, H, D] -> [T, H, D]."""
    if meta.decode_slots is not None:
        return _decode(q, k_cache, v_cache, k_scale, v_scale, meta, scale)
    out = torch.empty_like(q)
    for start, n, slots in zip(meta.q_starts, meta.q_lens, meta.ctx_slots):
        k = read_rows(k_cache, k_scale, slots)
        v = read_rows(v_cache, v_scale, slots)
        out[start : start + n] = _causal(q[start : start + n], k, v, scale)
    return out


def _decode(q, k_cache, v_cache, k_scale, v_scale, meta, scale):
    """B single-token queries over contexts padded to the longest (decode_slots [B, Lmax])."""
    b, lmax = meta.decode_slots.shape
    flat = meta.decode_slots.reshape(-1)
    k = read_rows(k_cache, k_scale, flat).view(b, lmax, *k_cache.shape[1:])  # [B, L, KV, D]
    v = read_rows(v_cache, v_scale, flat).view(b, lmax, *v_cache.shape[1:])
    # equal lengths (one stream, or streams in step): every slot is real, no mask to apply
    ragged = any(c.shape[0] != lmax for c in meta.ctx_slots)
    o = F.scaled_dot_product_attention(
        q.float()[:, :, None, :],  # [B, H, 1, D]
        k.transpose(1, 2),
        v.transpose(1, 2),  # [B, KV, L, D]
        attn_mask=meta.decode_mask[:, None, None, :] if ragged else None,
        scale=scale,
        enable_gqa=True,
    )
    return o[:, :, 0, :].to(q.dtype)


@register("rms_norm", "cpu", priority=1, supports=on_cpu)
def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_ref as torch's fused op (float32 inputs; others take the reference's path)."""
    if x.dtype != torch.float32:
        xf = x.float()
        return F.rms_norm(xf, (xf.shape[-1],), weight.float(), eps).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@register("silu_mul", "cpu", priority=1, supports=on_cpu)
def silu_mul_cpu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu_mul_ref with one temporary instead of two: [T, F] each."""
    return F.silu(gate).mul_(up)


@register("rope", "cpu", priority=1, supports=on_cpu)
def rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """rope_ref; x [T, H, D] float32 rotated in full, "normal" style: one complex multiply.

    Adjacent pairs (x[2i], x[2i+1]) read as complex a + ib times cos + i sin give the pair
    (a cos - b sin, a sin + b cos), the reference's formula. Other cases go to the reference.
    """
    r = cos.shape[-1]
    if style != "normal" or x.dtype != torch.float32 or 2 * r != x.shape[-1]:
        return rope_ref(x, cos, sin, style)
    t, h, d = x.shape
    pairs = x.reshape(t, h, r, 2)
    if pairs.storage_offset() % 2 or any(s % 2 for s in pairs.stride()[:-1]):
        pairs = pairs.contiguous()  # complex64 views need float pairs at even offsets
    z = torch.view_as_complex(pairs)  # [T, H, R] complex64
    return torch.view_as_real(z * _rotation(cos, sin)).view(t, h, d)


_last_rotation: list = [None, None, None]  # (cos, sin, cos + i sin): one step's layers share it


def _rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos + i sin [T, 1, R], built once per (cos, sin) pair: every layer of a step rotates by
    the same tensors. Identity, not value, is compared; the cache holds the pair, so their ids
    cannot be reused while it does."""
    c, s, rot = _last_rotation
    if c is not cos or s is not sin:
        rot = torch.complex(cos, sin)[:, None, :]
        _last_rotation[:] = [cos, sin, rot]
    return rot
