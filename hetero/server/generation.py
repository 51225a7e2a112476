"""One HTTP request's sequences on the AsyncEngine: n choices per prompt, as one event stream.

Each choice is its own engine sequence (`params.for_sequence(i)`, as `hetero.llm` does), with a
TextStream that turns its token ids into text deltas on the event loop's thread. The events of
all choices are merged in arrival order. Closing the stream early (a client gone, a handler
cancelled) closes every sequence's engine generator, which aborts it and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

from hetero.engine.output import TokenLogprob
from hetero.frontdoor.thread import AsyncEngine, Pace
from hetero.sampling import SamplingParams
from hetero.server.access_log import attach_job
from hetero.server.metrics import Metrics, SequenceClock
from hetero.text_stream import TextStream


@dataclass
class Event:
    """What one engine step did for one choice."""

    index: int
    delta: str
    logprobs: list[TokenLogprob] | None  # of this step's tokens, when asked for
    finish_reason: str | None  # set on the choice's last event
    error: str | None = None  # why the engine stopped it early (shutdown, engine failure)


class Choice:
    __slots__ = (
        "index",
        "prompt",
        "stream",
        "clock",
        "started",
        "cached_tokens",
        "error",
        "timeline",
        "logprobs",
    )

    def __init__(self, index: int, prompt: int, stream: TextStream, clock: SequenceClock):
        self.index = index
        self.prompt = prompt  # which prompt of the request
        self.stream = stream
        self.clock = clock
        self.started = False  # the engine admitted it (its first step came)
        self.cached_tokens = 0
        self.error: str | None = None
        self.timeline = None  # the engine's RequestTimeline, with the last output
        self.logprobs: list[float] | None = None  # every output token's, for a request trace

    @property
    def finished(self) -> bool:
        return self.stream.finished


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Job:
    """The sequences of one request: `n` choices for each prompt, indexed prompt-major."""

    def __init__(
        self,
        ae: AsyncEngine,
        tokenizer,
        metrics: Metrics,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        prefix: str,
        pace: Pace | None = None,
    ) -> None:
        self.ae = ae
        self.pace = pace  # how long a stream waits between events (ServerState.pace)
        self.metrics = metrics
        self.prompts = list(prompts)
        self.params = params
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.choices = [
            Choice(
                p * params.n + i,
                p,
                TextStream(tokenizer, params.for_sequence(i), p * params.n + i),
                SequenceClock(metrics, self.arrival),
            )
            for p in range(len(self.prompts))
            for i in range(params.n)
        ]
        # the request's log record; a traced one keeps every token's logprob
        self.record = attach_job(self)
        self.traced = self.record is not None and self.record.traced

    async def events(self) -> AsyncIterator[Event]:
        """Every choice's events until all are finished (ValueError: the engine refused one)."""
        streams = [self._sequence(c) for c in self.choices]
        try:
            async with aclosing(_merge(streams)) as merged:
                async for event in merged:
                    yield event
        finally:
            self._count_finished()

    async def run(self) -> None:
        """Run every choice to its end (the non-streaming responses)."""
        async with aclosing(self.events()) as events:
            async for _ in events:
                pass

    async def _sequence(self, choice: Choice) -> AsyncIterator[Event]:
        sid = f"{self.id}/{choice.index}"
        prompt = self.prompts[choice.prompt]
        stream = choice.stream
        params = stream.params
        if self.traced:  # the engine computes the chosen tokens' logprobs; the client's answer
            choice.logprobs = []  # shows them only if it asked (stream.params)
            params = replace(params, logprobs=params.logprobs or 0)
        async with aclosing(self.ae.generate(sid, prompt, params, self.pace)) as steps:
            async for step in steps:
                if choice.logprobs is not None and step.logprobs:
                    choice.logprobs += [lp.logprob for lp in step.logprobs]
                if step.timeline is not None:
                    choice.timeline = step.timeline
                if choice.clock.last is None and step.num_prompt_tokens:
                    choice.started = True
                    choice.cached_tokens = step.num_cached_tokens
                    self.metrics.sequence_started(step.num_prompt_tokens, step.num_cached_tokens)
                delta = stream.add(step)
                choice.clock.tokens(len(step.new_token_ids))
                if step.error:
                    choice.error = step.error
                yield Event(
                    choice.index, delta, stream.step_logprobs, stream.out.finish_reason, step.error
                )
                if stream.finished:  # a stop string ends it before the engine knows: abort there
                    return

    def _count_finished(self) -> None:
        started = {c.prompt for c in self.choices if c.started}
        self.metrics.prompt_tokens += sum(len(self.prompts[p]) for p in started)
        for c in self.choices:
            reason = c.stream.out.finish_reason if c.finished else "cancelled"
            self.metrics.finished[reason] += 1
            self.metrics.generation_tokens += len(c.stream.out.token_ids)
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error), None)

    def usage(self) -> Usage:
        cached = [0] * len(self.prompts)
        for c in self.choices:  # the prompt is shared: count it once, with its best hit
            cached[c.prompt] = max(cached[c.prompt], c.cached_tokens)
        return Usage(
            sum(len(p) for p in self.prompts),
            sum(len(c.stream.out.token_ids) for c in self.choices),
            sum(cached),
        )


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


async def _merge(streams: list[AsyncIterator[Event]]) -> AsyncIterator[Event]:
    """Items of all streams as they come; an error in one stops all and is raised."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[Event]) -> None:
        try:
            async with aclosing(stream) as s:  # type: ignore[type-var]
                async for item in s:
                    queue.put_nowait(item)
        except Exception as e:
            queue.put_nowait(_Raised(e))
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, _Raised):
                raise item.error
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
