"""What one engine step gives back per request: token ids (and their logprobs), never text."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.engine.request import Request
from hetero.engine.timeline import RequestTimeline, Timelines
from hetero.sampling import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens and their logprobs, best first


@dataclass
class StepOutput:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    timeline: RequestTimeline | None = None  # on the last output: where the request's time went


def sampled_lists(so) -> tuple[list[int], list[float] | None, tuple[list, list] | None]:
    """A SamplerOutput as host lists: token ids, their logprobs, (top ids, top logprobs)."""
    ids = so.token_ids.tolist()
    lps = None if so.logprobs is None else so.logprobs.tolist()
    tops = None if so.top_ids is None else (so.top_ids.tolist(), so.top_logprobs.tolist())
    return ids, lps, tops


def token_output(req: Request, p: SamplingParams, i: int, ids, lps, tops) -> StepOutput:
    """The StepOutput of row i of a sampled step (with its logprobs when p asks for them)."""
    o = StepOutput(
        req.request_id, [ids[i]], None, False, None, req.num_prompt_tokens, req.num_cached_tokens
    )
    if p.logprobs is not None:
        top = [] if tops is None else list(zip(tops[0][i], tops[1][i]))[: p.logprobs]
        o.logprobs = [TokenLogprob(ids[i], lps[i], top)]
    return o


def row_outputs(producing, params, ids, lps, tops, results) -> dict[str, list[int]]:
    """Each producing request's token from row i of a step sampled one row a request (`params`:
    the rows' SamplingParams, None where a request is gone), its StepOutput into `results`. A
    request finished since the step was submitted (aborted) is skipped: its row is dropped."""
    sampled = {}
    for i, (s, p) in enumerate(zip(producing, params, strict=True)):
        req = s.req
        if p is None or req.is_finished:
            continue
        sampled[req.request_id] = [ids[i]]
        results[req.request_id] = token_output(req, p, i, ids, lps, tops)
    return sampled


def final_output(req: Request, error: str | None = None) -> StepOutput:
    """The last output of a request that ends without a token (failed, aborted, refused)."""
    return StepOutput(
        req.request_id,
        finished=True,
        finish_reason=req.finish_reason if error is None else "abort",
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
        error=req.error if error is None else error,
        timeline=Timelines.finish(req),
    )
