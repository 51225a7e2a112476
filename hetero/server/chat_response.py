"""The answers of /v1/chat/completions: one JSON body, or a stream of chunks.

Where the request's answers are read (tools, reasoning: `ChatFormat`), each choice's text goes
through a ChatOutput and the message carries `content`, `reasoning_content` and `tool_calls`;
a choice that called tools ends with finish_reason "tool_calls". Streamed, the deltas follow
OpenAI: `reasoning_content` and `content` text, and `tool_calls` pieces (index, id, type and
name with empty arguments first, then argument fragments under the same index).
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from aiohttp import web

from hetero.chat_output import ChatFormat, ChatOutput
from hetero.server import logprobs as lp
from hetero.server.generation import Event, Job
from hetero.server.protocol import ApiError
from hetero.server.sse import EventStream, first_event, stopped_message
from hetero.server.state import ServerState
from hetero.tool_parsers import Delta


def finished_or_503(job: Job) -> None:
    if job.error is not None:
        tokens = job.usage().completion_tokens
        raise ApiError(503, stopped_message(job.error, tokens), code="aborted")


def read_choices(job: Job, fmt: ChatFormat) -> list[ChatOutput]:
    """Each finished choice's text read as a message (the non-streaming answer)."""
    outputs = []
    for c in job.choices:
        out = fmt.new_output()
        out.feed(c.stream.out.text)
        out.finish()
        outputs.append(out)
    return outputs


def finish_reason(reason: str | None, out: ChatOutput | None) -> str | None:
    if out is not None and out.calls and reason == "stop":
        return "tool_calls"
    return reason


def _message(text: str, out: ChatOutput | None) -> dict[str, Any]:
    if out is None:
        return {"role": "assistant", "content": text}
    message: dict[str, Any] = {"role": "assistant", "content": out.content or None}
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    if out.calls:
        message["tool_calls"] = [c.openai() for c in out.calls]
    elif message["content"] is None:
        message["content"] = ""
    return message


def chat_body(
    state: ServerState, job: Job, logprobs: int | None, fmt: ChatFormat | None, model: str
) -> dict[str, Any]:
    finished_or_503(job)
    tok = state.tokenizer
    outputs = read_choices(job, fmt) if fmt is not None else [None] * len(job.choices)
    choices = [
        {
            "index": c.index,
            "message": _message(c.stream.out.text, out),
            "logprobs": lp.chat(tok, c.stream.out.logprobs) if logprobs is not None else None,
            "finish_reason": finish_reason(c.stream.out.finish_reason, out),
        }
        for c, out in zip(job.choices, outputs)
    ]
    return {
        "id": job.id,
        "object": "chat.completion",
        "created": job.created,
        "model": model,
        "choices": choices,
        "usage": job.usage().body(),
    }


def delta_body(delta: Delta) -> dict[str, Any]:
    """A parsed piece as an OpenAI chunk's `delta`."""
    body: dict[str, Any] = {}
    if delta.reasoning:
        body["reasoning_content"] = delta.reasoning
    if delta.content:
        body["content"] = delta.content
    if delta.calls:
        body["tool_calls"] = [
            {
                "index": c.index,
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            if c.id is not None
            else {"index": c.index, "function": {"arguments": c.arguments}}
            for c in delta.calls
        ]
    return body


async def stream_chat(
    request: web.Request,
    state: ServerState,
    job: Job,
    usage: bool,
    logprobs: int | None,
    fmt: ChatFormat | None,
    model: str,
) -> web.StreamResponse:
    head = {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": model}
    tok = state.tokenizer
    outputs: dict[int, ChatOutput] = {}

    def chunk(index: int, delta: dict, event: Event | None) -> dict[str, Any]:
        logs = lp.chat(tok, event.logprobs) if event and logprobs is not None else None
        reason = finish_reason(event.finish_reason, outputs.get(index)) if event else None
        choice = {"index": index, "delta": delta, "logprobs": logs, "finish_reason": reason}
        return {**head, "choices": [choice]}

    async with aclosing(job.events()) as events:
        event = await first_event(events)
        sse = await EventStream.open(request)
        while event is not None:
            if event.error:
                await sse.send_error(stopped_message(event.error, job.usage().completion_tokens))
                return await sse.done()
            if event.index not in outputs:
                outputs[event.index] = fmt.new_output() if fmt is not None else None
                await sse.send(chunk(event.index, {"role": "assistant", "content": ""}, None))
            delta = _event_delta(event, outputs[event.index])
            if delta or event.finish_reason or (logprobs is not None and event.logprobs):
                await sse.send(chunk(event.index, delta, event))
            event = await anext(events, None)
    if usage:
        await sse.send({**head, "choices": [], "usage": job.usage().body()})
    return await sse.done()


def _event_delta(event: Event, out: ChatOutput | None) -> dict[str, Any]:
    if out is None:
        return {"content": event.delta} if event.delta else {}
    delta = out.feed(event.delta)
    if event.finish_reason:
        delta.add(out.finish())
    return delta_body(delta)
