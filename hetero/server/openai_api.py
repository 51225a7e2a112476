"""Handlers of the OpenAI API: /v1/chat/completions, /v1/completions, /v1/models[/{model}].

Each handler checks the body (protocol.py), renders and encodes the prompt on the tokenizer
threads, runs a Job (generation.py) and answers one JSON body or a stream of chunks. Streams start
once the engine has produced the first token, so refusals are still plain HTTP errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

from aiohttp import web

from hetero.chat_template import ChatTemplateError
from hetero.server import logprobs as lp
from hetero.server.generation import Event, Job
from hetero.server.infill import fim_prompt
from hetero.server.protocol import (
    CHAT_FIELDS,
    CHAT_UNSUPPORTED,
    COMPLETION_FIELDS,
    ApiError,
    bad,
    check_fields,
    check_model,
    check_structured_outputs,
    include_usage,
    make_params,
    prompt_list,
    resolve_max_tokens,
    sampling_kwargs,
)
from hetero.server.sse import EventStream, engine_errors, first_event, stopped_message
from hetero.server.state import STATE, ServerState, read_body
from hetero.structured_outputs import StructuredOutputsParams

# -- /v1/models ----------------------------------------------------------------------------------


def _model_card(state: ServerState) -> dict[str, Any]:
    engine, _ = state.require_ready()
    return {
        "id": state.served_name,
        "object": "model",
        "created": state.created,
        "owned_by": "hetero",
        "root": str(state.settings.model_path),
        "max_model_len": engine.max_model_len,
    }


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the served model's card, or OpenAI's 404."""
    state = request.app[STATE]
    check_model({"model": request.match_info["model"]}, state.served_name)
    return web.json_response(_model_card(state))


# -- /v1/chat/completions ------------------------------------------------------------------------


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    top = body.get("top_logprobs")
    if not body.get("logprobs"):
        if top is not None:
            raise bad("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
        return None
    return top or 0


def _response_format(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """What `response_format` asks for: `text` (nothing); `json_object` under OpenAI's rules;
    `json_schema`, whose schema the output is held to. The output is grammar-constrained
    (engine/grammar_mask.py) and ends with its JSON value."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_schema":
        return StructuredOutputsParams(json=_json_schema(fmt.get("json_schema")))
    if kind != "json_object":
        raise bad(
            f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
            "'json_schema'",
            param="response_format",
        )
    # OpenAI's rule: the model must be told to answer in JSON (or it writes poor JSON).
    if not any("json" in str(m.get("content", "")).lower() for m in body["messages"]):
        raise bad(
            "'messages' must contain the word 'json' in some form, to use 'response_format' "
            "of type 'json_object'.",
            param="messages",
        )
    return StructuredOutputsParams(json_object=True)


def _json_schema(spec: Any) -> dict | bool:
    param = "response_format.json_schema"
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad(f"'{param}' must be an object with a string 'name'", param=param)
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise bad(f"'{param}.schema' must be a JSON Schema (an object)", param=param)
    return schema


async def _check_constraint(state: ServerState, kw: dict[str, Any], param: str) -> None:
    """Compile the request's constraint off the loop (a large schema takes milliseconds)."""
    so = kw.get("structured_outputs")
    if so is not None:
        await state.off_loop(check_structured_outputs, so, param)


def _chat_prompt(tokenizer, messages: list, add_generation_prompt: bool) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as e:
        raise bad(str(e), param="messages") from e
    return tokenizer.encode(text)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request)
    check_fields(body, CHAT_FIELDS, CHAT_UNSUPPORTED)
    check_model(body, state.served_name)
    engine, ae = state.require_ready()
    kw = sampling_kwargs(body)
    logprobs = _chat_logprobs(body)
    if logprobs is not None:
        kw["logprobs"] = logprobs
    add_prompt = body.get("add_generation_prompt")
    add_prompt = True if add_prompt is None else add_prompt
    # the template's rendering checks the messages, before JSON mode reads their content
    ids = await state.off_loop(_chat_prompt, ae.tokenizer, body["messages"], add_prompt)
    so = _response_format(body)
    if so is not None and "structured_outputs" in kw:
        raise bad(
            "give 'response_format' or 'structured_outputs', not both", param="response_format"
        )
    kw["structured_outputs"] = so or kw.get("structured_outputs")
    await _check_constraint(state, kw, "response_format" if so else "structured_outputs")
    param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    max_tokens = resolve_max_tokens(
        body.get(param), len(ids), engine.max_model_len, state.pool_tokens,
        requested_param=param,
    )  # fmt: skip
    params = make_params(kw, max_tokens)
    job = Job(ae, ae.tokenizer, state.metrics, [ids], params, "chatcmpl", state.pace)
    with state.in_flight():
        if body.get("stream"):
            return await _stream_chat(request, state, job, include_usage(body), logprobs)
        with engine_errors():
            await job.run()
        return web.json_response(_chat_body(state, job, logprobs))


def _finished_or_503(job: Job) -> None:
    if job.error is not None:
        tokens = job.usage().completion_tokens
        raise ApiError(503, stopped_message(job.error, tokens), code="aborted")


def _chat_body(state: ServerState, job: Job, logprobs: int | None) -> dict[str, Any]:
    _finished_or_503(job)
    tok = state.tokenizer
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.stream.out.text},
            "logprobs": lp.chat(tok, c.stream.out.logprobs) if logprobs is not None else None,
            "finish_reason": c.stream.out.finish_reason,
        }
        for c in job.choices
    ]
    return {
        "id": job.id,
        "object": "chat.completion",
        "created": job.created,
        "model": state.served_name,
        "choices": choices,
        "usage": job.usage().body(),
    }


async def _stream_chat(
    request: web.Request, state: ServerState, job: Job, usage: bool, logprobs: int | None
) -> web.StreamResponse:
    head = {
        "id": job.id,
        "object": "chat.completion.chunk",
        "created": job.created,
        "model": state.served_name,
    }
    tok = state.tokenizer
    started: set[int] = set()

    def chunk(index: int, delta: dict, event: Event | None) -> dict[str, Any]:
        logs = lp.chat(tok, event.logprobs) if event and logprobs is not None else None
        reason = event.finish_reason if event else None
        choice = {"index": index, "delta": delta, "logprobs": logs, "finish_reason": reason}
        return {**head, "choices": [choice]}

    async with aclosing(job.events()) as events:
        event = await first_event(events)
        sse = await EventStream.open(request)
        while event is not None:
            if event.error:
                await sse.send_error(stopped_message(event.error, job.usage().completion_tokens))
                return await sse.done()
            if event.index not in started:
                started.add(event.index)
                await sse.send(chunk(event.index, {"role": "assistant", "content": ""}, None))
            if event.delta or event.finish_reason or (logprobs is not None and event.logprobs):
                delta = {"content": event.delta} if event.delta else {}
                await sse.send(chunk(event.index, delta, event))
            event = await anext(events, None)
    if usage:
        await sse.send({**head, "choices": [], "usage": job.usage().body()})
    return await sse.done()


# -- /v1/completions -----------------------------------------------------------------------------


def _encode_prompts(tokenizer, items: Sequence[str | list[int]], suffix: str | None) -> list:
    ids = [tokenizer.encode(p, add_special=True) if isinstance(p, str) else p for p in items]
    if suffix is None:
        return ids
    # code around a gap: control tokens' text in it stays text (as /infill does)
    suffix_ids = tokenizer.encode(suffix, parse_special=False)
    texts = [tokenizer.encode(p, parse_special=False) if isinstance(p, str) else p for p in items]
    return [fim_prompt(tokenizer, t, suffix_ids) for t in texts]


def _completion_checks(body: dict[str, Any]) -> None:
    if body.get("echo") and body.get("suffix") is not None:
        raise bad("'echo' cannot be combined with 'suffix'", param="echo")
    if body.get("echo") and body.get("logprobs") is not None:
        raise bad(
            "'echo' with 'logprobs' needs the prompt's logprobs, which this engine does not "
            "compute yet; ask for one or the other",
            param="logprobs",
        )
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") or 1):
        raise bad("'best_of' other than 'n' is not supported", param="best_of")


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request)
    check_fields(body, COMPLETION_FIELDS)
    check_model(body, state.served_name)
    engine, ae = state.require_ready()
    _completion_checks(body)
    kw = sampling_kwargs(body)
    if body.get("logprobs") is not None:
        kw["logprobs"] = body["logprobs"]
    await _check_constraint(state, kw, "structured_outputs")
    tok = ae.tokenizer
    items = prompt_list(body["prompt"], tok.vocab_size)
    prompts = await state.off_loop(_encode_prompts, tok, items, body.get("suffix"))
    requested = body.get("max_tokens") or 16  # the legacy API's default
    limits = (engine.max_model_len, state.pool_tokens)
    for i, p in enumerate(prompts):
        if not p:
            where = f"prompt[{i}]" if len(prompts) > 1 else "the prompt"
            raise bad(f"{where} has no tokens: send at least one", param="prompt")
        resolve_max_tokens(requested, len(p), *limits, prompt_param="prompt")
    job = Job(ae, tok, state.metrics, prompts, make_params(kw, requested), "cmpl", state.pace)
    echo = [_echo_text(tok, p) for p in items] if body.get("echo") else None
    with state.in_flight():
        if body.get("stream"):
            return await _stream_completion(request, state, job, echo, include_usage(body))
        with engine_errors():
            await job.run()
        return web.json_response(_completion_body(state, job, echo))


def _echo_text(tokenizer, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


def _completion_body(state: ServerState, job: Job, echo: list[str] | None) -> dict[str, Any]:
    _finished_or_503(job)
    tok = state.tokenizer
    choices = []
    for c in job.choices:
        head = echo[c.prompt] if echo else ""
        out = c.stream.out
        logs = None if out.logprobs is None else lp.legacy(tok, out.logprobs, len(head))
        choices.append(
            {
                "index": c.index,
                "text": head + out.text,
                "logprobs": logs,
                "finish_reason": out.finish_reason,
            }
        )
    return {
        "id": job.id,
        "object": "text_completion",
        "created": job.created,
        "model": state.served_name,
        "choices": choices,
        "usage": job.usage().body(),
    }


async def _stream_completion(
    request: web.Request, state: ServerState, job: Job, echo: list[str] | None, usage: bool
) -> web.StreamResponse:
    head = {
        "id": job.id,
        "object": "text_completion",
        "created": job.created,
        "model": state.served_name,
    }
    tok = state.tokenizer
    offsets = {c.index: len(echo[c.prompt]) if echo else 0 for c in job.choices}
    started: set[int] = set()

    def chunk(index: int, text: str, logs: Any, reason: str | None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logs, "finish_reason": reason}
        return {**head, "choices": [choice]}

    async with aclosing(job.events()) as events:
        event = await first_event(events)
        sse = await EventStream.open(request)
        while event is not None:
            i = event.index
            if event.error:
                await sse.send_error(stopped_message(event.error, job.usage().completion_tokens))
                return await sse.done()
            if echo and i not in started:
                started.add(i)
                await sse.send(chunk(i, echo[job.choices[i].prompt], None, None))
            logs = None
            if event.logprobs is not None and job.params.logprobs is not None:
                logs = lp.legacy(tok, event.logprobs, offsets[i])
                offsets[i] += sum(len(t) for t in logs["tokens"])
            if event.delta or event.finish_reason or logs:
                await sse.send(chunk(i, event.delta, logs, event.finish_reason))
            event = await anext(events, None)
    if usage:
        await sse.send({**head, "choices": [], "usage": job.usage().body()})
    return await sse.done()
