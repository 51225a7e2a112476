"""Whether a Block of model/llama.py runs as one native call on the CPU (kernels/cpu_block.py),
and that call's weights: a dense llama-family block (llama, qwen2, qwen3; no experts) whose
linears are all qdot-packed GGUF blocks, on a CPU whose small ops are the native ones the call
chains (so it equals the op-by-op path bit for bit)."""

from __future__ import annotations

import torch

from hetero.kernels import cpu_block, select

_OPS = ("rms_norm", "add_rms_norm", "rope", "silu_mul", "paged_attention")


def _parts(lin) -> list[tuple[int, int, torch.Tensor]] | None:
    """A QuantLinear's qdot parts (ggml_type, rows, packed weight), or None."""
    parts = getattr(lin, "packed_parts", None)
    if lin.mode != "qdot" or not parts or any(p.scheme != "qdot" for p in parts):
        return None
    return [(int(p.weight.ggml_type), p.weight.n, p.weight.packed) for p in parts]


def dense_block(block) -> cpu_block.DenseBlock | None:
    """The block's native call, or None where it runs op by op."""
    from hetero.model.llama import Attention, FeedForward

    attn, ffn = block.attn, block.ffn
    if type(attn) is not Attention or type(ffn) is not FeedForward:
        return None
    qk_norms = None
    if attn.q_norm is not None:  # Qwen3: the norms, then the rotation, as the CPU runs them
        if attn._qk_norm_rope is not None or attn.q_norm.eps != block.attn_norm.eps:
            return None
        qk_norms = (attn.q_norm.weight.data, attn.k_norm.weight.data)
    cpu = torch.device("cpu")
    if not cpu_block.enabled() or any(select(op, cpu).name != "native" for op in _OPS):
        return None
    linears = [_parts(lin) for lin in (attn.wqkv, attn.wo, ffn.gate_up, ffn.down)]
    if any(p is None or len(p) > cpu_block.MAX_PARTS for p in linears):
        return None
    cfg = attn.cfg
    if cfg.rope_style not in ("normal", "neox"):
        return None
    bias = attn.wqkv.bias
    if bias is not None and bias.dtype != torch.float32:
        return None
    return cpu_block.DenseBlock(
        *linears, block.attn_norm.weight.data, block.ffn_norm.weight.data, bias,
        cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_style == "neox",
        block.attn_norm.eps, qk_norms,
    )  # fmt: skip
