"""A checked request body -> SamplingParams: the fields the engine's sampler takes, OpenAI's
max_tokens and context rules, logit_bias and structured outputs; every ValueError a 400 naming
its field. The body's types and ranges are checked before (protocol.check_fields)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hetero.sampling import SamplingParams
from hetero.server.protocol import MAX_STOP, SAMPLING_FIELDS, ApiError, bad
from hetero.structured_outputs import StructuredOutputsParams

_PASSED = (
    "n",
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "min_tokens",
)


def sampling_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The SamplingParams fields a checked body sets (max_tokens is resolved later)."""
    kw = {k: body[k] for k in _PASSED if body.get(k) is not None}
    stop = body.get("stop")
    if stop is not None:
        kw["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if len(kw["stop"]) > MAX_STOP:
            raise bad(f"at most {MAX_STOP} stop sequences are allowed", param="stop")
    if body.get("logit_bias"):
        kw["logit_bias"] = _logit_bias(body["logit_bias"])
    if body.get("structured_outputs") is not None:
        kw["structured_outputs"] = _structured_outputs(body["structured_outputs"])
    options = body.get("stream_options")
    if options is not None:
        if not body.get("stream"):
            raise bad(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                param="stream_options",
            )
        extra = set(options) - {"include_usage", "continuous_usage_stats"}
        if extra:
            raise bad(f"Unrecognized stream option: {sorted(extra)[0]}", param="stream_options")
    return kw


def _logit_bias(bias: Mapping[str, Any]) -> dict[int, float]:
    """OpenAI's map of token ids (JSON keys are strings) to biases; values are checked by
    SamplingParams, ids against the vocabulary by the engine."""
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError as e:
            msg = f"'logit_bias' keys must be token ids, got {key!r}"
            raise bad(msg, param="logit_bias") from e
    return out


def _structured_outputs(spec: Mapping[str, Any]) -> StructuredOutputsParams:
    unknown = set(spec) - {"json", "json_object", "regex", "choice", "grammar"}
    if unknown:
        raise bad(
            f"Unrecognized structured_outputs field: {sorted(unknown)[0]}",
            param="structured_outputs",
        )
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as e:
        raise bad(str(e), param="structured_outputs") from e


def check_structured_outputs(so: StructuredOutputsParams, param: str) -> None:
    """400 naming `param` when the constraint does not compile (a bad schema or grammar)."""
    try:
        so.check()
    except ValueError as e:
        raise bad(str(e), param=param) from e


def include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options") or {}
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise bad("'stream_options.include_usage' must be a boolean", param="stream_options")
    return value


def make_params(kw: Mapping[str, Any], max_tokens: int) -> SamplingParams:
    """SamplingParams, its ValueError (which names the field) turned into a 400."""
    try:
        return SamplingParams(**kw, max_tokens=max_tokens)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise bad(str(e), param=field if field in SAMPLING_FIELDS else None) from e


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    pool_tokens: int,
    prompt_param: str = "messages",
    requested_param: str = "max_tokens",
) -> int:
    """max_tokens as asked, or all the room left; 400 (both numbers) when it cannot fit.

    The room is bounded by the context and by the KV pool, which must hold the whole sequence
    (the scheduler refuses a request the pool could never fit).
    """
    limit = min(max_model_len, pool_tokens)
    if prompt_len >= limit:
        raise context_error(prompt_len, None, limit, max_model_len, pool_tokens, prompt_param)
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise context_error(
            prompt_len, requested, limit, max_model_len, pool_tokens, requested_param
        )
    return requested


def context_error(
    prompt_len: int,
    requested: int | None,
    limit: int,
    max_model_len: int,
    pool_tokens: int,
    param: str,
) -> ApiError:
    what = (
        f"This model's maximum context length is {max_model_len} tokens"
        if limit == max_model_len
        else f"The KV cache of this server holds at most {pool_tokens} tokens for one request"
    )
    if requested is None:
        asked = f"However, your prompt has {prompt_len} tokens, which leaves no room for output"
    else:
        asked = (
            f"However, you requested {prompt_len + requested} tokens ({prompt_len} in the "
            f"prompt, {requested} in the completion)"
        )
    return ApiError(
        400,
        f"{what}. {asked}. Please reduce the length of the prompt or of the completion.",
        param=param,
        code="context_length_exceeded",
    )
