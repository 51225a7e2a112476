"""The engine brought back when it dies: an EngineClient that starts a new engine after a crash.

    ready --(the engine dies: its requests end saying why)--> restarting --(a new engine has
    loaded)--> ready
    restarting --(more deaths within the window than the policy allows)--> gone

An engine's client (client.EngineProcess, thread.AsyncEngine) reports its death through
`on_death`; by then it has ended every request in flight with the reason. The supervisor waits a
backoff (RestartPolicy.delay: 1 s, doubled for every death within the window, at most 30 s),
starts a new engine through the same factory, and serves through it. Requests that arrive
meanwhile are refused with EngineDeadError (a 503 saying the engine is restarting). A new engine
that fails to load counts as one more death. Past `max_restarts` deaths within `window_s`
seconds it gives up and reports the reason (`on_status("failed", reason)`): the daemon exits
with it rather than restart an engine that cannot run.

The RAM tier of the KV cache dies with the engine; the disk tier's files stay and the new
engine's store finds them (kv_tiers/store.py), so prefixes written before the crash are hits again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

from hetero.engine.output import StepOutput
from hetero.engine.stats import EngineGauges
from hetero.frontdoor.protocol import EngineClient, EngineDeadError
from hetero.frontdoor.stream import Pace
from hetero.sampling import SamplingParams

log = logging.getLogger("hetero.engine")

# starts an engine whose death is reported to the callable given (from any thread)
EngineFactory = Callable[[Callable[[str], None]], Awaitable[EngineClient]]
StatusHook = Callable[[str, "str | None"], None]  # ("restarting" | "ready" | "failed", why)


@dataclass(frozen=True)
class RestartPolicy:
    """max_restarts: engine deaths within window_s seconds that are restarted (0: none; the first
    death ends the daemon). A death one window after the others starts the count again, so a
    daemon whose engine dies once a week runs for years."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0 or self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(f"bad restart policy: {self}")

    def delay(self, deaths: int) -> float:
        """Seconds to wait before the restart that follows `deaths` deaths within the window."""
        return min(self.backoff_s * 2 ** max(0, deaths - 1), self.backoff_max_s)


class EngineSupervisor:
    """An EngineClient over the engine now running; `await start()` loads the first one (its
    EngineLoadError is the daemon's: a model that cannot load is not restarted)."""

    def __init__(self, factory: EngineFactory, policy: RestartPolicy, on_status: StatusHook):
        self.factory = factory
        self.policy = policy
        self.on_status = on_status
        self.client: EngineClient | None = None  # None while restarting
        self.last: EngineClient | None = None  # the engine now, or the one that died
        self.restarts = 0  # engines started again after a death
        self.reason: str | None = None  # why the last engine died
        self._deaths: deque[float] = deque()  # monotonic times within the window
        self._task: asyncio.Task | None = None
        self._closing = False
        self._idle = threading.Event()  # no restart in progress (close waits for it)
        self._idle.set()

    async def start(self) -> EngineSupervisor:
        self._loop = asyncio.get_running_loop()
        self.client = self.last = await self.factory(_DeathReport(self))
        return self

    # -- the EngineClient interface ------------------------------------------------------------

    @property
    def info(self):
        return None if self.last is None else self.last.info

    @property
    def tokenizer(self):
        return self.last.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.last.max_model_len

    @property
    def num_in_flight(self) -> int:
        return 0 if self.client is None else self.client.num_in_flight

    def _live(self) -> EngineClient:
        if self.client is None:
            if self._closing:
                raise EngineDeadError("the engine is not running: shutting down")
            raise EngineDeadError(
                f"the engine is restarting after a failure ({self.reason}); retry shortly"
            )
        return self.client

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        pace: Pace | None = None,
    ) -> AsyncIterator[StepOutput]:
        gen = self._live().generate(request_id, prompt_ids, params, pace)
        async with aclosing(gen) as outs:  # closing it aborts the request in its engine
            async for out in outs:
                yield out

    def abort(self, request_id: str) -> None:
        if self.client is not None:
            self.client.abort(request_id)

    async def embed(self, prompts: list[list[int]]):
        return await self._live().embed(prompts)

    async def gauges(self) -> EngineGauges | None:
        return None if self.client is None else await self.client.gauges()

    # -- death and restart (on the event loop) -------------------------------------------------

    def _died(self, reason: str) -> None:
        if self._closing:
            return
        dead, self.client, self.reason = self.client, None, reason
        if dead is not None:  # release what it holds (a thread's engine) before the next loads
            dead.close(0)
        if self._record_death():
            if self._task is not None:
                self._task.cancel()
            return
        self.on_status("restarting", reason)
        if self._task is None or self._task.done():
            self._idle.clear()
            self._task = self._loop.create_task(self._restart())

    def _record_death(self) -> bool:
        """Count a death; True (and the daemon told why) when it is one too many."""
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > self.policy.window_s:
            self._deaths.popleft()
        p = self.policy
        if len(self._deaths) <= p.max_restarts:
            return False
        n = len(self._deaths)
        times = "once" if n == 1 else f"{n} times"
        self.on_status(
            "failed",
            f"{self.reason}; the engine died {times} within {p.window_s:.0f} s, more than the "
            f"{p.max_restarts} restarts allowed (--engine-restarts)",
        )
        self._idle.set()
        return True

    async def _restart(self) -> None:
        try:
            while not self._closing:
                delay = self.policy.delay(len(self._deaths))
                log.warning("restarting the engine in %.1f s (%s)", delay, self.reason)
                await asyncio.sleep(delay)
                report = _DeathReport(self)
                try:
                    client = await self.factory(report)
                except Exception as e:  # a load that fails is one more death
                    self.reason = f"the engine failed to start again: {e}"
                    log.error("%s", self.reason)
                    if self._record_death():
                        return
                    continue
                if report.fired:  # it died as soon as it was up (counted by _died): again
                    client.close(0)
                    continue
                self._swap(client)
                return
        finally:
            self._idle.set()

    def _swap(self, client: EngineClient) -> None:
        self.client = self.last = client
        self.restarts += 1
        log.info("the engine is back (restart %d): %s", self.restarts, client.info.kv_description)
        self.on_status("ready", None)

    # -- the end -------------------------------------------------------------------------------

    def close(self, timeout: float = 30.0) -> None:
        """Stop serving (from a worker thread): a restart in progress is cancelled (an engine
        still loading is killed), the running engine stops as EngineClient.close says."""
        self._closing = True
        task = self._task
        if task is not None and not task.done():
            self._loop.call_soon_threadsafe(task.cancel)
            self._idle.wait(timeout)
        if self.client is not None:
            self.client.close(timeout)


class _DeathReport:
    """on_death for one client: its death counts once, on the supervisor's event loop."""

    def __init__(self, supervisor: EngineSupervisor) -> None:
        self.supervisor = supervisor
        self.fired = False

    def __call__(self, reason: str) -> None:
        if not self.fired:
            self.fired = True
            self.supervisor._loop.call_soon_threadsafe(self.supervisor._died, reason)
