"""The expert layer of the mixture-of-experts families (qwen3moe, gpt-oss), in plain torch.

A router scores E experts per token and keeps k; each chosen expert runs its own SwiGLU
feed-forward on the token, and the outputs add up weighted by the router. Shapes: T tokens,
C model width, E experts, k chosen a token, F expert width, S = T * k slots (token, choice).

    h [T, C]
    logits = h Wr^T (+ br)                                          [T, E] float32
    "softmax" (qwen3moe):       p = softmax(logits); w, ids = topk(p, k); w /= sum(w)
    "softmax_topk" (gpt-oss):   l, ids = topk(logits, k); w = softmax(l)            [T, k]
    for each slot s = (t, j), e = ids[t, j]:
        gate, up = h[t] Wg[e]^T (+ bg[e]), h[t] Wu[e]^T (+ bu[e])                  [F] each
        a = silu(gate) * up                                            ("silu": qwen3moe)
          = g * sigmoid(1.702 g) * (clamp(up, -7, 7) + 1), g = min(gate, 7)   ("swiglu_oai")
        o[s] = a Wd[e]^T (+ bd[e])                                                  [C]
    out[t] = sum_j w[t, j] o[(t, j)]                                                [T, C]

The expert weights are ggml's 3-D tensors ffn_{gate,up,down}_exps [E, N, K], kept in their GGUF
blocks ("quant": the registry's moe_matmul dequantizes only the experts the tokens chose, or the
GPU kernel reads the blocks in place) or dequantized once ("dense", the exact path of the tests).

`Experts` is one call, experts(h, ids, w) -> [T, C], on the device its weights live on: given
h elsewhere it moves h, ids and w there and the sum back. That is the seam for experts held in
system RAM and multiplied on the CPU while attention and the router run on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetero.config import RuntimeConfig
from hetero.gguf_loader import GGUFModel, GGUFTensor
from hetero.kernels import select
from hetero.kernels.registry import prepare_weight
from hetero.quant import dequantize

GATINGS = ("softmax", "softmax_topk")
ACTIVATIONS = ("silu", "swiglu_oai")
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU (llama.cpp: LLM_FFN_SWIGLU_OAI_MOE)


def _dense(t: GGUFTensor, device: str, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(t.torch(), t.ggml_type, t.shape).to(device=device, dtype=dtype)


class Router(nn.Module):
    """ids [T, k] and weights [T, k] float32 of each token's chosen experts.

    The router's matrix is small ([E, C]; llama.cpp never quantizes it) and its choice is
    discrete, so it runs in float32 whatever the activations' dtype: a bf16 rounding would flip
    near-ties between experts."""

    def __init__(self, gm: GGUFModel, i: int, rt: RuntimeConfig, gating: str):
        super().__init__()
        if gating not in GATINGS:
            raise ValueError(f"gating {gating!r} is not one of {', '.join(GATINGS)}")
        cfg, p = gm.config, f"blk.{i}.ffn_gate_inp."
        self.gating, self.k, self.norm = gating, cfg.n_experts_used, cfg.expert_weights_norm
        self.weight = nn.Parameter(_dense(gm.tensor(p + "weight"), rt.device, torch.float32), False)
        bias = gm.get(p + "bias")
        self.bias = None if bias is None else _dense(bias, rt.device, torch.float32)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(h.float(), self.weight, self.bias)  # [T, E]
        if self.gating == "softmax":
            w, ids = logits.softmax(-1).topk(self.k, dim=-1)
            if self.norm:  # llama.cpp clamps the sum away from 0 (f16's smallest normal)
                w = w / w.sum(-1, keepdim=True).clamp_min(6.103515625e-5)
        else:
            top, ids = logits.topk(self.k, dim=-1)
            w = top.softmax(-1)
        return ids, w


class ExpertWeight(nn.Module):
    """One expert tensor [E, N, K] (+ bias [E, N]) and its grouped matmul over routed slots."""

    def __init__(self, t: GGUFTensor, bias: GGUFTensor | None, rt: RuntimeConfig):
        super().__init__()
        if len(t.shape) != 3:
            raise ValueError(f"{t.name} is {list(t.shape)}: expert tensors are 3-D [E, N, K]")
        self.shape = t.shape
        self.ggml_type = int(t.ggml_type)
        impl = select("moe_matmul", torch.device(rt.device))
        self._matmul = impl.fn
        if rt.weights_mode() == "dense":
            self.qweight = _dense(t, rt.device, rt.torch_dtype())
        else:  # the file's blocks (on a CPU a view of the mapping: no copy)
            raw = t.torch().to(rt.device)
            self.qweight = prepare_weight(impl, raw, self.ggml_type, self.shape)
        self.bias = None if bias is None else _dense(bias, rt.device, rt.torch_dtype())

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, K] or [S, K] -> [S, N]: each slot's row times its expert's matrix (+ bias)."""
        y = self._matmul(x, self.qweight, self.ggml_type, self.shape, ids)
        if self.bias is not None:
            y = y + self.bias[ids.reshape(-1)]
        return y


class Experts(nn.Module):
    """All E experts of one layer: experts(h [T, C], ids [T, k], w [T, k]) -> [T, C]."""

    def __init__(self, gm: GGUFModel, i: int, rt: RuntimeConfig, activation: str):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
        self.activation, self.device = activation, torch.device(rt.device)
        p = f"blk.{i}.ffn_"
        self.gate, self.up, self.down = (
            ExpertWeight(gm.tensor(f"{p}{part}_exps.weight"), gm.get(f"{p}{part}_exps.bias"), rt)
            for part in ("gate", "up", "down")
        )
        self._silu_mul = select("silu_mul", self.device).fn

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [S, F] -> [S, F]
        if self.activation == "silu":
            return self._silu_mul(gate, up)
        g = gate.clamp(max=OAI_LIMIT)
        return g * torch.sigmoid(OAI_ALPHA * g) * (up.clamp(-OAI_LIMIT, OAI_LIMIT) + 1)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        home = h.device
        if home != self.device:  # experts held elsewhere (RAM): compute there, return the sum
            h, ids, w = h.to(self.device), ids.to(self.device), w.to(self.device)
        t, k = ids.shape
        a = self._act(self.gate(h, ids), self.up(h, ids))  # [S, F]
        o = self.down(a, ids).view(t, k, -1)  # [T, k, C]
        out = (o * w.to(o.dtype)[..., None]).sum(1)  # [T, C]
        return out.to(home, non_blocking=True)


class SparseMoE(nn.Module):
    """The feed-forward of a mixture-of-experts block: h [T, C] -> [T, C]."""

    def __init__(
        self,
        gm: GGUFModel,
        i: int,
        rt: RuntimeConfig,
        gating: str,
        activation: str,
        experts_rt: RuntimeConfig | None = None,
    ):
        """experts_rt: where and how the experts run, when not with the rest (rt)."""
        super().__init__()
        self.router = Router(gm, i, rt, gating)
        self.experts = Experts(gm, i, experts_rt or rt, activation)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ids, w = self.router(h)
        return self.experts(h, ids, w)
