"""The engine on its own thread, streamed to asyncio callers (the server).

The engine thread owns the Engine: it alone calls add_request / abort / step. Callers talk to it
through a command queue (each command carries a Future for its result) and receive StepOutputs
on a per-request asyncio.Queue, filled with loop.call_soon_threadsafe. Tokenization and
detokenization stay on the callers' side, off the scheduler's critical path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from hetero.engine.engine import Engine
from hetero.engine.output import StepOutput
from hetero.engine.stats import EngineGauges
from hetero.frontdoor.protocol import EngineDeadError
from hetero.frontdoor.stream import OutputQueue, Pace, paced
from hetero.frontdoor.wire import Abort, EngineInfo
from hetero.sampling import SamplingParams

log = logging.getLogger("hetero.engine")


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    done: concurrent.futures.Future


@dataclass
class _Embed:
    prompts: list[list[int]]
    done: concurrent.futures.Future


class AsyncEngine:
    """An EngineClient (protocol.py) over an engine on a thread of this process."""

    def __init__(self, engine: Engine, on_death: Callable[[str], None] | None = None):
        """on_death(reason): called from the engine thread if the engine fails (it has ended its
        requests with the reason by then)."""
        self.engine = engine
        self.on_death = on_death
        self.tokenizer = engine.tokenizer
        self.info = EngineInfo.of(engine)
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hetero-engine", daemon=True)

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests; abort what is left; join the thread."""
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """shutdown(), then keep the KV prefixes for the next start (when the thread stopped).
        An engine that failed saves nothing (its pool may hold anything) and lets go of what it
        holds (stage processes), so that a new engine can take its memory."""
        self.shutdown(timeout)
        if self._dead is not None:
            self.engine.close()
        elif not self._thread.is_alive():
            saved = self.engine.save_kv_cache()
            if saved:
                log.info("saved %d KV blocks to the disk tier", saved)

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    async def gauges(self) -> EngineGauges:
        """The engine's gauges, read from its objects on the caller's thread (plain integer
        reads, which the engine thread may change a moment later but never leaves torn)."""
        return self.engine.gauges()

    # -- caller side (any thread with an event loop) ------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        pace: Pace | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Stream the StepOutputs of one sequence (see `paced`); aborting it if the caller stops
        listening."""
        if self._dead is not None or self._stop.is_set():
            raise EngineDeadError(f"the engine is not running: {self._dead or 'shutting down'}")
        loop = asyncio.get_running_loop()
        sink = OutputQueue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Add(request_id, prompt_ids, params, sink, loop, done))
        await asyncio.wrap_future(done)  # raises the engine's ValueError for a bad request
        # closed here, not by the collector: the abort must reach the engine when the caller goes
        async with aclosing(paced(sink, pace, lambda: self.abort(request_id))) as outs:
            async for out in outs:
                yield out

    def abort(self, request_id: str) -> None:
        self._commands.put(Abort(request_id))

    async def embed(self, prompts: list[list[int]]):
        """Engine.embed, run by the engine thread between two steps."""
        if self._dead is not None or self._stop.is_set():
            raise EngineDeadError(f"the engine is not running: {self._dead or 'shutting down'}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Embed(prompts, done))
        return await asyncio.wrap_future(done)

    # -- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
        except BaseException as e:  # a dead engine must fail its requests, never hang them
            log.exception("engine thread died")
            self._dead = e
            reason = f"engine error: {type(e).__name__}: {e}"
            self._fail_all(reason)
            if self.on_death is not None:
                self.on_death(reason)
            return
        self._fail_all("the server is shutting down")

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params)
            except ValueError as e:
                cmd.done.set_exception(e)
                return
            self._sinks[cmd.request_id] = (cmd.loop, cmd.sink)
            cmd.done.set_result(None)
        elif isinstance(cmd, Abort):
            self.engine.abort(cmd.request_id)
            self._sinks.pop(cmd.request_id, None)
        elif isinstance(cmd, _Embed):
            try:
                cmd.done.set_result(self.engine.embed(cmd.prompts))
            except Exception as e:  # a refusal or a failed forward: the caller's, not the loop's
                cmd.done.set_exception(e)

    def _deliver(self, outs: list[StepOutput]) -> None:
        """Hand one step's outputs to their callers: one wake-up per event loop, not per output
        (each call_soon_threadsafe writes the loop's self-pipe and takes its lock)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
        for out in outs:
            target = self._sinks.get(out.request_id)
            if target is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            loop, sink = target
            batches.setdefault(loop, []).append((sink, out))
        for loop, items in batches.items():
            _put(loop, _put_all, items)

    def _fail_all(self, reason: str) -> None:
        for rid, (loop, sink) in list(self._sinks.items()):
            out = StepOutput(rid, finished=True, finish_reason="abort", error=reason)
            _put(loop, sink.put_nowait, out)
        self._sinks.clear()
        while True:  # requests that arrived after the end
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Embed)):
                cmd.done.set_exception(EngineDeadError(reason))


def _put_all(items: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for sink, out in items:
        sink.put_nowait(out)


def _put(loop: asyncio.AbstractEventLoop, fn, arg) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
        pass
