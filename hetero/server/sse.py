"""Server-sent events: `data: <json>` lines, OpenAI's `[DONE]`, and the engine's errors mapped."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

from hetero.frontdoor.thread import EngineDeadError
from hetero.server.access_log import note_error
from hetero.server.generation import Event
from hetero.server.protocol import ApiError, bad, error_body

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # built once: per token


def dumps(obj: Any) -> str:
    return _ENCODER.encode(obj)


class EventStream:
    """One text/event-stream response."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> EventStream:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies must not hold the stream back
            }
        )
        await response.prepare(request)
        return cls(response)

    async def send(self, obj: Any) -> None:
        await self.response.write(f"data: {dumps(obj)}\n\n".encode())

    async def send_named(self, event: str, obj: Any) -> None:
        """An event with a name line (Anthropic's streams name every event)."""
        if event == "error":
            note_error(obj["error"]["message"])
        await self.response.write(f"event: {event}\ndata: {dumps(obj)}\n\n".encode())

    async def send_error(self, message: str, status: int = 503) -> None:
        """An error event (the OpenAI clients raise it as an APIError with this message)."""
        kind = "server_error" if status >= 500 else "invalid_request_error"
        note_error(message)
        await self.send(error_body(message, kind, None, status))

    async def done(self, marker: bool = True) -> web.StreamResponse:
        if marker:
            await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response


@contextmanager
def engine_errors() -> Iterator[None]:
    """The engine's refusals as HTTP errors: a bad request (400) or no engine (503)."""
    try:
        yield
    except EngineDeadError as e:
        raise ApiError(503, str(e), code="engine_unavailable") from e
    except ValueError as e:  # add_request: too long for the context or pool, bad token ids
        raise bad(str(e)) from e


async def first_event(events: AsyncIterator[Event]) -> Event:
    """Wait for the first event, so a refused request is answered as an HTTP error, not a stream.

    The response starts only when the engine has accepted the request and produced a token, so
    a client never sees a 200 for a request that could not run.
    """
    with engine_errors():
        try:
            return await anext(events)
        except StopAsyncIteration as e:
            raise ApiError(500, "the engine finished the request without any output") from e


def stopped_message(error: str, tokens: int) -> str:
    return f"{error}; the request was stopped after {tokens} generated tokens"
