"""Paged KV cache ops, torch references: the KV write (quantize + scatter) and paged attention.

Cache layout, per layer (slot = block * block_size + offset in block):

    k_cache, v_cache: [num_slots, KV, D]  in fp8 e4m3, fp16 or bf16
    k_scale, v_scale: [num_slots, KV]     float32, fp8 only (None otherwise)

FP8 scales are per token and per KV head: scale = amax(|x| over D) / 448 (e4m3's largest
normal), chosen at write time. A per-token-head scale costs 4 bytes per D bytes (6% at D = 64)
and needs no calibration pass: each vector uses the full e4m3 range, so the error is e4m3's
relative precision (2^-4) on every vector, whatever the magnitudes of other tokens or heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero.kernels.registry import register

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, KV, D] -> (fp8 [T, KV, D], scale [T, KV] float32)."""
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    return (xf / scale[..., None]).to(FP8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


@register("kv_write", "torch")
def kv_write_ref(k_cache, v_cache, k_scale, v_scale, slots, k, v) -> None:
    """Store k, v [T, KV, D] at `slots` [T] (int64), quantizing to the cache's dtype.

    A slot < 0 is a padding row (a CUDA-graph batch padded to its captured size): not stored.
    Checking for them costs a device sync, which the Triton kernel (it skips them in-kernel)
    does not pay."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    if k_cache.dtype == FP8:
        kq, ks = quantize_fp8(k)
        vq, vs = quantize_fp8(v)
        k_cache[slots], v_cache[slots] = kq, vq
        k_scale[slots], v_scale[slots] = ks, vs
    else:
        k_cache[slots] = k.to(k_cache.dtype)
        v_cache[slots] = v.to(v_cache.dtype)


def kv_read(cache: torch.Tensor, scale: torch.Tensor | None, idx: torch.Tensor, dtype):
    """Rows idx (any shape) of a cache -> [..., KV, D] in `dtype`."""
    if cache.dtype == FP8:
        return dequantize_fp8(cache[idx], scale[idx], dtype)
    return cache[idx].to(dtype)


@register("rope_kv_write", "torch")
def rope_kv_write_ref(q, k, v, cos, sin, style: str, k_cache, v_cache, k_scale, v_scale, slots):
    """Rotate q [T, H, D] and k [T, KV, D] (the "rope" op), store the rotated k and v at
    `slots` (kv_write_ref); returns the rotated q. One launch where a kernel fuses the three
    (a decode step's rotation and KV write)."""
    from hetero.kernels.reference import rope_ref

    kv_write_ref(k_cache, v_cache, k_scale, v_scale, slots, rope_ref(k, cos, sin, style), v)
    return rope_ref(q, cos, sin, style)


@register("rope_attention", "torch")
def rope_attention_ref(
    q, k, v, cos, sin, style, k_cache, v_cache, k_scale, v_scale, slots, meta, scale, layout=None
):  # fmt: skip
    """A step's attention from q and k not yet rotated: rope_kv_write_ref (rotate q and k, store
    k and v at `slots`), then paged_attention_ref: (out [T, H, D], words, floats), the last two
    the output's rows [T, H * D] in xquant's `layout` (`xquant_ref`: what the integer GEMV after
    reads), None without one. One launch where a kernel fuses them (else None)."""
    from hetero.kernels.xquant import xquant_ref

    q = rope_kv_write_ref(q, k, v, cos, sin, style, k_cache, v_cache, k_scale, v_scale, slots)
    out = paged_attention_ref(q, k_cache, v_cache, k_scale, v_scale, meta, scale)
    if layout is None:
        return out, None, None
    return (out, *xquant_ref(out.reshape(out.shape[0], -1), layout))


@register("paged_attention", "torch")
def paged_attention_ref(q, k_cache, v_cache, k_scale, v_scale, meta, scale: float):
    """Causal attention of each sequence's new queries over its paged context.

    q: [T, H, D], the new tokens of all sequences back to back. meta: PagedMeta with, per
    sequence, q_start (first row in q), q_len, and ctx_slots [ctx_len] (slots of positions
    0 .. ctx_len - 1, new tokens included: they were written first). Returns [T, H, D].
    """
    out = torch.empty_like(q)
    if meta.decode_slots is not None:  # every sequence has one query: one padded batch
        out[:] = _decode_batch(q, k_cache, v_cache, k_scale, v_scale, meta, scale)
        return out
    for start, n, slots in zip(meta.q_starts, meta.q_lens, meta.ctx_slots):
        k = kv_read(k_cache, k_scale, slots, torch.float32)
        v = kv_read(v_cache, v_scale, slots, torch.float32)
        out[start : start + n] = _causal(q[start : start + n], k, v, scale)
    return out


def _causal(q, k, v, scale):
    """q [n, H, D] at the last n positions of a context k, v [L, KV, D] -> [n, H, D]."""
    n, length = q.shape[0], k.shape[0]
    pos = torch.arange(length - n, length, device=q.device)[:, None]
    mask = torch.arange(length, device=q.device)[None, :] <= pos  # [n, L]
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),  # [H|KV, n|L, D]
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o.transpose(0, 1).to(q.dtype)


def _decode_batch(q, k_cache, v_cache, k_scale, v_scale, meta, scale):
    """B single-token queries: contexts padded to the longest, masked. q [B, H, D]."""
    k = kv_read(k_cache, k_scale, meta.decode_slots, torch.float32)  # [B, Lmax, KV, D]
    v = kv_read(v_cache, v_scale, meta.decode_slots, torch.float32)
    o = F.scaled_dot_product_attention(
        q.float()[:, :, None, :],  # [B, H, 1, D]
        k.transpose(1, 2),
        v.transpose(1, 2),  # [B, KV, Lmax, D]
        attn_mask=meta.decode_mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return o[:, :, 0, :].to(q.dtype)
