"""What the scheduler hands a step: each request's span of positions (ScheduledRequest) and the
step as a whole (SchedulerOutput). engine/scheduler.py makes them; the executors run them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetero.engine.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """req computes positions [start_pos, start_pos + num_new_tokens) this step.

    produces_token: the chunk ends at the last known token, so its logits choose the next token
    (a decode, or the last chunk of a prompt); otherwise a middle chunk whose logits are unused.
    is_prefill_chunk: more than one token, or tokens of the prompt (not a plain decode).
    spec_ids: speculative tokens appended after the request's last token (engine/spec/): the
    step computes 1 + len(spec_ids) positions and scores each guess (their logits are wanted).
    """

    req: Request
    num_new_tokens: int
    start_pos: int
    is_prefill_chunk: bool
    produces_token: bool
    spec_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # finished outside update (aborts)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks, before step
    # an overlapped step (Scheduler.advance): its tokens stand as placeholders -1 - i until
    # update() has them; the next step's rows read a placeholder's token from row i of
    # token_source, the step's samples where they lie (set by the engine, read by the runner)
    advanced: bool = False
    token_source: Any = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
