"""Speculative decoding through the real daemon: same text as without, counted in /metrics."""

from __future__ import annotations

import openai
import pytest

from tests.support import exact_weights
from tests.support.server_fixture import daemon_pair

NAME = "smol"
CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
MESSAGES = [{"role": "user", "content": "Repeat this code exactly:\n" + CODE}]


@pytest.fixture(scope="module")
def daemons():
    common = ("--num-kv-blocks", "128", "--served-model-name", NAME, "--kv-dtype", "fp32")
    common += exact_weights.FLAGS
    yield from daemon_pair(
        (*common, "--speculative", "ngram", "--num-speculative-tokens", "6"),
        (*common, "--speculative", "off"),
    )


def chat(daemon) -> str:
    client = openai.OpenAI(
        base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300
    )
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=32, temperature=0)
    return r.choices[0].message.content, r.usage.completion_tokens


def test_speculative_daemon_answers_as_plain_and_reports_guesses(daemons):
    spec, plain = daemons
    before = spec.metrics()
    text, n = chat(spec)
    after = spec.metrics()
    assert (text, n) == chat(plain)
    proposed = (
        after["hetero_spec_proposed_tokens_total"] - before["hetero_spec_proposed_tokens_total"]
    )
    accepted = (
        after["hetero_spec_accepted_tokens_total"] - before["hetero_spec_accepted_tokens_total"]
    )
    assert 0 < accepted <= proposed
    assert 0 < after["hetero_spec_acceptance_rate"] <= 1
    assert (
        after["hetero_generation_tokens_total"] - before.get("hetero_generation_tokens_total", 0)
        == n
    )
    off = plain.metrics()
    assert off["hetero_spec_proposed_tokens_total"] == 0
