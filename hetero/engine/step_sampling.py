"""Sampling one step's logits in the engine: every row, then each request's accepted tokens.

Rows come as ModelRunner.run gives them: one per token-producing request, or 1 + k for one that
carried k speculative guesses (the last known token's row, then each guess's). Every row is
sampled in one batched call; verification (spec/verify.py, or the speculator's own rule) then
keeps each request's accepted guesses and the token after them.
"""

from __future__ import annotations

import torch

from hetero.engine.output import StepOutput, TokenLogprob, sampled_lists
from hetero.engine.scheduler import ScheduledRequest
from hetero.engine.spec.verify import accept_rows, expand_rows
from hetero.sampler import Sampler, SamplingStates


def sample_logits(
    logits: torch.Tensor,
    producing: list[ScheduledRequest],
    params: dict,
    constraints,
    sampler: Sampler,
    states: SamplingStates,
    spec,
    eos_ids,
    results: dict[str, StepOutput],
) -> dict[str, list[int]]:
    """Sample `logits` [N, V] and fill `results` with each request's StepOutput; returns request
    id -> its new tokens. `states` makes the rows' SamplingState (make_batch's, kept between
    steps while it cannot change)."""
    reqs = [s.req for s in producing]
    plist = [params[r.request_id] for r in reqs]
    rows = expand_rows(reqs, [s.spec_ids for s in producing], plist)
    row_ids = [r.request_id for r, (lo, hi) in zip(reqs, rows.spans) for _ in range(lo, hi)]
    state = states.make(
        rows.params,
        rows.prompts,
        rows.outputs,
        rows.steps,
        logits.device,
        constraints.masks(row_ids),  # constrained requests never guess: one row each
        eos_ids,  # masked while a row is short of its min_tokens
    )
    ids, lps, tops = sampled_lists(sampler(logits, state))
    if spec is None:
        accepted = accept_rows(producing, rows.spans, ids)
    else:
        accepted = spec.accept(producing, rows.spans, ids, logits, state, sampler)
    sampled = {}
    for s, p, (lo, hi), tokens in zip(producing, plist, rows.spans, accepted):
        req = s.req
        sampled[req.request_id] = tokens
        o = results[req.request_id] = StepOutput(
            req.request_id,
            list(tokens),
            None,
            False,
            None,
            req.num_prompt_tokens,
            req.num_cached_tokens,
        )
        if p.logprobs is not None:
            o.logprobs = [
                TokenLogprob(
                    t,
                    lps[i] if t == ids[i] else float(logits[i].log_softmax(-1)[t]),
                    [] if tops is None else list(zip(tops[0][i], tops[1][i]))[: p.logprobs],
                )
                for i, t in zip(range(lo, hi), tokens)
            ]
    return sampled
