"""A contiguous KV cache for one sequence: the simplest attention backend.

Used by `hetero generate` and as a plain reference beside the engine's paged cache.
"""

from __future__ import annotations

import torch

from hetero.config import ModelConfig
from hetero.kernels import select
from hetero.kernels.paged_sinks import sink_attention


class ContiguousKV:
    """k/v per layer: [max_len, KV, D]; tokens [start, start + T) are written by each step."""

    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: str = "cpu"):
        shape = (cfg.n_layers, max_len, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens stored (after the current step completes)
        self.start = 0  # position of the first token of the current step
        self.scale = cfg.head_dim**-0.5
        self._attend = select("attention", torch.device(device)).fn

    def begin(self, n_new: int) -> None:
        if self.length + n_new > self.max_len:
            raise ValueError(
                f"sequence of {self.length + n_new} tokens exceeds the cache of {self.max_len}"
            )
        self.start = self.length
        self.length += n_new

    def __call__(self, layer: int, q, k, v, window: int = 0, sinks: torch.Tensor | None = None):
        end = self.start + q.shape[0]
        self.k[layer, self.start : end] = k
        self.v[layer, self.start : end] = v
        if window or sinks is not None:  # gpt-oss: a sliding window, attention sinks
            pos = torch.arange(self.start, end, device=q.device)
            kc, vc = self.k[layer, :end], self.v[layer, :end]
            return sink_attention(q, kc, vc, pos, self.scale, window, sinks)
        return self._attend(q, self.k[layer, :end], self.v[layer, :end], self.start, self.scale)
