"""The server's end of the engine process (process.py): the EngineClient interface over two
pipes.

Everything here runs on the server's event loop except `close` (called from a worker thread
while the loop keeps running). Outputs are read by the loop itself (`add_reader` on the pipe),
with no thread between: a step's message is unpickled and its outputs put on the per-request
queues in one callback. Commands are small pickled tuples written under a lock.

The engine process dying (a crash, the OOM killer, a kill -9) ends its pipe: every request in
flight gets a final output saying so, new requests are refused, and `on_death` tells the
supervisor (supervisor.py), which starts another engine process or gives up with the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import pickle
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from hetero.engine.output import StepOutput
from hetero.engine.stats import EngineGauges
from hetero.exit_status import exit_reason
from hetero.frontdoor.process import engine_main
from hetero.frontdoor.protocol import EngineDeadError, EngineLoadError
from hetero.frontdoor.stream import OutputQueue, Pace, paced
from hetero.frontdoor.wire import (
    Abort,
    Add,
    Died,
    Embed,
    Embedded,
    EngineInfo,
    GaugesQuery,
    GaugesReply,
    LoadFailed,
    Ready,
    Shutdown,
    StepDone,
    dumps,
)
from hetero.sampling import SamplingParams

log = logging.getLogger("hetero.engine")
PIPE_BYTES = 1 << 20  # Linux's default cap for a pipe (64 KiB is the default size)
READ_BURST = 64  # messages handled per wake-up at most, so one busy engine cannot starve HTTP
GAUGES_TIMEOUT_S = 5.0  # the engine answers between steps


class EngineProcess:
    """Start with `await EngineProcess(...).start()`; then an EngineClient (protocol.py)."""

    def __init__(self, model_path, launch, tokenizer, on_death: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.on_death = on_death
        self.info: EngineInfo | None = None
        self.dead: str | None = None  # why no request can be served any more
        self._closing = False
        self._sinks: dict[str, asyncio.Queue] = {}
        self._gauges: dict[int, asyncio.Future] = {}
        self._embeds: dict[int, asyncio.Future] = {}
        self._last_gauges: EngineGauges | None = None
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._ready: asyncio.Future | None = None
        self._loaded = False
        ctx = mp.get_context("spawn")  # CUDA cannot be forked, nor can a process with threads
        cmd_r, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_w = ctx.Pipe(duplex=False)
        _widen(self._out)
        level = logging.getLogger().getEffectiveLevel()
        # Not a daemon process: a pipeline engine starts its stage processes from it.
        self.proc = ctx.Process(
            target=engine_main,
            args=(cmd_r, out_w, str(model_path), launch, level),
            name="hetero-engine",
        )
        self._ends = (cmd_r, out_w)

    async def start(self) -> EngineProcess:
        """Spawn the process and wait until its engine is loaded (EngineLoadError: why not)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._ready = loop.create_future()
        self.proc.start()
        for end in self._ends:  # the child's ends: closed here, so its death reads as EOF
            end.close()
        log.info("engine process started (pid %d)", self.proc.pid)
        loop.add_reader(self._out.fileno(), self._on_readable)
        self.info = await self._ready
        return self

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    # -- requests ------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        pace: Pace | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Stream the StepOutputs of one sequence (stream.paced); aborting it if the caller stops
        listening. A request the engine refused raises ValueError with its reason."""
        if self.dead is not None or self._closing:
            raise EngineDeadError(f"the engine is not running: {self.dead or 'shutting down'}")
        sink = OutputQueue()
        self._sinks[request_id] = sink
        self._send(Add(request_id, prompt_ids, params))
        # closed here, not by the collector: the abort must reach the engine when the caller goes
        async with aclosing(paced(sink, pace, lambda: self.abort(request_id))) as outs:
            async for out in outs:
                yield out

    def abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None and self.dead is None:
            self._send(Abort(request_id))

    async def gauges(self) -> EngineGauges | None:
        """The engine's gauges, asked of the process (None when it cannot answer)."""
        if self.dead is not None or self._closing:
            return None
        token = next(self._tokens)
        fut = self._gauges[token] = asyncio.get_running_loop().create_future()
        self._send(GaugesQuery(token))
        try:
            self._last_gauges = await asyncio.wait_for(fut, GAUGES_TIMEOUT_S)
        except TimeoutError:  # a step longer than that (a long prefill on a CPU): the last ones
            pass
        finally:
            self._gauges.pop(token, None)
        return self._last_gauges

    async def embed(self, prompts: list[list[int]]):
        """Engine.embed in the engine process (ValueError: its refusal; RuntimeError: it
        failed)."""
        if self.dead is not None or self._closing:
            raise EngineDeadError(f"the engine is not running: {self.dead or 'shutting down'}")
        token = next(self._tokens)
        fut = self._embeds[token] = asyncio.get_running_loop().create_future()
        self._send(Embed(token, prompts))
        try:
            return await fut
        finally:
            self._embeds.pop(token, None)

    def _send(self, msg) -> None:
        data = dumps(msg)
        try:
            with self._lock:
                self._cmd.send_bytes(data)
        except OSError:  # the process is gone; the reader sees its pipe end and says so
            pass

    # -- outputs (on the event loop) -----------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            for _ in range(READ_BURST):
                self._handle(pickle.loads(self._out.recv_bytes()))
                if not self._out.poll(0):
                    return
        except (EOFError, OSError):
            self._ended()

    def _handle(self, msg) -> None:
        if isinstance(msg, StepDone):
            sinks = self._sinks
            for t in msg.outputs:
                sink = sinks.get(t[0])
                if sink is not None:
                    if t[3]:  # finished: the engine has forgotten it
                        del sinks[t[0]]
                    sink.put_nowait(StepOutput(*t))
            for rid, message in msg.refused:
                sink = sinks.pop(rid, None)
                if sink is not None:
                    sink.put_nowait(ValueError(message))  # raised in its handler
        elif isinstance(msg, GaugesReply):
            fut = self._gauges.get(msg.token)
            if fut is not None and not fut.done():
                fut.set_result(msg.gauges)
        elif isinstance(msg, Embedded):
            fut = self._embeds.get(msg.token)
            if fut is not None and not fut.done():
                if msg.error is None:
                    fut.set_result(msg.vectors)
                else:
                    refused, message = msg.error
                    fut.set_exception((ValueError if refused else RuntimeError)(message))
        elif isinstance(msg, Ready):
            self._loaded = True
            self._ready.set_result(msg.info)
        elif isinstance(msg, LoadFailed):
            self._ready.set_exception(EngineLoadError(msg.message))
        elif isinstance(msg, Died):
            self.dead = msg.message

    def _ended(self) -> None:
        """The pipe ended: the process exited (asked to, or not)."""
        self._loop.remove_reader(self._out.fileno())
        self.proc.join(2.0)
        if self._closing:
            reason = "the server is shutting down"
        else:
            self.dead = self.dead or f"the engine process died ({exit_reason(self.proc.exitcode)})"
            reason = self.dead
        if not self._ready.done():
            self._ready.set_exception(EngineLoadError(f"{reason} while loading"))
        self.fail_all(reason)
        if self._loaded and not self._closing:
            log.error("%s", reason)
            self.on_death(reason)

    def fail_all(self, reason: str) -> None:
        for rid, sink in list(self._sinks.items()):
            sink.put_nowait(StepOutput(rid, finished=True, finish_reason="abort", error=reason))
        self._sinks.clear()
        for fut in self._gauges.values():
            if not fut.done():
                fut.set_result(None)
        for fut in self._embeds.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    # -- the end -------------------------------------------------------------------------------

    def close(self, timeout: float = 30.0) -> None:
        """Stop the process (from any thread): its requests end with "shutting down". A process
        still loading is killed: nothing in it is worth waiting for."""
        self._closing = True
        if not self.proc.is_alive():
            return
        if self.info is not None:
            self._send(Shutdown())
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)


def _widen(conn) -> None:
    """Room for a few hundred steps' outputs in the pipe (a step of 64 sequences is ~4 KB), so a
    burst of HTTP work (a slow client's writes, a long prompt's encoding) never stalls the engine
    on a full pipe (Linux only; elsewhere the default stays)."""
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError):
        pass
