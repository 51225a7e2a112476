"""llama.cpp's /tokenize and /detokenize on the real daemon, against transformers' tokenizer of
the same GGUF; and usage's cached_tokens on /v1/completions answers, streamed and not."""

from __future__ import annotations

import openai
import pytest

from tests.support.server_fixture import sse_events, start_daemon

BLOCK = 16  # the daemon's default block size: prefix hits come in whole blocks
TEXTS = [
    "Hello, world! def f(x):\n    return x ** 2",
    "naïve café, 東京 and 🙂 emoji",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon("--num-kv-blocks", "256", "--threads", "1")
    yield d
    assert d.finish() == 0, d.log()


def tokenize(daemon, **body):
    status, answer = daemon.post("/tokenize", body)
    assert status == 200, answer
    return answer["tokens"]


def test_tokenize_equals_transformers(daemon, hf_smollm2):
    for text in TEXTS:
        want = hf_smollm2(text, add_special_tokens=False).input_ids
        assert tokenize(daemon, content=text) == want
        assert tokenize(daemon, content=text, add_special=True) == hf_smollm2(text).input_ids
    special = tokenize(daemon, content=TEXTS[2])
    plain = tokenize(daemon, content=TEXTS[2], parse_special=False)
    im_start = hf_smollm2.convert_tokens_to_ids("<|im_start|>")
    assert special[0] == im_start and im_start not in plain and len(plain) > len(special)
    assert tokenize(daemon) == []  # llama.cpp answers a body without content with no tokens


def test_pieces_and_detokenize(daemon, hf_smollm2):
    for text in TEXTS:
        pieces = tokenize(daemon, content=text, with_pieces=True)
        ids = [p["id"] for p in pieces]
        assert ids == hf_smollm2(text, add_special_tokens=False).input_ids
        data = b"".join(
            p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
            for p in pieces
        )
        assert data.decode() == text
        status, answer = daemon.post("/detokenize", {"tokens": ids})
        assert status == 200 and answer == {"content": text}
    emoji = tokenize(daemon, content="🙂", with_pieces=True)
    assert any(isinstance(p["piece"], list) for p in emoji), emoji  # bytes of one character
    assert daemon.post("/detokenize", {})[1] == {"content": ""}


def test_cached_tokens_on_every_completion_answer(daemon):
    prompt = "The river model reads a long shared system prompt before every question. " * 4
    n = len(tokenize(daemon, content=prompt, add_special=True))
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=300)
    name = client.models.list().data[0].id
    first = client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK
    body = {"model": name, "prompt": prompt, "max_tokens": 2, "stream": True}
    body["stream_options"] = {"include_usage": True}
    status, raw, _ = daemon.stream("/v1/completions", body)
    assert status == 200
    events = [e for e in sse_events(raw) if e != "[DONE]"]
    usage = events[-1]["usage"]  # the final chunk: no choices, the usage
    assert events[-1]["choices"] == [] and usage["prompt_tokens"] == n
    assert usage["prompt_tokens_details"] == {"cached_tokens": (n - 1) // BLOCK * BLOCK}
