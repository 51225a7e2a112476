"""Bad input gets a clear error in OpenAI's shape, and the daemon answers normally right after.

The daemon runs with an API key, a 4 KiB body limit and a 256-token context, so each limit can be
crossed with small requests. Every case is followed by a normal request.
"""

from __future__ import annotations

import json

import openai
import pytest

from hetero.tokenizer import Tokenizer
from tests.support.server_fixture import start_daemon

NAME = "smol"
KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
CONTEXT = 256
LONG_PROMPT = "word " * 400


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(
        "--api-key",
        KEY,
        "--served-model-name",
        NAME,
        "--strict-model-name",
        "--max-request-bytes",
        "4096",
        "--max-model-len",
        str(CONTEXT),
        "--num-kv-blocks",
        "64",
        "--threads",
        "1",
    )
    yield d
    assert d.finish() == 0, d.log()


def chat(**kw) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **kw}


def cmpl(**kw) -> dict:
    return {"model": NAME, "prompt": "Hi", "max_tokens": 1, **kw}


# (id, method, path, body, headers, status, param, what the message says)
CASES = [
    ("malformed-json", "POST", CHAT, b'{"messages": [', AUTH, 400, None, "could not parse"),
    ("body-is-an-array", "POST", CMPL, b"[1, 2]", AUTH, 400, None, "must be a JSON object"),
    ("not-utf8", "POST", CMPL, b'{"prompt": "\xff"}', AUTH, 400, None, "UTF-8"),
    ("nan", "POST", CMPL, b'{"prompt": "Hi", "temperature": NaN}', AUTH, 400, None,
     "NaN is not valid JSON"),
    ("wrong-type", "POST", CHAT, chat(temperature="hot"), AUTH, 400, "temperature", "a number"),
    ("bool-for-int", "POST", CMPL, cmpl(max_tokens=True), AUTH, 400, "max_tokens", "integer"),
    ("messages-string", "POST", CHAT, chat(messages="hi"), AUTH, 400, "messages", "an array"),
    ("no-role", "POST", CHAT, chat(messages=[{"content": "x"}]), AUTH, 400, "messages", "role"),
    ("json-mode-string-message", "POST", CHAT, chat(messages=["hi json"],
     response_format={"type": "json_object"}), AUTH, 400, "messages", "must be an object"),
    ("tool-answers-no-call", "POST", CHAT, chat(messages=[{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
      "function": {"name": "f", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "2", "content": "sunny"}]), AUTH, 400, "messages",
     "no earlier assistant message made a call with that id"),
    ("no-messages", "POST", CHAT, {"model": NAME}, AUTH, 400, "messages", "Missing required"),
    ("empty-messages", "POST", CHAT, chat(messages=[]), AUTH, 400, "messages", "at least one"),
    ("no-prompt", "POST", CMPL, {"model": NAME}, AUTH, 400, "prompt", "Missing required"),
    ("output-changing-field", "POST", CHAT, chat(web_search_options={}), AUTH, 400,
     "web_search_options", "not supported"),
    ("tool-without-function", "POST", CHAT, chat(tools=[{"type": "function"}]), AUTH, 400,
     "tools", "no 'function'"),
    ("tool-schema-invalid", "POST", CHAT, chat(tools=[{"type": "function", "function": {
     "name": "f", "parameters": {"type": "object", "required": "x"}}}]), AUTH, 400, "tools",
     "not a valid JSON Schema"),
    ("tool-choice-unknown", "POST", CHAT, chat(tools=[{"type": "function", "function": {
     "name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}), AUTH, 400,
     "tool_choice", "'g', which is not among the tools"),
    ("tool-choice-without-tools", "POST", CHAT, chat(tool_choice="auto"), AUTH, 400,
     "tool_choice", "only allowed when 'tools'"),
    ("reasoning-effort", "POST", CHAT, chat(reasoning_effort="max"), AUTH, 400,
     "reasoning_effort", "Invalid value"),
    ("logit-bias-key", "POST", CHAT, chat(logit_bias={"five": 1}), AUTH, 400, "logit_bias",
     "token ids"),
    ("logit-bias-value", "POST", CHAT, chat(logit_bias={"5": 101}), AUTH, 400, "logit_bias",
     "[-100, 100]"),
    ("logit-bias-id", "POST", CMPL, cmpl(logit_bias={"99999999": 1}), AUTH, 400, None,
     "logit_bias token ids"),
    ("min-tokens-over-max", "POST", CMPL, cmpl(min_tokens=9, max_tokens=4), AUTH, 400,
     "min_tokens", "max_tokens"),
    ("schema-not-compiling", "POST", CHAT, chat(response_format={"type": "json_schema",
     "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type":
     "strin"}}}}}), AUTH, 400, "response_format", "invalid structured output"),
    ("structured-two-fields", "POST", CMPL, cmpl(structured_outputs={"regex": "a", "choice":
     ["b"]}), AUTH, 400, "structured_outputs", "exactly one"),
    ("grammar-not-compiling", "POST", CMPL, cmpl(structured_outputs={"grammar": "start: x"}),
     AUTH, 400, "structured_outputs", "invalid structured output"),
    ("tokenize-not-string", "POST", "/tokenize", {"content": 5}, AUTH, 400, "content",
     "a string"),
    ("detokenize-bad-id", "POST", "/detokenize", {"tokens": [-1]}, AUTH, 400, "tokens",
     "token ids"),
    ("tokenize-no-key", "POST", "/tokenize", {"content": "x"}, {}, 401, None, "API key"),
    ("temperature-3", "POST", CHAT, chat(temperature=3), AUTH, 400, "temperature", "range"),
    ("top-p-negative", "POST", CMPL, cmpl(top_p=-0.1), AUTH, 400, "top_p", "range [0, 1]"),
    ("max-tokens-0", "POST", CMPL, cmpl(max_tokens=0), AUTH, 400, "max_tokens", "minimum"),
    ("n-0", "POST", CHAT, chat(n=0), AUTH, 400, "n", "range"),
    ("penalty-3", "POST", CMPL, cmpl(presence_penalty=3), AUTH, 400, "presence_penalty", "range"),
    ("seed-2**70", "POST", CMPL, cmpl(seed=2**70), AUTH, 400, "seed", "18446744073709551615]"),
    ("top-logprobs-21", "POST", CHAT, chat(logprobs=True, top_logprobs=21), AUTH, 400,
     "top_logprobs", "range"),
    ("top-logprobs-alone", "POST", CHAT, chat(top_logprobs=2), AUTH, 400, "top_logprobs",
     "requires 'logprobs'"),
    ("stream-options-alone", "POST", CHAT, chat(stream_options={"include_usage": True}), AUTH,
     400, "stream_options", "only allowed"),
    ("stop-number", "POST", CMPL, cmpl(stop=[1]), AUTH, 400, "stop", "strings"),
    ("stop-empty", "POST", CMPL, cmpl(stop=[""]), AUTH, 400, "stop", "non-empty"),
    ("token-id-range", "POST", CMPL, cmpl(prompt=[1, 10**9]), AUTH, 400, "prompt", "token ids"),
    ("empty-prompt", "POST", CMPL, cmpl(prompt=[]), AUTH, 400, "prompt", "empty"),
    ("empty-string-prompt", "POST", CMPL, cmpl(prompt=""), AUTH, 400, "prompt", "no tokens"),
    ("echo-logprobs", "POST", CMPL, cmpl(echo=True, logprobs=1), AUTH, 400, "logprobs", "echo"),
    ("json-schema", "POST", CHAT, chat(response_format={"type": "json_schema"}), AUTH, 400,
     "response_format.json_schema", "string 'name'"),
    ("json-schema-text", "POST", CHAT, chat(response_format={"type": "json_schema",
     "json_schema": {"name": "x", "schema": "object"}}), AUTH, 400,
     "response_format.json_schema", "a JSON Schema"),
    ("format-type", "POST", CHAT, chat(response_format={"type": "yaml"}), AUTH, 400,
     "response_format", "not supported"),
    ("unknown-model", "POST", CHAT, chat(model="gpt-4o"), AUTH, 404, "model", "does not exist"),
    ("output-too-long", "POST", CMPL, cmpl(max_tokens=CONTEXT), AUTH, 400, "max_tokens",
     f"maximum context length is {CONTEXT} tokens"),
    ("completion-too-long", "POST", CHAT, chat(max_tokens=None, max_completion_tokens=CONTEXT),
     AUTH, 400, "max_completion_tokens", f"maximum context length is {CONTEXT} tokens"),
    ("unknown-model-card", "GET", "/v1/models/gpt-4o", None, AUTH, 404, "model", "does not exist"),
    ("unknown-embedding-model", "POST", "/v1/embeddings", {"input": "x", "model": "gpt-4o"}, AUTH,
     404, "model", "does not exist"),
    ("too-big", "POST", CMPL, cmpl(prompt="x" * 5000), AUTH, 413, None, "larger than 4096"),
    ("no-key", "POST", CMPL, cmpl(), {}, 401, None, "didn't provide an API key"),
    ("wrong-key", "POST", CMPL, cmpl(), {"Authorization": "Bearer nope"}, 401, None, "Incorrect"),
    ("unknown-route", "GET", "/v1/nothing", None, AUTH, 404, None, "Not Found"),
    ("wrong-method", "GET", CHAT, None, AUTH, 405, None, "Method Not Allowed"),
    ("infill-no-fim", "POST", "/infill", {"input_prefix": "def f(", "input_suffix": ")"}, AUTH,
     400, None, "no fill-in-the-middle tokens"),
]  # fmt: skip


def assert_error_shape(body: dict, status: int) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    return err


def assert_serves_normally(daemon) -> None:
    status, body = daemon.post(CMPL, cmpl(), headers=AUTH)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    "method, path, body, headers, status, param, message",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_input_is_refused_clearly(daemon, method, path, body, headers, status, param, message):
    got, _, raw = daemon.request(method, path, body, headers=headers)
    assert got == status, raw
    err = assert_error_shape(json.loads(raw), status)
    assert message in err["message"]
    assert err["param"] == param
    assert_serves_normally(daemon)


def test_prompt_longer_than_the_context_names_both_numbers(daemon, smollm2_path):
    n = len(Tokenizer.from_gguf(smollm2_path).encode(LONG_PROMPT))
    assert n > CONTEXT
    for path, body in ((CMPL, cmpl(prompt=LONG_PROMPT)), (CHAT, chat())):
        if path == CHAT:
            body["messages"][0]["content"] = LONG_PROMPT
        got, raw = daemon.post(path, body, headers=AUTH)
        assert got == 400
        err = assert_error_shape(raw, 400)
        assert err["code"] == "context_length_exceeded"
        assert str(CONTEXT) in err["message"]
        assert any(str(k) in err["message"] for k in range(n, n + 40))  # + the chat template
    assert_serves_normally(daemon)


def test_the_official_client_sees_the_errors(daemon):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    raw = client.completions.with_raw_response.create(
        model=NAME, prompt="x", max_tokens=1, extra_body={"bogus": True}
    )
    assert raw.headers["X-Hetero-Ignored-Fields"] == "bogus"  # accepted, named, ignored
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=1)
    keyless = openai.OpenAI(base_url=daemon.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        keyless.models.list()
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    assert_serves_normally(daemon)


def test_health_and_metrics_need_no_key(daemon):
    assert daemon.request("GET", "/health")[0] == 200
    m = daemon.metrics()
    assert m['hetero_http_requests_total{endpoint="/v1/completions",code="401"}'] >= 2
    assert m['hetero_kv_blocks_used{tier="cpu"}'] == 0
