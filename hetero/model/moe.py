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
blocks (the registry's moe_matmul: the reference dequantizes only the experts the tokens chose,
the GPU kernel reads the blocks in place) in every weights mode but an explicit "dense", which
dequantizes them once (the exact path of the tests): experts are most of a MoE model's bytes,
so "auto" keeps them in blocks on a GPU as well (dense, Qwen3-30B-A3B would take 61 GB in bf16).

`Experts` is one call, experts(h, ids, w) -> [T, C], on the device its weights live on: given
h elsewhere it moves h, ids and w there and the sum back. That is the seam for experts held in
system RAM and multiplied on the CPU while attention and the router run on a GPU
(--cpu-moe / --n-cpu-moe: experts_runtime). On a CPU in "qdot" mode (what "auto" means there)
the experts run on the native grouped kernels (model/moe_qdot.py: slots sorted by expert, only
the chosen experts' blocks read), the whole layer in one native call where the router is on that
CPU too; types the kernel table lacks keep the reference matmul. A step that moves activations
to the CPU cannot be captured in a CUDA graph: such an engine logs that capture failed and runs
its steps eagerly.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hetero.config import ModelConfig, RuntimeConfig
from hetero.gguf_loader import GGUFModel, GGUFTensor
from hetero.kernels import select
from hetero.kernels.moe import GATINGS, activation_fn, routing_scope
from hetero.kernels.registry import prepare_weight
from hetero.model.moe_qdot import QdotExperts, runs_on_qdot
from hetero.quant import dequantize

ACTIVATIONS = ("silu", "swiglu_oai")


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
        self._logits = select("moe_router", torch.device(rt.device)).fn
        self._route = select("moe_route", torch.device(rt.device)).fn

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(h, self.weight, self.bias)  # [T, E] float32
        return self._route(logits, self.k, self.gating, self.norm)  # kernels/moe.py


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
        self._quantize_input = impl.quantize_input  # (the integer GEMV's input, where it has one)
        if rt.weights == "dense":  # asked for: "auto" keeps experts in blocks on a GPU too
            self.qweight = _dense(t, rt.device, rt.torch_dtype())
        else:  # the file's blocks (on a CPU a view of the mapping: no copy)
            raw = t.torch().to(rt.device)
            self.qweight = prepare_weight(impl, raw, self.ggml_type, self.shape)
        self.bias = None if bias is None else _dense(bias, rt.device, rt.torch_dtype())

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, K] or [S, K] -> [S, N]: each slot's row times its expert's matrix (+ bias)."""
        return self._matmul(x, self.qweight, self.ggml_type, self.shape, ids, self.bias)

    def quantized_input(self, gate: torch.Tensor, up: torch.Tensor, activation: str):
        """act(gate, up) as this weight's kernel reads it pre-quantized (the activation and the
        quantization in one launch: the integer decode GEMV of codebook experts), or None."""
        hook = self._quantize_input
        return None if hook is None else hook(self.qweight, gate, up, activation)


def fused(
    parts: list[GGUFTensor], biases: list[GGUFTensor | None], rt: RuntimeConfig
) -> ExpertWeight | None:
    """The expert tensors [E, F_i, C] (+ biases [E, F_i]) as one ExpertWeight [E, sum F_i, C],
    each expert's rows one after the other (expert e: part 0's rows, then part 1's); None
    where their types, expert counts or widths differ, or only some have a bias."""
    like = {(p.ggml_type, p.shape[0], p.shape[2:]) for p in parts}
    if len(like) > 1 or len({b is None for b in biases}) > 1:
        return None
    bias = None if biases[0] is None else _joined(biases)
    return ExpertWeight(_joined(parts), bias, rt)


def _joined(ts: list[GGUFTensor]) -> GGUFTensor:
    """Tensors [E, F_i, ...] joined along dim 1, expert by expert (a copy in RAM)."""
    e = ts[0].shape[0]
    data = np.concatenate([t.data.reshape(e, t.shape[1], -1) for t in ts], axis=1)
    shape = (e, sum(t.shape[1] for t in ts), *ts[0].shape[2:])
    blocks = data.dtype == np.uint8  # GGUF blocks [E, N, row bytes]; floats in their shape
    data = data.reshape(e, shape[1], -1) if blocks else data.reshape(shape)
    return GGUFTensor("|".join(t.name for t in ts), ts[0].ggml_type, shape, data)


class Experts(nn.Module):
    """All E experts of one layer: experts(h [T, C], ids [T, k], w [T, k]) -> [T, C]."""

    def __init__(self, gm: GGUFModel, i: int, rt: RuntimeConfig, activation: str):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
        self.activation, self.device = activation, torch.device(rt.device)
        self.dtype = rt.torch_dtype()
        p = f"blk.{i}.ffn_"
        parts = ("gate", "up", "down")
        weights = [gm.tensor(f"{p}{part}_exps.weight") for part in parts]
        biases = [gm.get(f"{p}{part}_exps.bias") for part in parts]
        self.qdot = self.gate_up = None  # qdot: the CPU's grouped kernels (model/moe_qdot.py)
        if runs_on_qdot(rt, weights):
            fp32 = [None if b is None else _dense(b, "cpu", torch.float32) for b in biases]
            self.qdot = QdotExperts(weights, fp32, activation)
        else:  # gate | up as one [E, 2F, C] weight where they share a type: one call reads both
            self.gate_up = fused(weights[:2], biases[:2], rt)
            if self.gate_up is None:
                self.gate, self.up = (ExpertWeight(t, b, rt) for t, b in zip(weights, biases))
            self.down = ExpertWeight(weights[2], biases[2], rt)
        self._act = activation_fn(self.activation, self.device)  # (gate, up) [S, F] -> [S, F]
        self._combine = select("moe_combine", self.device).fn

    # a big step's experts on another device (execution/offload_experts.py sets it where the
    # experts are in RAM beside a GPU)
    offload = None

    def forward(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        home, dtype = h.device, h.dtype
        if self.offload is not None and self.offload.runs(h):
            return self.offload(self, h, ids, w)
        if home != self.device:  # experts held elsewhere (RAM): compute there, return the sum
            h, ids, w = h.to(self.device, self.dtype), ids.to(self.device), w.to(self.device)
        if self.qdot is not None:
            return self.qdot(h, ids, w).to(home, dtype)
        with routing_scope():  # (the kernels may sort the slots by expert once for all calls)
            if self.gate_up is not None:
                gu = self.gate_up(h, ids)  # [S, 2F]
                f = gu.shape[-1] // 2
                a = self.down.quantized_input(gu[:, :f], gu[:, f:], self.activation)
                if a is None:
                    a = self._act(gu[:, :f], gu[:, f:])  # [S, F]
            else:
                a = self._act(self.gate(h, ids), self.up(h, ids))
            y = self.down(a, ids)
        return self._combine(y, w).to(home, dtype)  # [S, C] -> [T, C]


def cpu_expert_layers(cfg: ModelConfig, rt: RuntimeConfig) -> int:
    """How many of the first layers keep their experts in RAM, on the CPU (--cpu-moe: all,
    --n-cpu-moe N: N); a clear error for a model without experts or N past its layers."""
    if not (rt.cpu_moe or rt.n_cpu_moe):
        return 0
    if not cfg.is_moe:
        raise ValueError(
            f"--cpu-moe / --n-cpu-moe: this {cfg.arch} model has no experts (it is not a "
            "mixture-of-experts model)"
        )
    if rt.n_cpu_moe > cfg.n_layers:
        raise ValueError(f"--n-cpu-moe {rt.n_cpu_moe}: the model has only {cfg.n_layers} layers")
    return cfg.n_layers if rt.cpu_moe else rt.n_cpu_moe


def experts_runtime(cfg: ModelConfig, rt: RuntimeConfig, i: int) -> RuntimeConfig | None:
    """Where layer i's experts run when not with the rest: on the CPU, float32, for the layers
    --cpu-moe / --n-cpu-moe name, in the CPU's weights mode: the one `rt` names for the CPU
    ("cuda=quant,cpu=qdot"), else "auto" (qdot: their GGUF blocks on the native kernels; one
    mode for every device is the GPU's). None on a CPU, where they are in RAM already."""
    if i >= cpu_expert_layers(cfg, rt) or rt.device.startswith("cpu"):
        return None
    mode = rt.weights_for("cpu") if "=" in rt.weights else "auto"
    return RuntimeConfig(
        device="cpu", dtype="fp32", weights=mode, threads=rt.threads,
        allow_reference=rt.allow_reference,
    )  # fmt: skip


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
        self.router = r = Router(gm, i, rt, gating)
        self.experts = Experts(
            gm, i, experts_rt or experts_runtime(gm.config, rt, i) or rt, activation
        )
        # experts on this CPU's qdot kernels: the router runs there too, the layer one native
        # call (with the rest on a GPU, h crosses once each way: a float32 copy of the small
        # router stays in RAM), but for steps the experts' offload takes to the GPU
        self._routed = None
        if self.experts.qdot is not None:
            cpu = [
                None if t is None else t.detach().to("cpu", torch.float32)
                for t in (r.weight, r.bias)
            ]
            self._routed = self.experts.qdot.take_router(*cpu, r.gating, r.k, r.norm)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        offload = self.experts.offload
        if self._routed is not None and not (offload is not None and offload.runs(h)):
            return self._routed(h)
        ids, w = self.router(h)
        return self.experts(h, ids, w)
