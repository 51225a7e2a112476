"""Attention with a sliding window and attention sinks (gpt-oss), torch reference.

Same paged cache and metadata as kernels/paged.py, two more arguments:

    window  int          0: full causal attention; w > 0: a query at position p sees the keys at
                         p - w + 1 .. p (itself and the w - 1 before it), llama.cpp's
                         LLAMA_SWA_TYPE_STANDARD and transformers' sliding_window
    sinks   [H] float32  or None: one learned logit per query head that joins every softmax
                         and takes its share of the weight, but adds no value:

        o = sum_j exp(s_j - m) v_j / (exp(sink - m) + sum_j exp(s_j - m)),  m = max(sink, s_j)

A window layer reads its KV through its own block table (engine/kv_groups.py: a KV cache group
of the window layers), whose blocks before the window are released and read as the pool's
zeroed null block: the window is a mask here, and the Triton kernels skip the key tiles before
it (the first tile they read may start in the null block: zeros, masked out).
"""

from __future__ import annotations

import torch

from hetero.kernels.paged import kv_read
from hetero.kernels.registry import register


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int,
    sinks: torch.Tensor | None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [..., n, H, D] at positions q_pos [..., n] over keys k, v [..., L, KV, D] at positions
    0 .. L - 1 (valid [..., L]: the keys that exist, all by default) -> [..., n, H, D].

    A query that sees no key gives 0 (padding rows of a CUDA-graph batch)."""
    h, kv = q.shape[-2], k.shape[-2]
    kf = k.float().repeat_interleave(h // kv, dim=-2)  # [..., L, H, D]
    vf = v.float().repeat_interleave(h // kv, dim=-2)
    s = torch.einsum("...nhd,...lhd->...hnl", q.float(), kf) * scale
    kp = torch.arange(k.shape[-3], device=q.device)
    keep = kp <= q_pos[..., None]  # [..., n, L]
    if window:
        keep &= kp > q_pos[..., None] - window
    if valid is not None:
        keep &= valid[..., None, :]
    s = s.masked_fill(~keep[..., None, :, :], float("-inf"))  # [..., H, n, L]
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(*s.shape[:-1], 1)
        s = torch.cat((s, sink), dim=-1)
    m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)  # no -inf - -inf
    p = (s - m).exp()
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    o = torch.einsum("...hnl,...lhd->...nhd", p[..., : kf.shape[-3]], vf)
    return o.to(q.dtype)


@register("paged_attention_sinks", "torch")
def paged_attention_sinks_ref(
    q, k_cache, v_cache, k_scale, v_scale, meta, scale: float, window: int, sinks
) -> torch.Tensor:
    """paged_attention_ref's contract (kernels/paged.py) with a window and sinks (above)."""
    out = torch.empty_like(q)
    if meta.decode_slots is not None:  # one query a sequence, at its context's last position
        k = kv_read(k_cache, k_scale, meta.decode_slots, torch.float32)  # [B, Lmax, KV, D]
        v = kv_read(v_cache, v_scale, meta.decode_slots, torch.float32)
        q_pos = meta.decode_mask.sum(-1, keepdim=True) - 1  # [B, 1]
        o = sink_attention(q[:, None], k, v, q_pos, scale, window, sinks, meta.decode_mask)
        out[:] = o[:, 0]
        return out
    for start, n, slots in zip(meta.q_starts, meta.q_lens, meta.ctx_slots):
        k = kv_read(k_cache, k_scale, slots, torch.float32)
        v = kv_read(v_cache, v_scale, slots, torch.float32)
        q_pos = torch.arange(k.shape[0] - n, k.shape[0], device=q.device)
        out[start : start + n] = sink_attention(
            q[start : start + n], k, v, q_pos, scale, window, sinks
        )
    return out
