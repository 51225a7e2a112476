"""The distribution a sampled row draws from: penalties and allowed-token masks, then
temperature, top-k, top-p and min-p, as batched torch ops over [B, V] logits.

The sampler (hetero.sampling) draws from it with Gumbel-max; speculative verification compares
a draft's distribution with `probabilities`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from hetero.penalties import apply_penalties

if TYPE_CHECKING:
    from hetero.sampler import SamplingState


def penalized(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """Penalties, logit_bias and min_tokens, then the allowed-token masks (before temperature
    and top-k/p: they see allowed tokens only)."""
    x = logits
    if state.any_repetition or state.any_presence or state.any_frequency:
        x = apply_penalties(
            x,
            state.prompt_ids,
            state.output_ids,
            state.repetition if state.any_repetition else None,
            state.presence if state.any_presence else None,
            state.frequency if state.any_frequency else None,
        )
    if state.bias is not None:
        rows, cols, values = state.bias
        x = x.index_put((rows, cols), values, accumulate=True)  # a new tensor: logits stay raw
    if state.allowed is not None:
        x = x.masked_fill(~unpack_allowed(state.allowed, x.shape[1]), -math.inf)
    return x


def unpack_allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed masks [B, ceil(V / 32)] int32 (bit j of word i: token 32 i + j) -> [B, V] bool."""
    if bits.device.type == "cpu":  # numpy's unpackbits: ~30 us for 150k tokens, the shifts ~1 ms
        flat = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(flat[:, :vocab].view(np.bool_))
    return unpack_on_device(bits, vocab)


def unpack_on_device(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """unpack_allowed in torch ops, for masks on a GPU (one small kernel chain, no host trip)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]


def filtered(x: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """Penalized logits [B, V] -> temperature-scaled, -inf outside top-k / top-p / min-p."""
    x = x / state.temperature[:, None]
    if state.max_top_k or state.any_top_p:
        x = _mask_top_k_top_p(x, state)
    if state.any_min_p:
        # p_v < min_p * p_max  <=>  x_v < x_max + log(min_p); log(0) = -inf keeps all.
        floor = x.amax(-1, keepdim=True) + torch.log(state.min_p)[:, None]
        x = x.masked_fill(x < floor, -math.inf)
    return x


def probabilities(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """The distribution [B, V] a sampled row draws from (penalties, temperature, top-k, top-p,
    min-p): what speculative verification compares a draft's distribution with. Greedy rows
    get a point mass on their argmax."""
    x = penalized(logits.float(), state)
    p = filtered(x, state).softmax(-1)
    if state.any_greedy:
        hot = torch.nn.functional.one_hot(x.argmax(-1), x.shape[1]).to(p.dtype)
        p = torch.where(state.greedy[:, None], hot, p)
    return p


def _mask_top_k_top_p(x: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """x [B, V] scaled logits -> x with -inf outside each row's top-k / top-p set.

    Both cuts become one logit threshold per row, and every token tied with the threshold stays,
    so the result never depends on how a sort orders ties. top-p without top-p rows, or top-k
    on rows with k off, leave the row exactly as it was.
    """
    vocab = x.shape[1]
    neg_inf = torch.full_like(state.top_p, -math.inf)
    if state.any_top_p:
        ranked = x.sort(dim=-1, descending=True, stable=True).values  # [B, V]
    else:  # top-k alone needs only the largest max_top_k values
        ranked = x.topk(min(state.max_top_k, vocab), dim=-1).values
    k = state.top_k.clamp(min=1, max=ranked.shape[1])
    kth = ranked.gather(1, (k - 1)[:, None]).squeeze(1)
    threshold = torch.where(state.top_k > 0, kth, neg_inf)  # [B]
    if state.any_top_p:
        probs = ranked.masked_fill(ranked < threshold[:, None], -math.inf).softmax(-1)
        before = torch.nn.functional.pad(probs.cumsum(-1)[:, :-1], (1, 0))  # mass ahead of each
        # a prefix, >= 1: top_p = 0 keeps the most likely token (and its ties), as OpenAI's does
        kept = (before < state.top_p[:, None]).sum(-1).clamp(min=1)
        cut = ranked.gather(1, (kept - 1)[:, None]).squeeze(1)
        threshold = torch.maximum(threshold, torch.where(state.top_p < 1, cut, neg_inf))
    return x.masked_fill(x < threshold[:, None], -math.inf)
