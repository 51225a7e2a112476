"""Request validation for the OpenAI-compatible API, and OpenAI's JSON error shape.

Every body is checked against a table of the fields an endpoint knows before anything runs:
types (null is accepted for every optional field, as OpenAI does) and OpenAI's ranges. Fields the
table does not know are accepted and ignored, as vLLM and llama.cpp do (clients add fields with
every release: `verbosity`, `cache_prompt` ...): `check_fields` returns their names, which the
server logs once and names in the `X-Hetero-Ignored-Fields` response header. Fields that would
change the output in a way this server cannot honour (audio, web search) are a clear 400. The vLLM
extensions `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`skip_special_tokens` and `include_stop_str_in_output` are accepted too (clients pass them as
`extra_body`), and so are vLLM's `min_tokens` and `structured_outputs` (json, json_object, regex,
choice or grammar: hetero.structured_outputs). Range checks that `SamplingParams` already makes
stay there; its ValueError, which names the field, becomes a 400 with that field as `param`
(sampling_request.py: a checked body -> SamplingParams).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hetero.sampling import MAX_LOGPROBS

MAX_N = 128  # OpenAI's bound on n
MAX_STOP = 64  # IDE clients send many stop strings; bound the work they ask for
MAX_PROMPTS = 256  # prompts in one /v1/completions batch


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# -- field tables --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One request field: its JSON kind and, for numbers, OpenAI's closed range."""

    kind: str  # number | integer | boolean | string | object | array | stop | prompt | int_array
    lo: float | None = None
    hi: float | None = None
    required: bool = False


_KIND_NAMES = {
    "number": "a number",
    "integer": "an integer",
    "boolean": "a boolean",
    "string": "a string",
    "object": "an object",
    "array": "an array",
    "stop": "a string or an array of strings",
    "prompt": "a string, an array of strings, an array of token ids or an array of arrays of ids",
    "int_array": "an array of integers",
    "tool_choice": "a string ('none', 'auto' or 'required') or an object",
}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind_ok(kind: str, v: object) -> bool:
    if kind == "number":
        return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)
    if kind == "integer":
        return _is_int(v)
    if kind == "boolean":
        return isinstance(v, bool)
    if kind == "string":
        return isinstance(v, str)
    if kind == "object":
        return isinstance(v, dict)
    if kind == "array":
        return isinstance(v, list)
    if kind == "stop":
        return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
    if kind == "int_array":
        return isinstance(v, list) and all(_is_int(t) for t in v)
    if kind == "prompt":
        return isinstance(v, (str, list))  # the shape inside is checked by completion_prompts
    if kind == "tool_choice":
        return isinstance(v, (str, dict))  # the values are checked with the tools
    raise AssertionError(kind)


def _json_type(v: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names |= {list: "an array", dict: "an object"}
    return names.get(type(v), type(v).__name__)


SAMPLING_FIELDS: dict[str, Field] = {
    "model": Field("string"),
    "n": Field("integer", 1, MAX_N),
    "temperature": Field("number", 0, 2),
    "top_p": Field("number", 0, 1),
    "seed": Field("integer", -(2**63), 2**64 - 1),
    "stop": Field("stop"),
    "max_tokens": Field("integer", 1),
    "presence_penalty": Field("number", -2, 2),
    "frequency_penalty": Field("number", -2, 2),
    "logit_bias": Field("object"),
    "stream": Field("boolean"),
    "stream_options": Field("object"),
    "user": Field("string"),
    # vLLM's extensions
    "top_k": Field("integer", -1),
    "min_p": Field("number", 0, 1),
    "repetition_penalty": Field("number", 0),
    "ignore_eos": Field("boolean"),
    "stop_token_ids": Field("int_array"),
    "skip_special_tokens": Field("boolean"),
    "include_stop_str_in_output": Field("boolean"),
    "min_tokens": Field("integer", 0),
    "structured_outputs": Field("object"),
}
# Fields of OpenAI's API that carry no meaning for one local model; accepted and not used.
IGNORED = ("user", "service_tier", "store", "metadata", "prediction")

CHAT_FIELDS: dict[str, Field] = SAMPLING_FIELDS | {
    "messages": Field("array", required=True),
    "max_completion_tokens": Field("integer", 1),
    "logprobs": Field("boolean"),
    "top_logprobs": Field("integer", 0, MAX_LOGPROBS),
    "response_format": Field("object"),
    "add_generation_prompt": Field("boolean"),
    "service_tier": Field("string"),
    "store": Field("boolean"),
    "metadata": Field("object"),
    "prediction": Field("object"),  # predicted outputs only speed OpenAI up; the text is the same
    "tools": Field("array"),
    "tool_choice": Field("tool_choice"),
    "parallel_tool_calls": Field("boolean"),
    "reasoning_effort": Field("string"),
    "chat_template_kwargs": Field("object"),
}
# Fields that would change the output in ways this server cannot honour: a 400, never ignored.
UNSUPPORTED: tuple[str, ...] = ()
CHAT_UNSUPPORTED = (
    *UNSUPPORTED,
    "functions",  # the deprecated form of tools: answered with function_call, not tool_calls
    "function_call",
    "audio",
    "modalities",  # only ["text"] passes
    "web_search_options",
)

COMPLETION_FIELDS: dict[str, Field] = SAMPLING_FIELDS | {
    "prompt": Field("prompt", required=True),
    "echo": Field("boolean"),
    "logprobs": Field("integer", 0, MAX_LOGPROBS),
    "suffix": Field("string"),
    "best_of": Field("integer", 1, MAX_N),
}


class _NotJson(ValueError):
    pass


def _not_json(constant: str) -> float:
    """Python's parser takes NaN and Infinity; JSON has no such numbers."""
    raise _NotJson(constant)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says where parsing failed."""
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except _NotJson as e:
        raise bad(f"could not parse the JSON body of the request: {e} is not valid JSON") from e
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8: {e}") from e
    except json.JSONDecodeError as e:
        raise bad(
            f"could not parse the JSON body of the request: {e.msg} at line {e.lineno} "
            f"column {e.colno}; the API expects a JSON object"
        ) from e
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {_json_type(body)}")
    return body


def check_fields(
    body: Mapping[str, Any], table: Mapping[str, Field], unsupported: tuple[str, ...] = UNSUPPORTED
) -> list[str]:
    """Types, ranges and required fields of `body` against `table`; returns the names of the
    fields the table does not know (accepted and ignored)."""
    ignored = []
    for key, value in body.items():
        if key in unsupported:
            if value is None or value == [] or (key == "modalities" and value == ["text"]):
                continue
            raise bad(f"'{key}' is not supported by this server", param=key)
        spec = table.get(key)
        if spec is None:
            ignored.append(key)
            continue
        if value is None:
            continue
        if not _kind_ok(spec.kind, value):
            raise bad(
                f"Invalid type for '{key}': expected {_KIND_NAMES[spec.kind]}, "
                f"but got {_json_type(value)} instead.",
                param=key,
            )
        if spec.lo is not None and value < spec.lo or spec.hi is not None and value > spec.hi:
            bounds = _bounds(spec)
            raise bad(f"Invalid value for '{key}': {value!r} is {bounds}.", param=key)
    for key, spec in table.items():
        if spec.required and body.get(key) is None:
            raise bad(f"Missing required parameter: '{key}'.", param=key)
    return ignored


def _bounds(spec: Field) -> str:
    def num(v: float) -> str:
        return str(v) if _is_int(v) else f"{v:g}"  # integers exactly (seed: 2**64 - 1)

    if spec.hi is None:
        return f"below the minimum of {num(spec.lo)}"
    if spec.lo is None:
        return f"above the maximum of {num(spec.hi)}"
    return f"outside the range [{num(spec.lo)}, {num(spec.hi)}]"


def prompt_list(
    value: Any, vocab_size: int, param: str = "prompt", limit: int = MAX_PROMPTS
) -> list[str | list[int]]:
    """OpenAI's four prompt shapes (a string, strings, token ids, arrays of token ids) -> a list
    of prompts, each a string or token ids (`prompt` of /v1/completions, `input` of
    /v1/embeddings)."""
    if isinstance(value, str):
        items: list = [value]
    elif value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        items = [value]
    else:
        items = list(value)
    if not items:
        raise bad(f"'{param}' must not be empty", param=param)
    if len(items) > limit:
        raise bad(f"at most {limit} prompts are allowed in '{param}'", param=param)
    for p in items:
        ok_ids = isinstance(p, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in p
        )
        if not (isinstance(p, str) or ok_ids) or (isinstance(p, list) and not p):
            raise bad(
                f"'{param}' must be a string, an array of strings, or (arrays of) token ids in "
                f"[0, {vocab_size})",
                param=param,
            )
    return items


def check_model(body: Mapping[str, Any], names: tuple[str, ...], strict: bool = False) -> str:
    """The name to answer with: the one asked for when it is one of the served `names` (the first
    is the model's own, the others aliases), the model's own otherwise. Any name is served by the
    one model loaded, as llama.cpp does, unless `strict` (then other names are OpenAI's 404)."""
    model = body.get("model")
    if model in names:
        return model
    if model is not None and strict:
        raise ApiError(
            404,
            f"The model `{model}` does not exist. This server serves `{names[0]}`.",
            param="model",
            code="model_not_found",
        )
    return names[0]
