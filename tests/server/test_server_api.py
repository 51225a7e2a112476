"""The daemon through the official `openai` client (sync and async, streaming and not).

One daemon (the default model, SmolLM2-135M) serves the whole module; an offline engine with the
same settings in this process is the reference for logprobs; the model's own tokenizer, built
here from the GGUF file, gives the exact usage counts.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid

import openai
import pytest

from hetero.llm import LLM
from hetero.sampling import SamplingParams
from hetero.tokenizer import Tokenizer
from tests.support import exact_weights
from tests.support.server_fixture import start_daemon

NAME = "smol"
BLOCK = 16  # the daemon's default block size: prefix hits come in whole blocks


@pytest.fixture(scope="module")
def daemon():
    # fp32 KV and fp16 weights on both sides: fp8 KV or int8 activations (qdot, the CPU default)
    # turn the last-bit differences of other batch shapes (a prefix hit computes fewer tokens)
    # into logprob differences of ~5e-3 to 1e-2 (BENCHMARKS.md)
    d = start_daemon(
        "--num-kv-blocks",
        "256",
        "--served-model-name",
        NAME,
        "--threads",
        "1",
        "--kv-dtype",
        "fp32",
        *exact_weights.FLAGS,
    )
    yield d
    assert d.finish() == 0, d.log()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def offline(smollm2_path, daemon):  # after the daemon: the two loads do not compete
    return LLM(
        str(smollm2_path), num_kv_blocks=256, threads=1, kv_dtype="fp32",
        weights=exact_weights.WEIGHTS,
    )  # fmt: skip


def fresh_messages(question: str) -> list[dict]:
    """A system message no earlier request shared, so the prefix cache starts cold for it."""
    return [
        {"role": "system", "content": f"Session {uuid.uuid4().hex[:8]}. Answer briefly."},
        {"role": "user", "content": question},
    ]


def collect_chat_stream(stream) -> tuple[str, str | None, object, list]:
    text, finish, usage, logprobs, roles = "", None, None, [], []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            if choice.logprobs is not None:
                logprobs += choice.logprobs.content
    assert roles[0] == "assistant"
    return text, finish, usage, logprobs


def test_health_and_models(daemon, client):
    status, _, body = daemon.request("GET", "/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].max_model_len == 8192


def test_chat_stream_equals_non_stream_and_usage_is_exact(client, tokenizer):
    messages = fresh_messages("Name three colours.")
    full = client.chat.completions.create(
        model=NAME, messages=messages, temperature=0, max_tokens=12
    )
    stream = client.chat.completions.create(
        model=NAME,
        messages=messages,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, _ = collect_chat_stream(stream)
    assert text == full.choices[0].message.content and text
    assert finish == full.choices[0].finish_reason
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    out_ids = tokenizer.encode(text)
    assert full.usage.prompt_tokens == usage.prompt_tokens == len(prompt)
    assert full.usage.completion_tokens == usage.completion_tokens
    if finish == "length":
        assert usage.completion_tokens == 12
    assert len(out_ids) <= usage.completion_tokens
    assert full.usage.total_tokens == len(prompt) + full.usage.completion_tokens
    # The first request saw a cold cache; the second reuses every full block but the last
    # token's (at least one prompt token is computed to get the next token's logits).
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK


def test_async_client_concurrent_streams_equal_their_single_runs(daemon):
    questions = ["What is 2+2?", "Say hello in French.", "Name a fruit.", "What is a cat?"]
    conversations = [fresh_messages(q) for q in questions]

    async def main():
        aclient = openai.AsyncOpenAI(
            base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300
        )

        async def streamed(messages):
            stream = await aclient.chat.completions.create(
                model=NAME, messages=messages, temperature=0, max_tokens=8, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        together = await asyncio.gather(*(streamed(m) for m in conversations))
        alone = []
        for m in conversations:
            r = await aclient.chat.completions.create(
                model=NAME, messages=m, temperature=0, max_tokens=8
            )
            alone.append(r.choices[0].message.content)
        await aclient.close()
        return together, alone

    together, alone = asyncio.run(main())
    assert together == alone
    assert all(together)


def test_chat_logprobs_match_the_offline_engine(client, offline):
    messages = fresh_messages("Write one word.")
    resp = client.chat.completions.create(
        model=NAME, messages=messages, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    tok = offline.tokenizer
    got = resp.choices[0].logprobs.content
    want = ref.outputs[0].logprobs
    assert [bytes(e.bytes) for e in got] == [tok.token_bytes(t.token_id) for t in want]
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-3)
        assert [bytes(t.bytes) for t in g.top_logprobs] == [tok.token_bytes(i) for i, _ in w.top]
        assert [t.logprob for t in g.top_logprobs] == pytest.approx([x for _, x in w.top], abs=1e-3)
    stream = client.chat.completions.create(
        model=NAME,
        messages=messages,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    _, _, _, streamed = collect_chat_stream(stream)
    assert [e.token for e in streamed] == [e.token for e in got]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in got], abs=1e-3)


def test_completion_logprobs_match_the_offline_engine(client, offline):
    prompt = "def fibonacci(n):"
    resp = client.completions.create(
        model=NAME, prompt=prompt, temperature=0, max_tokens=5, logprobs=2
    )
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0]
    out = ref.outputs[0]
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text == out.text
    tok = offline.tokenizer
    assert lp.tokens == [
        tok.token_bytes(t.token_id).decode("utf-8", "replace") for t in out.logprobs
    ]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in out.logprobs], abs=1e-3)
    texts = [
        {tok.token_bytes(i).decode("utf-8", "replace") for i, _ in t.top} for t in out.logprobs
    ]
    assert [set(d) for d in lp.top_logprobs] == texts
    assert lp.text_offset[0] == 0
    assert lp.text_offset[1:] == [
        lp.text_offset[i] + len(lp.tokens[i]) for i in range(len(lp.tokens) - 1)
    ]


def test_logprobs_stop_with_the_text_a_stop_string_cuts(client):
    """The token that completes a stop string shows no text, so it gets no logprob entry:
    the entries cover exactly the returned text, streamed or not."""
    kw = dict(model=NAME, prompt="List: a, b, c,", temperature=0, max_tokens=12, logprobs=1)
    full = client.completions.create(**kw).choices[0]
    tokens, offsets = full.logprobs.tokens, full.logprobs.text_offset
    # a later token whose text first occurs in the output where that token starts
    j = next(i for i in range(2, len(tokens)) if full.text.find(tokens[i]) == offsets[i])
    cut = client.completions.create(**kw, stop=[tokens[j]]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: offsets[j]]
    assert cut.logprobs.tokens == tokens[:j] and "".join(cut.logprobs.tokens) == cut.text
    streamed = []
    for chunk in client.completions.create(**kw, stop=[tokens[j]], stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.tokens
    assert streamed == tokens[:j]


def test_top_p_zero_is_greedy(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    kw = dict(model=NAME, messages=messages, max_tokens=8)
    greedy = client.chat.completions.create(**kw, temperature=0)
    nucleus = client.chat.completions.create(**kw, temperature=1.5, top_p=0, seed=3)
    assert nucleus.choices[0].message.content == greedy.choices[0].message.content


def test_completion_prompt_shapes_n_and_echo(client, tokenizer):
    text = "The capital of France is"
    ids = tokenizer.encode(text)
    resp = client.completions.create(
        model=NAME, prompt=[text, ids], max_tokens=5, temperature=0, n=2
    )
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2, 3]
    assert len({c.text for c in choices}) == 1  # greedy: every choice of both prompts agrees
    assert resp.usage.prompt_tokens == 2 * len(ids)
    if all(c.finish_reason == "length" for c in choices):
        assert resp.usage.completion_tokens == 4 * 5
    echo = client.completions.create(
        model=NAME, prompt=text, max_tokens=5, temperature=0, echo=True
    )
    assert echo.choices[0].text == text + choices[0].text
    stream = client.completions.create(
        model=NAME,
        prompt=text,
        max_tokens=5,
        temperature=0,
        echo=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echo.choices[0].text
    assert chunks[-1].usage.completion_tokens == echo.usage.completion_tokens


def test_stop_strings_end_the_text_before_them(client):
    prompt = "List the days of the week: Monday, Tuesday,"
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    text = full.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = text[: text.index(stop)]
    resp = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=10, temperature=0, stop=[stop]
    )
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (cut, "stop")
    stream = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=10, temperature=0, stop=stop, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == cut
    assert chunks[-1].finish_reason == "stop"


def test_seeded_choices_are_reproducible_and_distinct(client):
    messages = [{"role": "user", "content": "Tell me a word."}]

    def sample():
        r = client.chat.completions.create(
            model=NAME, messages=messages, n=3, temperature=1.0, seed=1234, max_tokens=6
        )
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample()
    assert sample() == first
    assert len(set(first)) > 1


def test_penalties_and_json_mode_are_accepted(client):
    messages = [{"role": "user", "content": "Reply in JSON with a key 'a'."}]
    r = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_completion_tokens=4,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        top_p=0.9,
        response_format={"type": "json_object"},
    )
    assert r.usage.completion_tokens <= 4
    with pytest.raises(openai.BadRequestError, match="json"):
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            response_format={"type": "json_object"},
        )


def test_client_disconnect_frees_kv_blocks_at_once(daemon):
    before = daemon.metrics()
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 500, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", daemon.port)) as s:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        s.sendall(head.encode() + body)
        data = b""
        while data.count(b"data: ") < 3:
            data += s.recv(65536)
        assert daemon.metrics()['hetero_kv_blocks_used{tier="cpu"}'] > 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = daemon.metrics()
        if m['hetero_kv_blocks_used{tier="cpu"}'] == 0 and m["hetero_num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert m['hetero_kv_blocks_used{tier="cpu"}'] == 0
    assert m["hetero_num_requests_running"] == m["hetero_num_requests_waiting"] == 0
    key = 'hetero_request_finished_total{finish_reason="cancelled"}'
    assert m[key] == before.get(key, 0) + 1


def test_metrics_count_one_request_exactly(daemon, client):
    before = daemon.metrics()
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0)
    after = daemon.metrics()

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    n = r.usage.completion_tokens
    assert delta("hetero_generation_tokens_total") == n
    assert delta("hetero_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("hetero_time_to_first_token_seconds_count") == 1
    assert delta("hetero_inter_token_latency_seconds_count") == n - 1
    assert delta("hetero_e2e_request_latency_seconds_count") == 1
    assert delta('hetero_http_requests_total{endpoint="/v1/completions",code="200"}') == 1
    assert delta("hetero_prefix_cache_queries_total") == r.usage.prompt_tokens
    assert after['hetero_kv_blocks_used{tier="cpu"}'] == 0
    assert after["hetero_prefix_cache_hits_total"] > 0  # the repeated prompts above hit
    assert 0 < after["hetero_prefix_cache_hit_rate"] < 1
