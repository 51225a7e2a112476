"""gpt-oss (gpt-oss-20b, gpt-oss-120b; GGUF architecture `gpt-oss`) in plain torch.

Attention with biases on q, k, v and the output, a learned sink logit per head, a sliding window
of 128 tokens on every other layer (the first included), NeoX rotary with YaRN (x32 over 4096
positions, correction dims unrounded); then a sparse expert layer: top-k of the router's logits
(with a bias), softmax over the k, experts with biases and a clamped SwiGLU (model/moe.py).
Shapes as in llama.py, E experts, k chosen a token, F expert width:

    tokens [T] -> embed [T, C]
    for each block:
        h = rms_norm(x)
        q, k, v = h [Wq|Wk|Wv] + b, split                 [T, H, D], [T, KV, D], [T, KV, D]
        o = softmax([q k^T / sqrt(D) (window: keys > pos - W) | sink_h]) v   (sink column dropped)
        x = x + o Wo + bo
        h = rms_norm(x)                                    (blk.N.post_attention_norm)
        l, ids = topk(h Wr^T + br, k); w = softmax(l)                      [T, E] -> [T, k]
        x = x + sum_j w[:, j] * expert_{ids[:, j]}(h)        expert: clamped SwiGLU, biases
    logits = rms_norm(x[wanted]) Wout                      [N, V] float32

The experts are MXFP4 in the released files (any GGUF type loads). The Harmony chat format's
channels are the server's business, not the model's.
"""

from __future__ import annotations

import torch
from torch import nn

from hetero.config import RuntimeConfig
from hetero.gguf_loader import GGUFModel
from hetero.model.forward_batch import ForwardBatch
from hetero.model.layers import QuantLinear, Rotary
from hetero.model.llama import Block, LlamaModel
from hetero.model.moe import SparseMoE
from hetero.quant import dequantize


class Attention(nn.Module):
    def __init__(self, gm: GGUFModel, i: int, rt: RuntimeConfig):
        super().__init__()
        cfg, p = gm.config, f"blk.{i}."
        self.cfg, self.layer = cfg, i
        self.window = cfg.layer_window(i)  # 0 on the full-attention layers
        names = [p + "attn_q", p + "attn_k", p + "attn_v"]
        self.wqkv = QuantLinear(  # q | k | v fused, with biases: [C] -> [H*D + 2*KV*D]
            [gm.tensor(n + ".weight") for n in names], rt, [gm.tensor(n + ".bias") for n in names]
        )
        self.wo = QuantLinear(
            gm.tensor(p + "attn_output.weight"), rt, gm.tensor(p + "attn_output.bias")
        )
        sinks = gm.tensor(p + "attn_sinks.weight")  # [H]
        self.sinks = dequantize(sinks.torch(), sinks.ggml_type, sinks.shape).to(rt.device)

    def forward(self, h: torch.Tensor, rotary: Rotary, cos, sin, batch: ForwardBatch):
        t, cfg = h.shape[0], self.cfg
        qkv = self.wqkv(h)  # [T, (H + 2 KV) * D]
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(t, -1, cfg.head_dim)  # [T, H + KV, D]
        q, k = rotary(qk, cos, sin).split([cfg.n_heads, cfg.n_kv_heads], dim=1)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.n_kv_heads, cfg.head_dim)
        o = batch.attention(self.layer, q, k, v, self.window, self.sinks)  # [T, H, D]
        return self.wo(o.reshape(t, cfg.q_size))


class GptOssModel(LlamaModel):
    def block(self, gm: GGUFModel, i: int, rt: RuntimeConfig) -> nn.Module:
        moe = SparseMoE(gm, i, rt, gating="softmax_topk", activation="swiglu_oai")
        return Block(gm, i, rt, attn=Attention(gm, i, rt), ffn=moe, ffn_norm="post_attention_norm")
