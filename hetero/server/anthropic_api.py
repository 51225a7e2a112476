"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

The request is turned into the chat's terms (anthropic_protocol.py) and runs on the same path as
/v1/chat/completions: the model's template, the tool-call parser of its format, the reasoning
splitter. The answer is a message of content blocks (thinking, text, tool_use) with Anthropic's
stop_reason (end_turn, max_tokens, stop_sequence, tool_use) and usage; streamed, it is
Anthropic's events: message_start, then each block's content_block_start, deltas (text_delta,
thinking_delta and signature_delta, input_json_delta) and content_block_stop, then message_delta
with the stop reason and message_stop. Errors have Anthropic's shape (the daemon's middleware
writes them for these paths).
"""

from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from hetero.chat_output import ChatFormat, ChatOutput
from hetero.server.access_log import note_prompt_text
from hetero.server.anthropic_protocol import (
    COUNT_FIELDS,
    MESSAGES_FIELDS,
    MESSAGES_UNSUPPORTED,
    chat_input,
    sampling,
    tool_input,
)
from hetero.server.chat_request import chat_prompt
from hetero.server.chat_response import finished_or_503, read_choices
from hetero.server.generation import Job
from hetero.server.protocol import check_fields
from hetero.server.sampling_request import check_structured_outputs, make_params, resolve_max_tokens
from hetero.server.sse import EventStream, engine_errors, first_event, stopped_message
from hetero.server.state import STATE, ignore_fields, read_body
from hetero.tool_parsers import Delta

PATHS = ("/v1/messages", "/messages")


async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request)
    ignored = check_fields(body, COUNT_FIELDS, MESSAGES_UNSUPPORTED)
    _, ae = state.require_ready()
    chat = chat_input(body)
    chat.tool_choice = "auto" if chat.tools else "none"  # counting never forces a call
    prompt = await state.off_loop(chat_prompt, ae.tokenizer, chat, state.plain_content)
    ignore_fields(request, ignored + chat.ignored)
    return web.json_response({"input_tokens": len(prompt.ids)})


async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request)
    ignored = check_fields(body, MESSAGES_FIELDS, MESSAGES_UNSUPPORTED)
    model = state.model_for(body)
    engine, ae = state.require_ready()
    chat = chat_input(body)
    prompt = await state.off_loop(chat_prompt, ae.tokenizer, chat, state.plain_content)
    note_prompt_text(prompt.text)  # for a request trace
    ignore_fields(request, ignored + chat.ignored)
    kw = sampling(body)
    if prompt.special_tokens:
        kw["skip_special_tokens"] = False
    if prompt.constraint is not None:  # tool_choice any/tool: the call's grammar
        kw["structured_outputs"] = prompt.constraint
        await state.off_loop(check_structured_outputs, prompt.constraint, "tools")
    max_tokens = resolve_max_tokens(
        body["max_tokens"], len(prompt.ids), engine.max_model_len, state.pool_tokens
    )
    params = make_params(kw, max_tokens)
    job = Job(ae, ae.tokenizer, state.metrics, [prompt.ids], params, "msg", state.pace)
    job.id = "msg_" + uuid.uuid4().hex
    fmt = prompt.format or ChatFormat(None)
    with state.in_flight():
        if body.get("stream"):
            return await _stream(request, job, fmt, model)
        with engine_errors():
            await job.run()
        finished_or_503(job)
        out = read_choices(job, fmt)[0]
        return web.json_response(_message(job, out, model))


def _stop(job: Job, out: ChatOutput) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the one choice."""
    done = job.choices[0].stream.out
    if done.finish_reason == "length":
        return "max_tokens", None
    if out.calls:
        return "tool_use", None
    if isinstance(done.stop_reason, str):
        return "stop_sequence", done.stop_reason
    return "end_turn", None


def _usage(job: Job) -> dict[str, int]:
    u = job.usage()
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": u.completion_tokens,
    }


def _message(job: Job, out: ChatOutput, model: str) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content:
        blocks.append({"type": "text", "text": out.content})
    for c in out.calls:
        use = {"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)}
        blocks.append(use)
    reason, sequence = _stop(job, out)
    return {
        "id": job.id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(job),
    }


class _Blocks:
    """The open content block of a stream, and the events that open, fill and close blocks."""

    def __init__(self, sse: EventStream) -> None:
        self.sse = sse
        self.index = -1
        self.kind: str | None = None
        self.call: int | None = None  # the index of the tool call the open block holds

    async def _open(self, kind: str, block: dict[str, Any]) -> None:
        await self.close()
        self.index += 1
        self.kind = kind
        await self.sse.send_named(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    async def close(self) -> None:
        if self.kind is None:
            return
        if self.kind == "thinking":
            await self._delta({"type": "signature_delta", "signature": ""})
        await self.sse.send_named(
            "content_block_stop", {"type": "content_block_stop", "index": self.index}
        )
        self.kind, self.call = None, None

    async def _delta(self, delta: dict[str, Any]) -> None:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        await self.sse.send_named("content_block_delta", body)

    async def send(self, delta: Delta) -> None:
        if delta.reasoning:
            if self.kind != "thinking":
                await self._open("thinking", {"type": "thinking", "thinking": ""})
            await self._delta({"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.content:
            if self.kind != "text":
                await self._open("text", {"type": "text", "text": ""})
            await self._delta({"type": "text_delta", "text": delta.content})
        for c in delta.calls:
            if c.id is not None:
                block = {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}
                await self._open("tool_use", block)
                self.call = c.index
            if c.arguments and self.call == c.index:
                await self._delta({"type": "input_json_delta", "partial_json": c.arguments})


async def _stream(
    request: web.Request, job: Job, fmt: ChatFormat, model: str
) -> web.StreamResponse:
    out = fmt.new_output()
    async with aclosing(job.events()) as events:
        event = await first_event(events)
        sse = await EventStream.open(request)
        start = {**_message(job, out, model), "content": [], "stop_reason": None}
        await sse.send_named("message_start", {"type": "message_start", "message": start})
        blocks = _Blocks(sse)
        while event is not None:
            if event.error:
                message = stopped_message(event.error, job.usage().completion_tokens)
                await sse.send_named("error", {"type": "error", "error": {
                    "type": "overloaded_error", "message": message}})  # fmt: skip
                return await sse.done(marker=False)
            delta = out.feed(event.delta)
            if event.finish_reason:
                delta.add(out.finish())
            await blocks.send(delta)
            event = await anext(events, None)
    await blocks.close()
    reason, sequence = _stop(job, out)
    await sse.send_named("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": {"output_tokens": job.usage().completion_tokens},
    })  # fmt: skip
    await sse.send_named("message_stop", {"type": "message_stop"})
    return await sse.done(marker=False)
