"""Single-sequence generation over the model's forward pass (what `hetero generate` runs)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hetero.model.contiguous_kv import ContiguousKV
from hetero.model.forward_batch import ForwardBatch
from hetero.model.llama import LlamaModel
from hetero.sampler import sample_next


def generate_ids(
    model: LlamaModel,
    prompt: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids, stopping after a token in `stop_ids`."""
    if not prompt:
        raise ValueError("the prompt is empty")
    cfg = model.config
    total = len(prompt) + max_tokens
    if total > cfg.context_length:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"the model's context of {cfg.context_length}"
        )
    device = model.runtime.device
    kv = ContiguousKV(cfg, total, model.runtime.torch_dtype(), device)
    gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor(prompt, dtype=torch.long, device=device)
    for _ in range(max_tokens):
        n = tokens.shape[0]
        kv.begin(n)
        positions = torch.arange(kv.start, kv.start + n, device=device)
        batch = ForwardBatch(positions, torch.tensor([n - 1], device=device), kv)
        nxt = sample_next(model(tokens, batch), temperature, gen)
        token = int(nxt[0])
        yield token
        if token in stop_ids:
            return
        tokens = nxt
