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

from hetero.server import logprobs as lp
from hetero.server.access_log import note_prompt_text
from hetero.server.chat_request import chat_prompt, openai_input
from hetero.server.chat_response import chat_body, finished_or_503, stream_chat
from hetero.server.generation import Job
from hetero.server.infill import fim_prompt
from hetero.server.protocol import (
    CHAT_FIELDS,
    CHAT_UNSUPPORTED,
    COMPLETION_FIELDS,
    bad,
    check_fields,
    check_model,
    prompt_list,
)
from hetero.server.sampling_request import (
    check_structured_outputs,
    include_usage,
    make_params,
    resolve_max_tokens,
    sampling_kwargs,
)
from hetero.server.sse import EventStream, engine_errors, first_event, stopped_message
from hetero.server.state import STATE, ServerState, ignore_fields, read_body
from hetero.structured_outputs import StructuredOutputsParams

# -- /v1/models ----------------------------------------------------------------------------------


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    engine, _ = state.require_ready()
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "hetero",
        "root": str(state.settings.model_path),
        "max_model_len": engine.max_model_len,
    }


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: one card per name the model answers to (its own, then --alias names)."""
    state = request.app[STATE]
    cards = [_model_card(state, name) for name in state.model_names]
    return web.json_response({"object": "list", "data": cards})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the card of a served name, or OpenAI's 404 (a card is a claim that
    the name exists, so this is strict whatever --strict-model-name says)."""
    state = request.app[STATE]
    name = check_model({"model": request.match_info["model"]}, state.model_names, strict=True)
    return web.json_response(_model_card(state, name))


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


async def _constrain(
    state: ServerState,
    body: dict[str, Any],
    kw: dict[str, Any],
    forced: StructuredOutputsParams | None,
) -> None:
    """The chat's output constraint: `response_format`, vLLM's `structured_outputs`, or the
    grammar of a call that `tool_choice` forces (at most one of them)."""
    so = _response_format(body)
    if so is not None and "structured_outputs" in kw:
        raise bad(
            "give 'response_format' or 'structured_outputs', not both", param="response_format"
        )
    kw["structured_outputs"] = so or kw.get("structured_outputs")
    param = "response_format" if so else "structured_outputs"
    if forced is not None:
        if kw["structured_outputs"] is not None:
            raise bad(
                f"tool_choice {body['tool_choice']!r} forces a tool call, whose arguments follow "
                f"the tool's schema; '{param}' cannot constrain the same answer",
                param=param,
            )
        kw["structured_outputs"], param = forced, "tools"
    await _check_constraint(state, kw, param)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request)
    ignored = check_fields(body, CHAT_FIELDS, CHAT_UNSUPPORTED)
    model = state.model_for(body)
    engine, ae = state.require_ready()
    kw = sampling_kwargs(body)
    logprobs = _chat_logprobs(body)
    if logprobs is not None:
        kw["logprobs"] = logprobs
    chat = openai_input(body)
    # the template's rendering checks the messages, before JSON mode reads their content
    prompt = await state.off_loop(chat_prompt, ae.tokenizer, chat, state.plain_content)
    note_prompt_text(prompt.text)  # for a request trace
    ignore_fields(request, ignored + chat.ignored)
    if prompt.special_tokens and body.get("skip_special_tokens") is None:
        kw["skip_special_tokens"] = False  # the format's markers are control tokens
    await _constrain(state, body, kw, prompt.constraint)
    param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    max_tokens = resolve_max_tokens(
        body.get(param), len(prompt.ids), engine.max_model_len, state.pool_tokens,
        requested_param=param,
    )  # fmt: skip
    params = make_params(kw, max_tokens)
    job = Job(ae, ae.tokenizer, state.metrics, [prompt.ids], params, "chatcmpl", state.pace)
    with state.in_flight():
        if body.get("stream"):
            usage = include_usage(body)
            return await stream_chat(request, state, job, usage, logprobs, prompt.format, model)
        with engine_errors():
            await job.run()
        return web.json_response(chat_body(state, job, logprobs, prompt.format, model))


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
    ignore_fields(request, check_fields(body, COMPLETION_FIELDS))
    model = state.model_for(body)
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
            usage = include_usage(body)
            return await _stream_completion(request, state, job, echo, usage, model)
        with engine_errors():
            await job.run()
        return web.json_response(_completion_body(state, job, echo, model))


def _echo_text(tokenizer, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


def _completion_body(
    state: ServerState, job: Job, echo: list[str] | None, model: str
) -> dict[str, Any]:
    finished_or_503(job)
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
        "model": model,
        "choices": choices,
        "usage": job.usage().body(),
    }


async def _stream_completion(
    request: web.Request,
    state: ServerState,
    job: Job,
    echo: list[str] | None,
    usage: bool,
    model: str,
) -> web.StreamResponse:
    head = {
        "id": job.id,
        "object": "text_completion",
        "created": job.created,
        "model": model,
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
