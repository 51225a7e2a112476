"""Qwen3 MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B; GGUF architecture `qwen3moe`) in plain torch.

qwen3's attention (model/llama.py: q/k/v without biases, per-head RMSNorm on q and k, NeoX
rotary) with a sparse expert layer in place of the dense feed-forward: top-k of a softmax over
E experts, the k weights renormalized to sum to 1, no shared expert (model/moe.py).
Shapes as in llama.py, E experts, k chosen a token, F expert width:

    tokens [T] -> embed [T, C]
    for each block:
        h = rms_norm(x)
        q, k, v = h [Wq|Wk|Wv], split; q, k = rms_norm_per_head(q), rms_norm_per_head(k)
        x = x + attention(rope(q), rope(k), v) Wo
        h = rms_norm(x)                                    (blk.N.ffn_norm)
        p = softmax(h Wr^T); w, ids = topk(p, k); w /= sum(w)        [T, E] -> [T, k]
        x = x + sum_j w[:, j] * expert_{ids[:, j]}(h)       (silu(h Wg^T) * h Wu^T) Wd^T
    logits = rms_norm(x[wanted]) Wout                        [N, V] float32

Tensors as llama.cpp's converter writes them: blk.N.ffn_gate_inp [E, C] (the router),
blk.N.ffn_{gate,up}_exps [E, F, C], blk.N.ffn_down_exps [E, C, F].
"""

from __future__ import annotations

from torch import nn

from hetero.config import RuntimeConfig
from hetero.gguf_loader import GGUFModel
from hetero.model.llama import Block, LlamaModel
from hetero.model.moe import SparseMoE


class Qwen3MoeModel(LlamaModel):
    def block(self, gm: GGUFModel, i: int, rt: RuntimeConfig) -> nn.Module:
        return Block(gm, i, rt, ffn=SparseMoE(gm, i, rt, gating="softmax", activation="silu"))
