"""Overlapped steps (--overlap-schedule on) through the real daemon: the answers of plain steps,
streamed or not, with stop strings and logprobs; concurrent streams and a client that hangs up
mid-stream leave it serving, and /metrics counts what the clients got."""

from __future__ import annotations

import threading

import openai
import pytest

from tests.support import exact_weights
from tests.support.server_fixture import daemon_pair

NAME = "smol"


@pytest.fixture(scope="module")
def daemons():
    common = ("--num-kv-blocks", "128", "--served-model-name", NAME, "--kv-dtype", "fp32")
    common += (*exact_weights.FLAGS, "--speculative", "off")
    yield from daemon_pair(
        (*common, "--overlap-schedule", "on"), (*common, "--overlap-schedule", "off")
    )


def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300)


ASKS = [
    dict(messages=[{"role": "user", "content": "Count from one to ten."}], max_tokens=24,
         temperature=0, logprobs=True, top_logprobs=2),
    dict(messages=[{"role": "user", "content": "Tell me a story about a river."}], max_tokens=20,
         temperature=0.9, seed=7),
    dict(messages=[{"role": "user", "content": "List three colors."}], max_tokens=40,
         temperature=0.7, seed=3, stop=[","]),
]  # fmt: skip


def answer(c: openai.OpenAI, ask: dict, stream: bool):
    if not stream:
        r = c.chat.completions.create(model=NAME, **ask)
        ch = r.choices[0]
        lps = None if ch.logprobs is None else [(t.token, t.logprob) for t in ch.logprobs.content]
        return ch.message.content, ch.finish_reason, r.usage.completion_tokens, lps
    text, finish, n = "", None, None
    for chunk in c.chat.completions.create(
        model=NAME, stream=True, stream_options={"include_usage": True}, **ask
    ):
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish, n, None


@pytest.mark.parametrize("stream", [False, True])
def test_overlapped_daemon_answers_as_plain(daemons, stream):
    over, plain = daemons
    for ask in ASKS:
        got, want = answer(client(over), ask, stream), answer(client(plain), ask, stream)
        assert got[:3] == want[:3]
        if got[3] is not None:
            assert [t for t, _ in got[3]] == [t for t, _ in want[3]]
            assert [lp for _, lp in got[3]] == pytest.approx([lp for _, lp in want[3]], abs=1e-4)
    stopped = answer(client(over), ASKS[2], stream)
    assert stopped[1] == "stop" and "," not in stopped[0]


def test_concurrent_streams_and_a_hang_up(daemons):
    over, _ = daemons
    before = over.metrics()
    results: dict[int, tuple] = {}

    def one(i: int) -> None:
        ask = dict(ASKS[i % 2], max_tokens=12 + i, seed=100 + i, temperature=0.8)
        results[i] = answer(client(over), ask, stream=bool(i % 2))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    # a client that reads two chunks of a long answer and hangs up
    s = client(over).chat.completions.create(
        model=NAME,
        stream=True,
        max_tokens=200,
        temperature=0.8,
        seed=1,
        messages=ASKS[1]["messages"],
    )
    for _, _ in zip(range(2), s):
        pass
    s.close()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == list(range(6))
    for text, finish, n, _ in results.values():
        assert text and finish in ("stop", "length") and n >= 1
    after = over.metrics()
    got = sum(n for _, _, n, _ in results.values())
    delivered = after["hetero_generation_tokens_total"] - before.get(
        "hetero_generation_tokens_total", 0
    )
    assert got <= delivered < got + 200  # the hung-up stream's tokens until it was seen gone
    overlapped = after["hetero_engine_overlapped_steps_total"]
    assert overlapped - before["hetero_engine_overlapped_steps_total"] >= max(
        n for *_, n, _ in results.values()
    )
    assert daemons[1].metrics()["hetero_engine_overlapped_steps_total"] == 0
    assert answer(client(over), ASKS[0], stream=False)[2] == 24  # still serving
