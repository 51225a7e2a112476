"""Where one request's time went inside the engine, reported as data when it finishes.

The engine stamps each request as it moves: arrival (add_request), admission (the scheduler
gives it KV blocks), the first step that computes it, then every step it takes part in:

    arrival -- queue -- admitted -- restore -- first step -- prefill chunks -- decode steps --|
                         (a prefix hit in RAM or on disk is copied back before it is scheduled)

`RequestTimeline` sums the phases (always: a few additions per request and step) and, when the
engine is asked for them (EngineConfig.trace_steps > 0), keeps that many `StepRecord`s of the
steps it ran in: what kind, how many of its tokens, when, how long, and the stages (device,
seconds) the step went through. The last StepOutput of a request carries its timeline; the
server turns it into log fields and traces (text stays there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# stage timings of a step as the executor reports them: (where it ran, seconds or None)
Stages = tuple[tuple[str, float | None], ...]


@dataclass(slots=True)
class StepRecord:
    """One step a request took part in."""

    step: int  # the engine's step number (1 = its first step since start)
    kind: str  # "prefill" (prompt tokens: a chunk, or a recompute), "decode" or "verify"
    tokens: int  # of this request's rows in the step
    start_s: float  # when the step was submitted, seconds after the request arrived
    seconds: float  # the step's time (the engine's measure: submit or last collect to collect)
    batch: int  # requests in the step
    stages: Stages  # each stage it went through, in order: (device, seconds where measured)


@dataclass(slots=True)
class RequestTimeline:
    """Phase sums of one request (seconds), its speculation, and its first steps."""

    arrival: float  # perf_counter at add_request (this process's clock; not reported)
    queue_s: float = 0.0  # arrival -> admitted
    restore_s: float = 0.0  # admitted -> first step: its prefix copied back from RAM or disk
    prefill_s: float = 0.0
    prefill_chunks: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    preemptions: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    steps_dropped: int = 0  # steps past the kept number
    started: bool = False

    def first_step(self, admitted: float | None, submitted: float) -> None:
        admitted = submitted if admitted is None else min(admitted, submitted)
        self.queue_s = max(0.0, admitted - self.arrival)
        self.restore_s = submitted - admitted
        self.started = True

    def summary(self) -> dict[str, float | int]:
        """The phase sums as plain numbers (for logs and traces)."""
        return {
            "queue_s": self.queue_s,
            "restore_s": self.restore_s,
            "prefill_s": self.prefill_s,
            "prefill_chunks": self.prefill_chunks,
            "decode_s": self.decode_s,
            "decode_steps": self.decode_steps,
            "spec_proposed": self.spec_proposed,
            "spec_accepted": self.spec_accepted,
            "preemptions": self.preemptions,
        }


class Timelines:
    """The engine's side: a timeline per request (kept on the Request), updated once a step."""

    def __init__(self, keep_steps: int = 0) -> None:
        self.keep_steps = keep_steps

    @staticmethod
    def new() -> RequestTimeline:
        return RequestTimeline(time.perf_counter())

    def observe(
        self,
        step: int,
        out,
        submitted: float,
        seconds: float,
        stages: Stages,
        sampled: dict[str, list[int]],
    ) -> None:
        """A collected step: `out` the SchedulerOutput it ran, `sampled` each producing
        request's tokens (accepted guesses and the token after them)."""
        batch = len(out.scheduled)
        for s in out.scheduled:
            req = s.req
            tl = req.timeline
            if tl is None or s.produces_token and req.request_id not in sampled:
                continue  # (a row dropped: its request ended before the step came back)
            if not tl.started:
                tl.first_step(req.admitted, submitted)
            if s.is_prefill_chunk and not s.spec_ids:
                kind = "prefill"
                tl.prefill_s += seconds
                tl.prefill_chunks += 1
            else:
                kind = "verify" if s.spec_ids else "decode"
                tl.decode_s += seconds
                tl.decode_steps += 1
            if s.spec_ids:
                got = sampled.get(req.request_id)
                tl.spec_proposed += len(s.spec_ids)
                tl.spec_accepted += 0 if got is None else len(got) - 1
            if len(tl.steps) < self.keep_steps:
                start = submitted - tl.arrival
                rec = StepRecord(step, kind, s.num_new_tokens, start, seconds, batch, stages)
                tl.steps.append(rec)
            elif self.keep_steps:
                tl.steps_dropped += 1

    @staticmethod
    def finish(req) -> RequestTimeline | None:
        """The request's timeline as it ends (None for one the engine never timed)."""
        tl = req.timeline
        if tl is not None:
            tl.preemptions = req.num_preemptions
            if not tl.started:  # ended before any step (refused, aborted, failed in the queue)
                tl.queue_s = time.perf_counter() - tl.arrival
        return tl
