"""What the daemon holds while it runs: settings, the engine (once loaded), metrics, counters.

The engine runs either in its own process (frontdoor.client.EngineProcess: the engine's loop and
the event loop each have an interpreter) or on a thread of this one (frontdoor.thread.AsyncEngine).
Both are an EngineClient (frontdoor/protocol.py); handlers see `EngineInfo` (context length, pool
size) and the tokenizer, which lives here in both cases: text stays at the edge.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from hetero.engine.stats import EngineGauges
from hetero.factory import LaunchConfig
from hetero.frontdoor.client import EngineProcess
from hetero.frontdoor.protocol import EngineClient, EngineLoadError
from hetero.frontdoor.supervisor import EngineSupervisor, RestartPolicy
from hetero.frontdoor.thread import AsyncEngine
from hetero.frontdoor.wire import EngineInfo
from hetero.launch import build_engine
from hetero.server.access_log import note_model
from hetero.server.metrics import Metrics
from hetero.server.protocol import ApiError, check_model, parse_json
from hetero.tokenizer import Tokenizer

log = logging.getLogger("hetero.server")
T = TypeVar("T")


@dataclass(frozen=True)
class ServerSettings:
    model_path: Path
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    served_model_name: str | None = None
    # More names the model answers to (listed in /v1/models); with strict_model_name, a request
    # naming any other model is a 404 (by default any name is served by the one model loaded).
    aliases: tuple[str, ...] = ()
    strict_model_name: bool = False
    max_request_bytes: int = 8 * 2**20
    shutdown_grace: float = 30.0
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    # The engine in its own process (frontdoor/client.py) or on a thread of this one.
    # The process is the default on every device: on the GPU it is what lets HTTP keep up with the
    # engine (the engine's step and the per-token HTTP work stop sharing one GIL); on a 2-core CPU
    # it measured as fast as the thread or a little faster, at the same CPU time per token.
    engine_process: bool = True
    # Milliseconds a stream waits after sending before it sends again (its tokens of that time go
    # as one event); None: auto (see ServerState.pace).
    stream_interval_ms: float | None = None
    # A GGUF that answers /v1/embeddings in place of the served model (embeddings.OwnEmbedder).
    embedding_model: Path | None = None
    # A dead engine is started again (frontdoor/supervisor.py), at most engine_restarts times
    # within engine_restart_window seconds (0: the daemon exits when its engine dies).
    engine_restarts: int = 5
    engine_restart_window: float = 600.0
    # Control-token texts inside chat messages read as control tokens (by default plain text).
    parse_special_in_messages: bool = False
    # request traces (request_trace.py): the JSON-lines file, rotated at this size
    log_requests: Path | None = None
    log_requests_max_mb: float = 64.0

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model_path.stem

    @property
    def model_names(self) -> tuple[str, ...]:
        """The served name first, then the aliases (each once)."""
        return tuple(dict.fromkeys((self.served_name, *self.aliases)))


# --stream-interval-ms auto: every step's tokens go out at once while few requests stream; past
# AUTO_PACE_STREAMS a stream sends at most one event per AUTO_PACE_S (50 a second, smoother than
# a screen shows text). Per event the server pays a detokenize, a JSON encode and a socket write
# (~70 us, the write half of it), and the client as much again: at 64 streams of a fast engine
# that work, not the engine, bounded the HTTP path (BENCHMARKS.md, the daemon on the H200).
AUTO_PACE_STREAMS = 8
AUTO_PACE_S = 0.02


class ServerState:
    """Status: loading -> ready -> draining (or loading -> failed); ready -> restarting -> ready
    while a dead engine is started again (-> failed when the supervisor gives up)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.served_name = settings.served_name
        self.model_names = settings.model_names
        self.status = "loading"
        self.error: str | None = None
        self.engine: EngineInfo | None = None
        self.ae: EngineSupervisor | None = None
        self.embedder = None  # embeddings.OwnEmbedder of --embedding-model, once loaded
        self.engine_died = asyncio.Event()  # the engine died and is not started again
        self._tokenizer: Tokenizer | None = None  # the engine process's, kept across restarts
        self.metrics = Metrics()
        self.created = int(time.time())
        # Prompt rendering and encoding run here, off the event loop that streams tokens; the
        # engine has its own thread. Two workers: the machine's tokenizer work is short and bursty.
        self.tok_pool = ThreadPoolExecutor(2, thread_name_prefix="hetero-tokenize")
        self._idle = asyncio.Event()
        self._idle.set()

    # -- loading -----------------------------------------------------------------------------

    async def load(self) -> None:
        try:
            s = self.settings
            policy = RestartPolicy(s.engine_restarts, s.engine_restart_window)
            start = self._start_process if s.engine_process else self._start_thread
            self.ae = await EngineSupervisor(start, policy, self._engine_status).start()
            if self.settings.embedding_model is not None:
                from hetero.server.embeddings import OwnEmbedder

                s = self.settings
                self.embedder = await asyncio.to_thread(
                    OwnEmbedder, s.embedding_model, s.launch.runtime
                )
        except Exception as e:
            named = isinstance(e, EngineLoadError)  # its message names the error already
            self.status, self.error = "failed", str(e) if named else f"{type(e).__name__}: {e}"
            raise
        self.engine = self.ae.info
        self.status = "ready"

    async def _start_process(self, on_death: Callable[[str], None]) -> EngineProcess:
        """The engine loads in its process; the tokenizer meanwhile here (it reads the GGUF's
        metadata only), once."""
        s = self.settings
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(Tokenizer.from_gguf, s.model_path)
        ae = EngineProcess(s.model_path, s.launch, self._tokenizer, on_death)
        try:
            return await ae.start()
        except BaseException:
            ae.close(0)  # a restart cancelled by a shutdown: the process still loading is killed
            raise

    def _engine_status(self, status: str, reason: str | None) -> None:
        """The supervisor's news: restarting (why), ready (back), failed (it gave up)."""
        if self.status == "draining" and status != "failed":
            return
        self.status, self.error = status, reason or self.error
        if status == "ready":
            self.engine = self.ae.info
            self.metrics.engine_restarts = self.ae.restarts
        elif status == "failed":
            self.engine_died.set()

    async def _start_thread(self, on_death: Callable[[str], None]) -> AsyncEngine:
        """Build the engine on a daemon thread (a signal during loading must not wait for it)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def work() -> None:
            try:
                s = self.settings
                engine = build_engine(s.model_path, s.launch, progress=True)
                engine.constraints.warm()  # the grammars' vocabulary, off the engine thread
                result: Any = engine
            except BaseException as e:  # reported to the loop, which fails the daemon
                result = e
            loop.call_soon_threadsafe(_settle, done, result)

        threading.Thread(target=work, name="hetero-load", daemon=True).start()
        result = await done
        if isinstance(result, BaseException):
            raise result
        return AsyncEngine(result, on_death).start()

    # -- serving -----------------------------------------------------------------------------

    def require_ready(self) -> tuple[EngineInfo, EngineClient]:
        if self.status == "ready" and self.engine is not None and self.ae is not None:
            return self.engine, self.ae
        if self.status == "restarting":
            raise ApiError(
                503,
                f"the engine is restarting after a failure ({self.error}); retry shortly",
                code="restarting",
            )
        if self.status == "failed" and self.engine is not None:  # it was up: the engine died
            raise ApiError(503, f"the engine stopped: {self.error}", code="engine_unavailable")
        if self.status == "loading":
            raise ApiError(503, "the model is still loading; retry shortly", code="loading")
        if self.status == "draining":
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        raise ApiError(503, f"the model failed to load: {self.error}", code="load_failed")

    @property
    def tokenizer(self):
        return self.ae.tokenizer

    @property
    def plain_content(self) -> bool:
        """Control-token texts in chat messages are text (plain_content.py)."""
        return not self.settings.parse_special_in_messages

    @property
    def pool_tokens(self) -> int:
        """Tokens of KV one request can hold at most: the whole pool."""
        return self.engine.pool_tokens

    async def engine_gauges(self) -> EngineGauges | None:
        """The engine's gauges (None before it is loaded or after it died)."""
        if self.engine is None or self.ae is None:
            return None
        return await self.ae.gauges()

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work (chat templates, encoding) on the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self.tok_pool, fn, *args)

    def pace(self) -> float:
        """Seconds a stream waits after one event before it takes the next (stream.paced)."""
        ms = self.settings.stream_interval_ms
        if ms is not None:
            return ms / 1e3
        return AUTO_PACE_S if self.metrics.in_flight > AUTO_PACE_STREAMS else 0.0

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        """Counts a generation request while it is served (the drain waits for zero)."""
        self.metrics.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.metrics.in_flight -= 1
            if self.metrics.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no generation request is left within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine (its requests get an abort saying why; it saves its KV prefixes for
        the next start) and the tokenizer pool. Called off the event loop."""
        if self.ae is not None:
            self.ae.close(timeout)
        self.tok_pool.shutdown(wait=False, cancel_futures=True)

    def model_for(self, body: dict[str, Any]) -> str:
        """The name to answer `body` with (protocol.check_model: a 404 only under strict names)."""
        name = check_model(body, self.model_names, self.settings.strict_model_name)
        note_model(name)  # for the request's log line
        return name


STATE: web.AppKey[ServerState] = web.AppKey("state", ServerState)
IGNORED_HEADER = "X-Hetero-Ignored-Fields"
_logged_ignored: set[str] = set()


def ignore_fields(request: web.Request, names: list[str]) -> None:
    """Fields of the request that are accepted and not used: logged once per name for the life of
    the server, and named in the answer's X-Hetero-Ignored-Fields header."""
    if not names:
        return
    request["ignored_fields"] = names
    new = [n for n in names if n not in _logged_ignored]
    if new:
        _logged_ignored.update(new)
        log.info("ignoring request fields this server does not use: %s", ", ".join(new))


async def add_ignored_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: streams send their headers before the handler returns."""
    names = request.get("ignored_fields")
    if names:
        response.headers[IGNORED_HEADER] = ", ".join(names)


async def read_body(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (aiohttp enforces the size limit while reading: 413)."""
    return parse_json(await request.read())


def _settle(fut: asyncio.Future, result: object) -> None:
    if not fut.done():
        fut.set_result(result)
