"""Embeddings: a batch of prompts -> one pooled, L2-normalized vector each, from a model's last
hidden states (after the final norm, before the head).

A separate forward over the model's layers, not the engine's step: each prompt attends causally
to itself only, and nothing is written to a KV pool, so embedding requests never take blocks
from generation. Prompts are packed back to back ([T] tokens) in forwards of at most
`max_batch_tokens` tokens.

Pooling comes from the GGUF metadata `{arch}.pooling_type`, as llama.cpp reads it: mean (1), the
first token (cls, 2), the last token (last, 3). A chat model says none (0) or nothing: its
embeddings are the mean over the prompt's tokens (for a causal model every token has read only
what precedes it, so the mean weighs the whole prompt where one position would not). Rank (4,
rerankers) is refused, and so is a model whose `{arch}.attention.causal` is false (this forward
is causal).

    tokens [T] -> final_hidden [T, C] -> per prompt: mean | first | last -> [C] -> x / |x|
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from hetero.kernels import select
from hetero.kernels.paged_sinks import sink_attention
from hetero.model.forward_batch import ForwardBatch

POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
DEFAULT_POOLING = "mean"  # for models that name none (chat models)
MAX_BATCH_TOKENS = 4096


def pooling_of(metadata: dict, arch: str) -> str:
    """The pooling a GGUF file asks for: mean, cls or last (ValueError for what is not served)."""
    if metadata.get(f"{arch}.attention.causal", True) is False:
        raise ValueError(
            f"this {arch} model attends bidirectionally ({arch}.attention.causal is false); "
            "embeddings are computed with causal attention only"
        )
    kind = POOLING_TYPES.get(int(metadata.get(f"{arch}.pooling_type", 0)), "unknown")
    if kind in ("rank", "unknown"):
        raise ValueError(f"{arch}.pooling_type {kind!r} is not an embedding pooling")
    return DEFAULT_POOLING if kind == "none" else kind


class PackedCausal:
    """Attention backend of one forward over packed prompts: each attends causally to itself."""

    def __init__(self, lens: Sequence[int], scale: float, device: torch.device) -> None:
        self.bounds = np.cumsum([0, *lens]).tolist()
        self.scale = scale
        self._attend = select("attention", device).fn

    def __call__(self, layer: int, q, k, v, window: int = 0, sinks=None) -> torch.Tensor:
        out = torch.empty_like(q)  # q [T, H, D], k and v [T, KV, D]
        for a, b in zip(self.bounds, self.bounds[1:]):
            if window or sinks is not None:  # gpt-oss: a sliding window, attention sinks
                pos = torch.arange(b - a, device=q.device)
                out[a:b] = sink_attention(q[a:b], k[a:b], v[a:b], pos, self.scale, window, sinks)
            else:
                out[a:b] = self._attend(q[a:b], k[a:b], v[a:b], 0, self.scale)
        return out


def pool(hidden: torch.Tensor, lens: Sequence[int], pooling: str) -> torch.Tensor:
    """hidden [T, C] of packed prompts -> [N, C] float32, L2-normalized."""
    rows, start = [], 0
    for n in lens:
        h = hidden[start : start + n].float()
        rows.append(h.mean(0) if pooling == "mean" else h[0] if pooling == "cls" else h[-1])
        start += n
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


@torch.inference_mode()
def embed(model, prompts: Sequence[Sequence[int]], pooling: str) -> torch.Tensor:
    """[N, C] float32 embeddings (on the CPU) of token-id prompts, through `model`'s layers."""
    device = torch.device(model.runtime.device)
    scale = model.config.head_dim**-0.5
    out = []
    for group in _groups([len(p) for p in prompts], MAX_BATCH_TOKENS):
        lens = [len(prompts[i]) for i in group]
        tokens = torch.tensor([t for i in group for t in prompts[i]], device=device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(device)
        batch = ForwardBatch(positions, positions[:0], PackedCausal(lens, scale, device))
        out.append(pool(model.final_hidden(tokens, batch), lens, pooling).cpu())
    return torch.cat(out)


def _groups(lens: list[int], budget: int) -> list[list[int]]:
    """Consecutive prompt indices, packed until `budget` tokens (a longer prompt goes alone)."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lens):
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


class Embedder:
    """A loaded model's embeddings: its pooling, context and width, one forward at a time."""

    def __init__(self, gguf, model) -> None:
        if not (model.is_first and model.is_last):
            raise ValueError("embeddings need the whole model in one process (not a pipeline)")
        cfg = gguf.config
        self.pooling = pooling_of(gguf.metadata, cfg.arch)
        self.dimensions = cfg.d_model
        self.max_tokens = cfg.context_length
        self.vocab_size = cfg.vocab_size
        self.model = model
        self._lock = threading.Lock()  # one forward at a time: the model is not reentrant

    @classmethod
    def load(cls, path, runtime) -> Embedder:
        """An embedding model of its own (`--embedding-model`)."""
        from hetero.model.llama import load_model

        return cls(*load_model(path, runtime))

    def check(self, prompts: Sequence[Sequence[int]]) -> None:
        """ValueError naming the first prompt that is empty, too long, or out of the vocabulary."""
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"input[{i}] has no tokens")
            if len(p) > self.max_tokens:
                raise ValueError(
                    f"input[{i}] has {len(p)} tokens; this model embeds at most {self.max_tokens}"
                )
            if any(not 0 <= t < self.vocab_size for t in p):
                raise ValueError(f"input[{i}]: token ids must be in [0, {self.vocab_size})")

    def __call__(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """[N, C] float32 embeddings (ValueError for a bad prompt, see `check`)."""
        self.check(prompts)
        with self._lock:
            return embed(self.model, prompts, self.pooling).numpy()
