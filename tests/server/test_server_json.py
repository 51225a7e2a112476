"""JSON mode through the real daemon and the official `openai` client: at temperature 1, with
several prompts and seeds, every answer is one JSON object that ends the request."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.support import exact_weights
from tests.support.server_fixture import start_daemon

NAME = "smol"
PROMPTS = [
    "Describe a cat as a JSON object with its name and age.",
    "Reply in JSON: three fruits under the key 'fruits'.",
    "Return JSON with the keys city and country for Paris.",
]


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
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def ask(prompt: str, seed: int, **kw) -> dict:
    return dict(
        model=NAME,
        messages=[{"role": "user", "content": prompt}],
        temperature=1.0,
        seed=seed,
        max_tokens=384,
        response_format={"type": "json_object"},
        **kw,
    )


def assert_one_object(text: str, finish_reason: str) -> None:
    assert finish_reason == "stop", text  # the object closed: the request ended there
    assert isinstance(json.loads(text), dict), text


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


def test_streamed_json_object(client):
    chunks = list(client.chat.completions.create(**ask(PROMPTS[0], 7), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert_one_object(text, reasons[-1])  # the finish reason comes on the last choice chunk


def test_json_schema_is_held_to_an_object(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    body = ask(PROMPTS[2], 3)
    body["response_format"] = fmt
    r = client.chat.completions.create(**body)
    assert_one_object(r.choices[0].message.content, r.choices[0].finish_reason)
