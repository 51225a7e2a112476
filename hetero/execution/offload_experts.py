"""Prompt steps run the experts kept in RAM (--cpu-moe, --n-cpu-moe) on the GPU, streamed over PCIe.

A decode step's tokens choose k experts each, a few MB of their weights: the CPU reads them where
they are (the layer's one native call, model/moe_qdot.py). A prompt step of hundreds of tokens
chooses nearly every expert of every layer, and multiplies each by many rows: the CPU would need
seconds where the GPU needs milliseconds, and a layer's experts cross PCIe in a few. So, as
llama.cpp's op offload does for its CPU experts, a step of at least `min_tokens` tokens that
gives each expert SLOTS_PER_EXPERT rows on average runs each such layer's experts on the GPU, the
router and the rest of the layer being there already:

    gate, up, down (pinned RAM, the qdot kernels' own bytes) --H2D, copy stream--> staging[i % 2]
        --> GGUF blocks (the packing undone) --> the GPU kernel's layout (prepare_weight)
        --> moe_matmul(h, ids) on the GPU, the activation, moe_matmul, the weighted sum

The experts are the CPU kernels' own buffers, pinned once at start: no second copy in RAM. The
two staging buffers (each one layer's experts) alternate, so the next layer's copy overlaps this
layer's work and its attention; layers are prefetched in the order the forward meets them, the
first again after the last (the next chunk of a long prompt starts there). A call out of that
order is fetched on the spot: the order is a speed matter, never a correctness one.
"""

from __future__ import annotations

import torch

from hetero.execution.offload import Staging
from hetero.kernels import cpu_qdot, select
from hetero.kernels.cpu_qdot_moe import PackedExperts
from hetero.kernels.moe import activation_fn
from hetero.kernels.registry import prepare_weight
from hetero.model.moe import ACTIVATIONS, Experts, SparseMoE

# Streamed only where the step gives each expert this many rows on average (T k / E): below, the
# CPU reads each chosen expert once for a few rows at RAM speed, as fast as PCIe would carry it
SLOTS_PER_EXPERT = 8


def streams_experts(tokens: int, n_experts: int, k: int, min_tokens: int) -> bool:
    """Whether a step of `tokens` tokens runs RAM experts on the GPU (the planner prices it so)."""
    return 0 < min_tokens <= tokens and tokens * k >= SLOTS_PER_EXPERT * n_experts


class StreamedExperts:
    def __init__(self, layers: list[Experts], k: int, device: torch.device, min_tokens: int):
        """layers: in the order the forward meets them; k: experts a token."""
        self.device, self.min_tokens, self.k = device, min_tokens, k
        self.n_experts = layers[0].qdot.n_experts
        self.layers = layers
        self.next_of = {id(a): b for a, b in zip(layers, layers[1:] + layers[:1])}
        self.moe_matmul = select("moe_matmul", device)
        self.combine = select("moe_combine", device).fn
        self.activation = {a: activation_fn(a, device) for a in ACTIVATIONS}
        cuda = device.type == "cuda"
        self.pinned_bytes = sum(e.qdot.pin_memory() if cuda else 0 for e in layers)
        self.biases = {  # small ([E, N] a part, float32): on the device for good
            id(e): [None if b is None else b.to(device) for b in e.qdot.layer.biases]
            for e in layers
        }
        self.staging = Staging(max(Staging.room(self._bytes(e)) for e in layers), device)
        self.calls = 0  # layers run here (tests, benchmarks)
        for e in layers:
            e.offload = self

    @classmethod
    def install(cls, models, min_tokens: int, device) -> StreamedExperts | None:
        """Streaming of the experts that models on `device` keep in RAM (None, no such experts
        or no min_tokens: nothing to stream)."""
        if not min_tokens or device is None:
            return None
        device = torch.device(device)
        moes = [m for model in models if torch.device(model.runtime.device).type == device.type
                for m in model.modules() if isinstance(m, SparseMoE)
                and m.experts.qdot is not None and m.experts.device.type == "cpu"]  # fmt: skip
        if not moes:
            return None
        return cls([m.experts for m in moes], moes[0].router.k, device, min_tokens)

    @property
    def first(self) -> int:
        """The fewest tokens of a step that streams (fewer: the CPU reads the experts)."""
        return max(self.min_tokens, -(-SLOTS_PER_EXPERT * self.n_experts // self.k))

    def describe(self) -> str:
        first = self.first
        return (
            f"prompt steps of >= {first} tokens run the experts of {len(self.layers)} "
            f"layers on {self.device}, streaming {self.pinned_bytes / 2**30:.2f} GiB of pinned "
            "weights"
        )

    def runs(self, h: torch.Tensor) -> bool:
        """Whether the experts of a step with these hidden states run here (Experts asks)."""
        return h.device.type == self.device.type and streams_experts(
            h.shape[0], self.n_experts, self.k, self.min_tokens
        )

    @staticmethod
    def _bytes(experts: Experts) -> list[torch.Tensor]:
        return [p.packed for p in experts.qdot.parts]

    def __call__(
        self, experts: Experts, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """h [T, C], ids [T, k], w [T, k] on the device -> [T, C] there: experts(h, ids, w), in
        h's dtype."""
        self.calls += 1
        parts = experts.qdot.parts
        views, b = self.staging.take(id(experts), self._bytes(experts))
        nxt = self.next_of[id(experts)]
        blocks = [self._blocks(p, v) for p, v in zip(parts, views)]
        self.staging.release(b)  # the staged bytes are read
        self.staging.stage(id(nxt), self._bytes(nxt))  # into the other buffer, meanwhile
        bg, bu, bd = self.biases[id(experts)]
        gate = self._matmul(h, parts[0], blocks[0], ids, bg)
        up = self._matmul(h, parts[1], blocks[1], ids, bu)
        a = self.activation[experts.activation](gate, up)
        o = self._matmul(a, parts[2], blocks[2], ids, bd)
        return self.combine(o, w).to(h.dtype)

    @staticmethod
    def _blocks(p: PackedExperts, staged: torch.Tensor) -> torch.Tensor:
        """The GGUF blocks [E, N, row bytes] of a part, from its packed bytes on the device."""
        e = p.n_experts
        rows = e * staged.shape[1] * cpu_qdot.GROUP  # the packed rows, each expert's padded
        w = cpu_qdot.QdotWeight(p.ggml_type, rows, p.k, staged.reshape(-1, *staged.shape[2:]))
        return cpu_qdot.gguf_bytes(w).reshape(e, rows // e, -1)[:, : p.n].contiguous()

    def _matmul(self, x, p: PackedExperts, blocks, ids, bias) -> torch.Tensor:
        shape = (p.n_experts, p.n, p.k)
        weight = prepare_weight(self.moe_matmul, blocks, int(p.ggml_type), shape)
        return self.moe_matmul.fn(x, weight, int(p.ggml_type), shape, ids, bias)
