"""One log line per request, and the request's record that traces and the status page read.

The outermost middleware gives every request an id (the client's `X-Request-Id` when it sends a
usable one, else a new one), echoes it in the answer's `X-Request-Id`, and keeps a
`RequestRecord` in a context variable while the request is served: the generation Job registers
itself there, the handler notes the model name and the rendered prompt, and an error event sent
in a stream notes the message the client got. When the answer has ended, one line goes to the
`hetero.access` logger at info level:

    POST /v1/chat/completions 200 id=4f2a... model=smollm2 prompt=31 cached=16 output=12
        ttft=0.081s total=0.410s finish=stop spec=5/9
    POST /v1/chat/completions 400 id=4f2b... total=0.002s error="'messages' must ..."

(`spec` is accepted/proposed guesses of speculative decoding.) Probes (/health, /metrics) log
at debug level, and so do the status page's own requests when they succeed, so a page left
open does not fill the log; refused ones log at info like the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from hetero.log_format import REQUEST_ID

log = logging.getLogger("hetero.access")
HEADER = "X-Request-Id"
# a client's id is kept when it is this short and plain (it goes into log lines as it is)
_USABLE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
# logged at debug level: probes (a 503 from /health while loading is its answer, not an
# error), and the status page's own requests when they succeed
PROBES = ("/health", "/metrics")
PAGE_PATHS = ("/", "/status", "/plan.svg", "/props", "/slots")
RECENT = 50  # requests the status page lists


@dataclass
class RequestRecord:
    """What one request did, gathered while it is served."""

    id: str
    method: str
    path: str
    start: float  # perf_counter
    time: float  # wall clock (time.time) of its arrival
    model: str | None = None
    jobs: list = field(default_factory=list)  # generation.Job objects it ran
    prompt_text: str | None = None  # the rendered chat template, where there is one
    error: str | None = None
    status: int = 0
    end: float | None = None
    traced: bool = False  # a trace of it is written (--log-requests): keep token logprobs

    @property
    def total_s(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def fields(self) -> dict[str, Any]:
        """The log line's fields (the JSON format's keys, the status page's columns)."""
        out: dict[str, Any] = {
            "request_id": self.id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "time": self.time,
        }
        if self.jobs:
            out.update(_job_fields(self))
        out["total_s"] = round(self.total_s, 6)
        if self.error is not None:
            out["error"] = self.error
        return out


def _job_fields(record: RequestRecord) -> dict[str, Any]:
    prompt = cached = output = proposed = accepted = 0
    firsts, reasons = [], []
    for job in record.jobs:
        usage = job.usage()
        prompt += usage.prompt_tokens
        cached += usage.cached_tokens
        output += usage.completion_tokens
        for c in job.choices:
            if c.clock.first is not None:
                firsts.append(c.clock.first)
            reasons.append(c.stream.out.finish_reason if c.finished else "cancelled")
            if c.timeline is not None:
                proposed += c.timeline.spec_proposed
                accepted += c.timeline.spec_accepted
    return {
        "model": record.model,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "ttft_s": round(min(firsts) - record.start, 6) if firsts else None,
        "finish_reason": ",".join(dict.fromkeys(r or "none" for r in reasons)),
        "spec_proposed": proposed,
        "spec_accepted": accepted,
    }


def line(f: dict[str, Any]) -> str:
    """The text form of a record's fields."""
    parts = [f"{f['method']} {f['path']} {f['status']} id={f['request_id']}"]
    if "prompt_tokens" in f:
        ttft = "-" if f["ttft_s"] is None else f"{f['ttft_s']:.3f}s"
        parts.append(
            f"model={f['model']} prompt={f['prompt_tokens']} cached={f['cached_tokens']} "
            f"output={f['output_tokens']} ttft={ttft} total={f['total_s']:.3f}s "
            f"finish={f['finish_reason']} spec={f['spec_accepted']}/{f['spec_proposed']}"
        )
    else:
        parts.append(f"total={f['total_s']:.3f}s")
    if "error" in f:
        parts.append(f"error={json.dumps(f['error'], ensure_ascii=False)}")
    return " ".join(parts)


# -- the request being served (set by the middleware, read by handlers and the Job) ------------

CURRENT: ContextVar[RequestRecord | None] = ContextVar("hetero_request", default=None)


def attach_job(job) -> RequestRecord | None:
    """A generation Job of the request being served registers here."""
    record = CURRENT.get()
    if record is not None:
        record.jobs.append(job)
    return record


def note_model(name: str) -> None:
    record = CURRENT.get()
    if record is not None:
        record.model = name


def note_prompt_text(text: str) -> None:
    record = CURRENT.get()
    if record is not None:
        record.prompt_text = text


def note_error(message: str) -> None:
    """The message a stream's error event told the client (the status stays 200)."""
    record = CURRENT.get()
    if record is not None:
        record.error = message


# -- the log -------------------------------------------------------------------------------------


class AccessLog:
    """The daemon's request log: the middleware's records, the last ones kept for the status
    page, the running ones for /slots, and each finished generation traced (--log-requests)."""

    def __init__(self, trace=None) -> None:
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.active: dict[int, RequestRecord] = {}  # by id() (clients' ids may repeat)
        self.trace = trace  # request_trace.TraceWriter (--log-requests), or None

    async def close(self) -> None:
        if self.trace is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.trace.close)

    def begin(self, request: web.Request) -> RequestRecord:
        given = request.headers.get(HEADER, "")
        rid = given if _USABLE_ID.fullmatch(given) else uuid.uuid4().hex
        record = RequestRecord(rid, request.method, request.path, time.perf_counter(), time.time())
        record.traced = self.trace is not None
        request[RECORD] = record
        return record

    def end(self, record: RequestRecord, response: web.StreamResponse | None) -> None:
        record.end = time.perf_counter()
        if record.error is None and response is not None and record.status >= 400:
            record.error = _error_message(response)
        fields = record.fields()
        page = record.path in PAGE_PATHS or record.path.startswith("/static/")
        quiet = record.path in PROBES or (page and record.status < 400)
        log.log(logging.DEBUG if quiet else logging.INFO, line(fields), extra={"fields": fields})
        if not quiet:
            self.recent.appendleft(fields)
            if self.trace is not None and record.jobs:
                self.trace.write(record, fields)


ACCESS: web.AppKey[AccessLog] = web.AppKey("access_log", AccessLog)
RECORD = "hetero.request_record"


@web.middleware
async def access_middleware(request: web.Request, handler) -> web.StreamResponse:
    """The outermost middleware: the errors middleware inside it has already turned every
    exception into an answer, so the status seen here is the one the client got (499: the
    client went away first)."""
    access = request.app[ACCESS]
    record = access.begin(request)
    tokens = (CURRENT.set(record), REQUEST_ID.set(record.id))
    response = None
    record.status = 499
    access.active[id(record)] = record
    try:
        response = await handler(request)
        record.status = response.status
        return response
    finally:
        access.active.pop(id(record), None)
        access.end(record, response)
        CURRENT.reset(tokens[0])
        REQUEST_ID.reset(tokens[1])


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: streams send their headers before the handler returns."""
    record = request.get(RECORD)
    if record is not None:
        response.headers[HEADER] = record.id


def _error_message(response: web.StreamResponse) -> str | None:
    """The message of an error answer (OpenAI's and Anthropic's shapes both nest it under
    "error"), or its reason when the body is not such JSON."""
    body = getattr(response, "body", None)
    try:
        return json.loads(body)["error"]["message"]
    except (TypeError, ValueError, KeyError):
        return response.reason
