"""One sequence's outputs on their way to a caller on an event loop (every front door's).

The engine side puts a sequence's StepOutputs on its OutputQueue; the caller reads them through
`paced`, which merges what waited in the queue and spaces events out (--stream-interval-ms).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from hetero.engine.output import StepOutput

Pace = Callable[[], float]  # seconds a stream waits after an output before it takes the next


class OutputQueue(asyncio.Queue):
    """One sequence's outputs (put from the event loop's thread). `ended` is set once the last
    one (finished, or an exception) is in: a paced stream stops waiting for its interval then,
    so a client gets the end of its answer (and sends its next request) at once."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = asyncio.Event()

    def put_nowait(self, item) -> None:
        super().put_nowait(item)
        if isinstance(item, Exception) or item.finished:
            self.ended.set()


async def paced(
    sink: OutputQueue, pace: Pace | None, abort: Callable[[], None]
) -> AsyncIterator[StepOutput]:
    """One sequence's outputs from its queue, until the finished one; `abort` when the caller
    stops listening first. An exception in the queue (the engine refused the request) is raised.

    Every output waiting in the queue is taken at once, merged (merge_outputs). After each output
    the stream waits `pace()` seconds (none while it returns 0) before it looks again, so the
    steps of that time arrive as one output: the caller's work per output (detokenizing, one
    event, one socket write) is then paid once per interval instead of once per step. The first
    output never waits, and neither does the last: its arrival (sink.ended) cuts the wait short.
    """
    loop = asyncio.get_running_loop()
    last = None
    finished = False
    try:
        while not finished:
            if last is not None and pace is not None:
                wait = last + pace() - loop.time()
                if wait > 0 and not sink.ended.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(sink.ended.wait(), wait)
            out = await sink.get()
            while True:
                if isinstance(out, Exception):
                    finished = True  # the engine has forgotten it: nothing to abort
                    raise out
                if out.finished or sink.empty():
                    break
                nxt = sink.get_nowait()
                out = nxt if isinstance(nxt, Exception) else merge_outputs(out, nxt)
            finished = out.finished
            yield out
            last = loop.time()
    finally:
        if not finished:
            abort()


def merge_outputs(a: StepOutput, b: StepOutput) -> StepOutput:
    """Two consecutive steps of one sequence as one (b is the later).

    A caller that fell behind the engine (a busy event loop, many streams) takes every step
    waiting in its queue at once, as one output: it then detokenizes, encodes and writes once
    per wake-up instead of once per step, so its work shrinks exactly when it is the bottleneck
    (vLLM's output collector merges the same way).
    """
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    return StepOutput(
        b.request_id,
        a.new_token_ids + b.new_token_ids,
        logprobs,
        b.finished,
        b.finish_reason,
        b.num_prompt_tokens or a.num_prompt_tokens,
        b.num_cached_tokens or a.num_cached_tokens,
        b.error or a.error,
        b.timeline or a.timeline,
    )
