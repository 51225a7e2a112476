"""Overlapped steps: step N + 1 is submitted before step N's tokens reach the host.

Run plainly, a step's host work (the sampled tokens read back, stop checks and outputs, the
server's turn, the next schedule and its inputs) sits between two of the device's steps, and
at one stream on a GPU it is a sizable share of the step. Overlapped, as SGLang's overlap
scheduler and vLLM's async scheduling do it, the engine samples step N on the device, starts
its tokens' copy to the host, schedules and submits step N + 1, and only then waits for step
N's tokens and does N's host work, while the device runs N + 1:

    host    | sample N, advance N, schedule + submit N+1 | wait N's tokens, settle N, serve |
    device  | ... N ...        | sample N |               N + 1 ...                     |

Step N + 1 is scheduled as if every request of N goes on (Scheduler.advance puts a placeholder
-1 - i for row i's token, and a request that placeholder brings to its max_tokens ends there);
its rows read the placeholders' tokens from N's samples on the device (the runner's
`resolve_placeholders`). Settling N puts each token in its place and runs the stop checks; a
request that stopped at N (an end of text, a stop token, a finished grammar) wasted its row of
N + 1, whose token is dropped. Sampling N + 1 happens after N is settled, so its penalties,
seeds, min_tokens and grammar masks see every token before it, as in a plain step.

A guess follows the last token on the host, so steps with guesses run plain: with n-gram
speculation the engine asks after each step whether any request would have a guess (a lookup,
cheap), and runs plain steps while some would, overlapped ones while none would (a request in
its speculation's back-off, a batch past speculation's limit, text with nothing to look up).
A draft model's guesses cost its forward pass to find: with one, and with executors that
sample themselves (a pipeline's last stage), every step runs plain. `EngineConfig.
overlap_schedule` says where the overlap runs ("auto": where the step's logits are on a GPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hetero.engine.executor import ModelOutput
from hetero.engine.output import StepOutput, row_outputs, sampled_lists
from hetero.engine.scheduler import ScheduledRequest, SchedulerOutput
from hetero.sampler import Sampler, SamplerOutput, SamplingStates


@dataclass
class SampledStep:
    """A step sampled on the device whose tokens are on their way to the host."""

    out: SchedulerOutput
    started: float  # when it was submitted
    res: ModelOutput  # its logits dropped: only the step's facts are kept
    producing: list[ScheduledRequest]
    params: list  # each producing row's SamplingParams, as at its submission
    ids: torch.Tensor  # [N] int64 on the device: what the next step's placeholders index
    host: SamplerOutput  # the samples' host copies (filled once `event` has passed)
    event: torch.cuda.Event | None
    # when the samples were there: sampled (a CPU), or the event waited for (settled_tokens);
    # the step's time ends here, not after its host work, which overlaps the next step's
    ready: float = 0.0


def sample_on_device(
    res: ModelOutput,
    out: SchedulerOutput,
    params: list,
    started: float,
    constraints,
    sampler: Sampler,
    states: SamplingStates,
    eos_ids,
) -> SampledStep:
    """Sample every producing row of `out` from res.logits [N, V] (one row a request: no
    guesses), then start the samples' copy to the host. `params`: the rows' SamplingParams as
    submitted (a row's request may have been aborted since: its row is sampled and dropped)."""
    producing = [s for s in out.scheduled if s.produces_token]
    facts = ModelOutput(None, None, res.graphed, res.stages)
    if not producing:
        none = torch.empty(0, dtype=torch.int64)
        return SampledStep(
            out, started, facts, [], [], none, SamplerOutput(none, None, None, None), None,
            time.perf_counter(),
        )  # fmt: skip
    reqs = [s.req for s in producing]
    state = states.make(
        params,
        [r.prompt_ids for r in reqs],
        [r.output_ids for r in reqs],
        [len(r.output_ids) for r in reqs],
        res.logits.device,
        constraints.masks([r.request_id for r in reqs]),  # none for a request gone since
        eos_ids,
    )
    so = sampler(res.logits, state)
    host, event = _to_host(so)
    ready = time.perf_counter()  # (on a GPU: set again once the event has passed)
    return SampledStep(out, started, facts, producing, params, so.token_ids, host, event, ready)


def _to_host(so: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
    """Copies of so's tensors on the host, in flight on a GPU (pinned buffers; the event says
    when they have landed)."""
    if so.token_ids.device.type != "cuda":
        return so, None
    copies = []
    for t in (so.token_ids, so.logprobs, so.top_ids, so.top_logprobs):
        if t is None:
            copies.append(None)
            continue
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        copies.append(h)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(so.token_ids.device))
    return SamplerOutput(*copies), event


def settled_tokens(step: SampledStep, results: dict[str, StepOutput]) -> dict[str, list[int]]:
    """Wait for the step's samples; each live request's token (its StepOutput in `results`).
    Requests finished since the step was submitted are skipped."""
    if step.event is not None:
        step.event.synchronize()
        step.ready = time.perf_counter()
    return row_outputs(step.producing, step.params, *sampled_lists(step.host), results)
