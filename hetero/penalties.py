"""Repetition, presence and frequency penalties over a batch of logits, on the device.

Semantics (the ones vLLM and the OpenAI API document):
- repetition (HF `RepetitionPenaltyLogitsProcessor`, vLLM): for every token seen in the prompt
  or the output so far, a positive logit is divided by the penalty and a negative (or zero) one
  multiplied by it, so a penalty > 1 always makes the token less likely;
- frequency and presence (OpenAI): over output tokens only,
  logit -= frequency * count + presence * (count > 0).
Repetition comes first, then frequency and presence, as in vLLM. A row whose penalties are
neutral (1, 0, 0) comes out bit for bit unchanged (x / 1, x * 1 and x - 0 are exact), which keeps
a request's result independent of the other rows in its batch.
"""

from __future__ import annotations

import torch

PAD_ID = -1  # padding in the [B, L] token-id tensors built on the host


def _scatter_index(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Padding goes to the spare column `vocab_size`, sliced off afterwards. Ids outside
    [0, V) go there too: checking them would need a host sync, and an out-of-range scatter
    would be a device-side assert that takes the whole CUDA context down."""
    return torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)


def token_counts(ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """ids [B, L] int64 padded with PAD_ID -> counts [B, V] of each token per row."""
    index = _scatter_index(ids, vocab_size)
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=dtype, device=ids.device)
    counts.scatter_add_(1, index, torch.ones(index.shape, dtype=dtype, device=ids.device))
    return counts[:, :vocab_size]


def token_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids [B, L] int64 padded with PAD_ID -> bool [B, V], True where the token occurs."""
    index = _scatter_index(ids, vocab_size)
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, index, True)
    return mask[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor | None,
    output_ids: torch.Tensor | None,
    repetition: torch.Tensor | None,
    presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
) -> torch.Tensor:
    """logits [B, V] float32 -> penalized copy [B, V].

    prompt_ids [B, Lp] / output_ids [B, Lo]: int64 padded with PAD_ID (None: no tokens).
    repetition / presence / frequency: [B] float32, or None where no row uses that penalty.
    """
    batch, vocab = logits.shape
    counts = None
    if output_ids is not None and output_ids.shape[1] > 0:
        if output_ids.shape[0] != batch:
            raise ValueError(f"output_ids has {output_ids.shape[0]} rows for {batch} logits rows")
        counts = token_counts(output_ids, vocab, logits.dtype)
    if repetition is not None:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        if prompt_ids is not None and prompt_ids.shape[1] > 0:
            if prompt_ids.shape[0] != batch:
                raise ValueError(f"prompt_ids has {prompt_ids.shape[0]} rows for {batch} rows")
            seen |= token_mask(prompt_ids, vocab)
        if counts is not None:
            seen |= counts > 0
        r = repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if counts is not None and (presence is not None or frequency is not None):
        if frequency is not None:
            logits = logits - frequency[:, None] * counts
        if presence is not None:
            logits = logits - presence[:, None] * (counts > 0).to(logits.dtype)
    return logits
