"""What travels with each micro-batch: the step's metadata, as plain Python (cheap to pickle).

The engine keeps the scheduler and the block manager; a stage only needs, per scheduled
sequence, its new tokens, their positions and the block table covering them, plus the copy-on-
write block copies and, for the last stage, what the sampler reads. Every stage rebuilds the
same SchedulerOutput-shaped view from it, so the ModelRunner runs unchanged in each stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.engine.block_manager import cdiv
from hetero.engine.executor import Step, StepSampling
from hetero.engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class SeqStep:
    """One sequence's share of a step: tokens at positions [start_pos, start_pos + len)."""

    start_pos: int
    tokens: list[int]
    block_tables: list[list[int]]  # per KV cache group: the blocks of 0 .. start_pos + len - 1
    produces_token: bool


@dataclass
class StepPlan:
    micro_batch: int
    seqs: list[SeqStep] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    sampling: StepSampling = field(default_factory=StepSampling)  # for the last stage

    @classmethod
    def build(cls, step: Step, block_size: int) -> StepPlan:
        """The engine's step as plain data; its sampling rows go to the last stage."""
        out = step.out
        plan = cls(step.id, copies=list(out.copies), sampling=step.sampling)
        for s in out.scheduled:
            r, end = s.req, s.start_pos + s.num_new_tokens
            tables = [t[: cdiv(end, block_size)] for t in r.block_tables]
            plan.seqs.append(
                SeqStep(s.start_pos, r.tokens(s.start_pos, end), tables, s.produces_token)
            )
        return plan

    def scheduler_output(self) -> SchedulerOutput:
        """The step as the ModelRunner reads it (views in place of the engine's Requests)."""
        sched = [
            ScheduledRequest(
                req=_SeqView(s),
                num_new_tokens=len(s.tokens),
                start_pos=s.start_pos,
                is_prefill_chunk=len(s.tokens) > 1,
                produces_token=s.produces_token,
            )
            for s in self.seqs
        ]
        return SchedulerOutput(scheduled=sched, copies=self.copies)


class _SeqView:
    """The two things ModelRunner.run reads of a Request: its block tables and its tokens."""

    __slots__ = ("block_tables", "_seq")

    def __init__(self, seq: SeqStep):
        self.block_tables, self._seq = seq.block_tables, seq

    def tokens(self, start: int, end: int) -> list[int]:
        s = self._seq.start_pos
        return self._seq.tokens[start - s : end - s]


@dataclass
class StepResult:
    """The last stage's answer for one micro-batch: one entry per SampleRow, in order."""

    micro_batch: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top: tuple[list, list] | None = None  # (top ids, top logprobs) per row
    stage_s: list[float] = field(default_factory=list)  # each stage's time running the step
