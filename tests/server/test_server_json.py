"""Structured outputs through the real daemon and the official `openai` client: JSON mode and
JSON Schemas at temperature 1 on SmolLM2 and on a random-weight model (every answer checked by the
`jsonschema` package), vLLM's `structured_outputs` on /v1/completions, and logit_bias and
min_tokens changing what the model writes."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from hetero.synth import write_synthetic
from tests.support import exact_weights
from tests.support.server_fixture import start_daemon

NAME = "smol"
PROMPTS = [
    "Describe a cat as a JSON object with its name and age.",
    "Reply in JSON: three fruits under the key 'fruits'.",
    "Return JSON with the keys city and country for Paris.",
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "scores": {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "number", "minimum": 0, "maximum": 10},
                "maxItems": 4,
            },
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "scores", "address"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def client_of(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(
        "--num-kv-blocks", "512", "--served-model-name", NAME, "--threads", "1",
        *exact_weights.FLAGS,
    )  # fmt: skip
    yield d
    assert d.finish() == 0, d.log()


@pytest.fixture(scope="module")
def client(daemon):
    return client_of(daemon)


def ask(prompt: str, seed: int, fmt: dict | None = None, **kw) -> dict:
    return dict(
        model=NAME,
        messages=[{"role": "user", "content": prompt}],
        temperature=1.0,
        seed=seed,
        max_tokens=384,
        response_format=fmt or {"type": "json_object"},
        **kw,
    )


def assert_one_object(text: str, finish_reason: str) -> dict:
    assert finish_reason == "stop", text  # the object closed: the request ended there
    value = json.loads(text)
    assert isinstance(value, dict), text
    return value


def test_json_object_at_temperature_one(client):
    async def run() -> list:
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0)
        free = dict(model=NAME, messages=[{"role": "user", "content": "Say hello to Ada."}])
        calls = [aclient.chat.completions.create(**free, temperature=0, max_tokens=16)]
        calls += [
            aclient.chat.completions.create(**ask(p, seed)) for seed in (1, 2) for p in PROMPTS
        ]
        return await asyncio.gather(*calls)  # one batch in the engine: rows masked one by one

    free, *answers = asyncio.run(run())
    for r in answers:
        assert_one_object(r.choices[0].message.content, r.choices[0].finish_reason)
    # the free request in the same batches is not held to JSON (which must open with a brace)
    assert not free.choices[0].message.content.lstrip().startswith("{")


def test_json_schema_is_enforced(client):
    """Enums, nested arrays, required keys, no extra keys, string and number bounds, a pattern;
    n = 2 gives each choice its own grammar state."""
    prompt = "Describe a person as JSON: name, age, role, scores and address."
    r = client.chat.completions.create(**ask(prompt, 5, PERSON_FORMAT, n=2))
    r2 = client.chat.completions.create(**ask(prompt, 6, PERSON_FORMAT))
    for c in [*r.choices, *r2.choices]:
        jsonschema.validate(assert_one_object(c.message.content, c.finish_reason), PERSON)


def test_streamed_json_schema(client):
    chunks = list(client.chat.completions.create(**ask(PROMPTS[0], 7, PERSON_FORMAT), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    jsonschema.validate(assert_one_object(text, reasons[-1]), PERSON)


def test_bad_schema_is_a_400(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nothing"}}}
    with pytest.raises(openai.BadRequestError, match="invalid structured output") as e:
        client.chat.completions.create(**ask(PROMPTS[0], 1, bad))
    assert e.value.body["param"] == "response_format"


def test_completions_take_vllm_structured_outputs(client):
    date = client.completions.create(
        model=NAME,
        prompt="The first moon landing was on",
        max_tokens=32,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"}},
    )
    assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", date.choices[0].text)
    assert date.choices[0].finish_reason == "stop"
    pick = client.completions.create(
        model=NAME,
        prompt="Is the sky green? Answer:",
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=4,
        extra_body={"structured_outputs": {"choice": [" yes", " no", " maybe not"]}},
    )
    assert all(c.text in (" yes", " no", " maybe not") for c in pick.choices)


def greedy(client, **kw):
    return client.chat.completions.create(
        **{
            "model": NAME,
            "messages": [{"role": "user", "content": "Say hi to Bob in three words."}],
            "temperature": 0,
            "max_tokens": 96,
            **kw,
        }
    )


def test_logit_bias_changes_the_greedy_token(client, daemon):
    first = greedy(client, max_tokens=1).choices[0].message.content
    status, tokens = daemon.post("/tokenize", {"content": first})
    assert status == 200 and len(tokens["tokens"]) == 1, tokens
    (token,) = tokens["tokens"]
    other = greedy(client, max_tokens=1, logit_bias={str(token): -100}).choices[0].message.content
    assert other != first
    bracket = daemon.post("/tokenize", {"content": "]"})[1]["tokens"][0]
    more = greedy(client, max_tokens=1, logit_bias={str(token): -5, str(bracket): 100})
    assert more.choices[0].message.content == "]"


def test_min_tokens_delays_the_end(client):
    plain = greedy(client)
    assert plain.choices[0].finish_reason == "stop"  # the model ends on its own
    n = plain.usage.completion_tokens
    held = greedy(client, extra_body={"min_tokens": n + 10})
    assert held.usage.completion_tokens >= n + 10
    assert held.choices[0].message.content.startswith(plain.choices[0].message.content)


@pytest.fixture(scope="module")
def random_daemon(tmp_path_factory):
    path = tmp_path_factory.mktemp("json") / "tiny.gguf"
    model = write_synthetic(path, "tiny-llama", "q8_0", progress=False)
    d = start_daemon(str(model), "--num-kv-blocks", "256", "--threads", "1")
    yield d
    assert d.finish() == 0, d.log()


def test_random_weights_follow_the_schema(random_daemon):
    """A model that knows nothing of JSON writes valid instances only because of the mask."""
    client = client_of(random_daemon)

    async def run() -> list:
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0)
        calls = [
            aclient.chat.completions.create(
                messages=[{"role": "user", "content": "anything"}],
                model="tiny",
                temperature=1.0,
                seed=seed,
                n=2,
                max_tokens=600,
                response_format=PERSON_FORMAT,
            )
            for seed in range(4)
        ]
        return await asyncio.gather(*calls)

    for r in asyncio.run(run()):
        for c in r.choices:
            jsonschema.validate(assert_one_object(c.message.content, c.finish_reason), PERSON)
