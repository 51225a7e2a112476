"""Fill-in-the-middle: prompts from the FIM tokens a vocabulary has, and llama.cpp's /infill.

The prompt is the repo-level layout llama.cpp builds (Qwen2.5-Coder's, arXiv 2409.12186), with
only the parts the vocabulary has tokens for:

    [BOS] [REPO]myproject\\n [SEP]file0\\n chunk0 [SEP]file1\\n chunk1 ... [SEP]filename\\n
          [PRE] input_prefix prompt [SUF] input_suffix [MID]

Without a file-separator token each extra chunk is introduced by a plain-text snippet header.
When it does not fit the context (less the room kept for the output), the extra chunks are cut
from their start first, then the prefix from its start and the suffix from its end (the suffix
keeps at most a quarter of what is left): the text nearest the cursor stays.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hetero.server.generation import Job
from hetero.server.protocol import ApiError, Field, bad, check_fields
from hetero.server.sampling_request import context_error, make_params
from hetero.server.sse import EventStream, first_event, stopped_message
from hetero.server.state import STATE, ignore_fields, read_body
from hetero.tokenizer import FimTokens

INFILL_FIELDS: dict[str, Field] = {
    "model": Field("string"),
    "input_prefix": Field("string", required=True),  # required, as llama.cpp has them
    "input_suffix": Field("string", required=True),
    "input_extra": Field("array"),
    "prompt": Field("string"),
    "n_predict": Field("integer", -1),
    "temperature": Field("number", 0),
    "top_k": Field("integer"),
    "top_p": Field("number", 0, 1),
    "min_p": Field("number", 0, 1),
    "seed": Field("integer", -1, 2**64 - 1),
    "stop": Field("stop"),
    "repeat_penalty": Field("number", 0),
    "presence_penalty": Field("number", -2, 2),
    "frequency_penalty": Field("number", -2, 2),
    "stream": Field("boolean"),
    "n_indent": Field("integer", 0),
    "t_max_predict_ms": Field("integer", 0),
    # llama.cpp's knobs that change nothing here: the prefix cache is always on, the sampler
    # order is fixed, there is one slot, prompts are never timed out.
    "cache_prompt": Field("boolean"),
    "samplers": Field("array"),
    "id_slot": Field("integer"),
    "t_max_prompt_ms": Field("integer"),
    "response_fields": Field("array"),
}
# llama.cpp's sampling defaults, which IDE plugins written for it expect.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
OUTPUT_RESERVE = 256  # kept for the output when n_predict is not given (or -1)
REPO_HEADER = "myproject\n"  # llama.cpp's project name; the API has no field for it
SNIPPET_HEADER = "\n\n--- snippet ---\n\n"


def require_fim(tokenizer) -> FimTokens:
    fim = tokenizer.fim
    missing = [r for r in ("prefix", "suffix", "middle") if getattr(fim, r) is None]
    if missing:
        raise bad(
            "this model has no fill-in-the-middle tokens (its vocabulary lacks the FIM "
            f"{', '.join(missing)} token{'s' if len(missing) > 1 else ''}); use a code model "
            "trained for infilling",
            code="fim_not_supported",
        )
    return fim


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []


def fim_prompt(tokenizer, prefix: list[int], suffix: list[int]) -> list[int]:
    """[BOS] [PRE] prefix [SUF] suffix [MID]: what /v1/completions does with `suffix`."""
    fim = require_fim(tokenizer)
    return [*_bos(tokenizer), fim.prefix, *prefix, fim.suffix, *suffix, fim.middle]


def _user_text(tokenizer, text: str) -> list[int]:
    """A user's code as plain text: "<|fim_middle|>" in a file is not the control token."""
    return tokenizer.encode(text, parse_special=False)


def _extra_tokens(tokenizer, fim: FimTokens, chunks: list[tuple[str, str]]) -> list[int]:
    extra: list[int] = []
    if fim.repo is not None:
        extra += [fim.repo, *tokenizer.encode(REPO_HEADER)]
    for filename, text in chunks:
        if fim.sep is not None:
            extra += [fim.sep, *_user_text(tokenizer, filename + "\n")]
        else:
            extra += tokenizer.encode(SNIPPET_HEADER)
        extra += _user_text(tokenizer, text)
    if fim.sep is not None:
        extra += [fim.sep, *tokenizer.encode("filename\n")]
    return extra


@dataclass(frozen=True)
class InfillInput:
    prefix: str
    suffix: str
    prompt: str
    chunks: list[tuple[str, str]]  # (filename, text)


def build_infill(tokenizer, inp: InfillInput, room: int) -> tuple[list[int], bool]:
    """The prompt's token ids within `room` tokens, and whether anything had to be cut."""
    fim = require_fim(tokenizer)
    pre, suf = _user_text(tokenizer, inp.prefix), _user_text(tokenizer, inp.suffix)
    typed = _user_text(tokenizer, inp.prompt)
    extra = _extra_tokens(tokenizer, fim, inp.chunks)
    bos = _bos(tokenizer)
    avail = room - 3 - len(bos) - len(typed)
    if avail < 0:
        raise bad(
            f"the infill prompt alone has {len(typed)} tokens; with the FIM tokens it does not "
            f"fit the {room} tokens the context leaves for the input",
            param="prompt",
            code="context_length_exceeded",
        )
    take_suf = len(suf) if len(pre) + len(suf) <= avail else min(len(suf), avail // 4)
    take_pre = min(len(pre), avail - take_suf)
    take_extra = min(len(extra), avail - take_pre - take_suf)
    truncated = (take_pre, take_suf, take_extra) != (len(pre), len(suf), len(extra))
    ids = [*bos, *extra[len(extra) - take_extra :], fim.prefix, *pre[len(pre) - take_pre :]]
    ids += [*typed, fim.suffix, *suf[:take_suf], fim.middle]
    return ids, truncated


def _chunks(extra: list | None) -> list[tuple[str, str]]:
    out = []
    for i, c in enumerate(extra or ()):
        ok = (
            isinstance(c, dict)
            and set(c) <= {"filename", "text"}
            and isinstance(c.get("text"), str)
            and isinstance(c.get("filename", ""), str)
        )
        if not ok:
            raise bad(
                f"input_extra[{i}] must be an object {{'filename': string, 'text': string}} "
                "('text' required)",
                param="input_extra",
            )
        out.append((c.get("filename") or "tmp", c["text"]))
    return out


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    kw = {k: body[k] if body.get(k) is not None else v for k, v in DEFAULTS.items()}
    kw["top_k"] = max(kw["top_k"], 0)  # llama.cpp: k <= 0 turns top-k off
    if kw["top_p"] == 0:
        raise bad("top_p must be in (0, 1]", param="top_p")
    for src, dst in (
        ("repeat_penalty", "repetition_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
    ):
        if body.get(src) is not None:
            kw[dst] = body[src]
    seed = body.get("seed")
    if seed is not None and seed != -1:  # llama.cpp: -1 is a random seed
        kw["seed"] = seed
    stop = body.get("stop")
    if stop:
        kw["stop"] = [stop] if isinstance(stop, str) else stop
    return kw


class LineLimits:
    """llama.cpp's IDE limits: n_indent (stop at a line indented less) and t_max_predict_ms."""

    def __init__(self, n_indent: int, t_max_ms: int, silent: bool = False) -> None:
        self.n_indent = n_indent
        self.t_max = t_max_ms / 1000
        self.silent = silent  # show nothing and stop at once (n_predict 0)
        self.start = time.perf_counter()

    def apply(self, text: str, delta: str) -> tuple[str, bool]:
        """(the part of delta to keep, whether to stop) after `text` was kept before it."""
        if self.silent:
            return "", True
        full = text + delta
        if self.n_indent > 0:
            cut = indent_cut(full, self.n_indent)
            if cut is not None:
                return full[len(text) : max(cut, len(text))], True
        late = self.t_max > 0 and time.perf_counter() - self.start > self.t_max
        return delta, late and "\n" in delta


def indent_cut(text: str, n_indent: int) -> int | None:
    """Where a line after the first starts with less than n_indent spaces/tabs (llama.cpp).

    The cut keeps the line break and that line's indentation; as in llama.cpp, an empty line
    counts as unindented.
    """
    pos = text.find("\n")
    while pos != -1:
        i = start = pos + 1
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and i - start < n_indent:
            return i
        pos = text.find("\n", start)
    return None


async def infill(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request)
    ignore_fields(request, check_fields(body, INFILL_FIELDS))
    state.model_for(body)
    engine, ae = state.require_ready()
    tok = ae.tokenizer
    require_fim(tok)
    inp = InfillInput(
        body.get("input_prefix") or "",
        body.get("input_suffix") or "",
        body.get("prompt") or "",
        _chunks(body.get("input_extra")),
    )
    kw = _sampling(body)
    n_predict = body.get("n_predict")
    # llama.cpp: 0 evaluates the prompt into the cache (IDE plugins warm it this way) and shows
    # nothing; one token is the least the engine generates. -1 (the default) is no limit.
    warm_only = n_predict == 0
    if warm_only:
        n_predict = 1
    elif n_predict == -1:
        n_predict = None
    room = min(engine.max_model_len, state.pool_tokens)
    if n_predict is not None and n_predict >= room:
        pool = state.pool_tokens
        raise context_error(0, n_predict, room, engine.max_model_len, pool, "n_predict")
    reserve = n_predict or min(OUTPUT_RESERVE, room // 4)
    ids, truncated = await state.off_loop(build_infill, tok, inp, room - reserve)
    params = make_params(kw, n_predict or room - len(ids))
    job = Job(ae, tok, state.metrics, [ids], params, "infill", state.pace)
    limits = LineLimits(body.get("n_indent") or 0, body.get("t_max_predict_ms") or 0, warm_only)
    with state.in_flight():
        return await _run(request, state, job, limits, bool(body.get("stream")), truncated)


async def _run(
    request: web.Request, state, job: Job, limits: LineLimits, stream: bool, truncated: bool
) -> web.StreamResponse:
    text, cut, sse = "", False, None
    async with aclosing(job.events()) as events:
        event = await first_event(events)
        if stream:
            sse = await EventStream.open(request)
        while event is not None:
            if event.error:
                message = stopped_message(event.error, job.usage().completion_tokens)
                if sse is None:
                    raise ApiError(503, message, code="aborted")
                await sse.send_error(message)
                return await sse.done(marker=False)
            delta, cut = limits.apply(text, event.delta)
            text += delta
            if sse is not None and delta:
                await sse.send({"index": 0, "content": delta, "stop": False})
            if cut or event.finish_reason:
                break
            event = await anext(events, None)
    final = _final(state, job, text, cut, truncated)
    if sse is None:
        return web.json_response(final)
    await sse.send({**final, "content": ""})
    return await sse.done(marker=False)


def _final(state, job: Job, text: str, cut: bool, truncated: bool) -> dict[str, Any]:
    out = job.choices[0].stream.out
    usage = job.usage()
    if cut or out.finish_reason == "length":
        stop_type = "limit"
    else:
        stop_type = "word" if isinstance(out.stop_reason, str) else "eos"
    return {
        "index": 0,
        "content": text,
        "stop": True,
        "model": state.served_name,
        "stop_type": stop_type,
        "stopping_word": out.stop_reason if stop_type == "word" else "",
        "tokens_predicted": usage.completion_tokens,
        "tokens_evaluated": usage.prompt_tokens,
        "tokens_cached": usage.cached_tokens,
        "truncated": truncated,
        "usage": usage.body(),
    }
