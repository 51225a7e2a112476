"""Verification of guesses: which of a request's speculative tokens the target model accepts.

A request that speculated k tokens g_1..g_k gets k + 1 logits rows from one forward pass: row j
(0 <= j <= k) is the target's distribution p_j of the token after the last token and g_1..g_j.
Each row is sampled exactly as plain decoding samples it (same penalties over the output so far
including g_1..g_j, same temperature/top-k/top-p/min-p, same seeded noise for output index
L + j), giving t_j. Then

    emitted = t_0 .. t_m   where m is the first j with t_j != g_{j+1} (or k when all match)

For an n-gram guess (a point mass on g) this is the standard rejection rule: t_j ~ p_j, so g is
accepted with probability p_j(g), and given a rejection t_j is distributed as p_j with g removed
and renormalized (the residual max(0, p - q) of a point mass q). The Gumbel-max draw of t_j is
the one plain decoding would make, so seeded requests give token for token the output they give
without speculation, and greedy ones (t_j = argmax) the exact greedy output.

A draft model's guesses carry their own distribution q_j; for those rows draft.py's rule
(accept with min(1, p/q), else sample the residual) replaces the comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hetero.rng import gumbel, mix64_tensor, to_int64, uniform
from hetero.sampling import SamplingParams


@dataclass
class Rows:
    """The sampling rows of one verification step, in the runner's logits order."""

    params: list[SamplingParams] = field(default_factory=list)
    prompts: list[Sequence[int]] = field(default_factory=list)
    outputs: list[Sequence[int]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # output index each row samples
    spans: list[tuple[int, int]] = field(default_factory=list)  # rows [lo, hi) per request


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def expand_rows(requests, guesses: Sequence[Sequence[int]], params: Sequence[SamplingParams]):
    """One row per (request, position): the last token's row, then one per guess.

    Row j of a request sees output_ids + guesses[:j] as its output so far (penalties count the
    guesses it would follow); rows of requests without penalties share the list unchanged.
    """
    rows = Rows()
    for req, guess, p in zip(requests, guesses, params, strict=True):
        lo = len(rows.params)
        out = req.output_ids
        for j in range(len(guess) + 1):
            rows.params.append(p)
            rows.prompts.append(req.prompt_ids)
            rows.outputs.append(out + list(guess[:j]) if j and _penalized(p) else out)
            rows.steps.append(len(out) + j)
        rows.spans.append((lo, len(rows.params)))
    return rows


def accept_sampled(sampled: Sequence[int], guess: Sequence[int]) -> list[int]:
    """Tokens a request emits: each row's sample up to and including the first that differs
    from the guess it verifies (sampled has len(guess) + 1 entries)."""
    if len(sampled) != len(guess) + 1:
        raise ValueError(f"{len(sampled)} sampled rows for {len(guess)} guesses")
    out = []
    for j, token in enumerate(sampled):
        out.append(token)
        if j == len(guess) or token != guess[j]:
            break
    return out


def accept_rows(producing, spans, ids: Sequence[int]) -> list[list[int]]:
    """accept_sampled for each scheduled request, given its rows [lo, hi) of ids."""
    return [accept_sampled(ids[lo:hi], s.spec_ids) for s, (lo, hi) in zip(producing, spans)]


_RESIDUAL_SALT = to_int64(0x2545F4914F6CDD1D)  # a second, independent noise stream per key


def draft_rule(
    p: torch.Tensor, q: torch.Tensor, guess: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for one guess per row.

    p, q: [R, V] target and draft distributions; guess: [R] int64 drawn from q; keys: [R] int64
    noise keys. Accept with probability min(1, p(g) / q(g)); otherwise the row's token is drawn
    from the residual max(0, p - q), normalized (p itself when p <= q everywhere, which happens
    only when p = q and the guess is accepted anyway). Returns (accepted [R] bool, token [R]:
    the guess where accepted, else the residual draw).
    """
    pg = p.gather(1, guess[:, None]).squeeze(1)
    qg = q.gather(1, guess[:, None]).squeeze(1)
    u = uniform(keys, 1)[:, 0].to(p.dtype)
    accepted = u * qg < pg  # u < p / q without dividing by a q that rounds to 0
    residual = (p - q).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    noise = gumbel(mix64_tensor(keys + _RESIDUAL_SALT), p.shape[1])
    drawn = (residual.log() + noise).argmax(-1)
    return accepted, torch.where(accepted, guess, drawn)


def accept_draft(rule_tokens: Sequence[int], accepted: Sequence[bool], bonus: int) -> list[int]:
    """A request's tokens from draft_rule's rows (one per guess) and the plain bonus draw."""
    out = []
    for token, ok in zip(rule_tokens, accepted, strict=True):
        out.append(token)
        if not ok:
            return out
    return [*out, bonus]
