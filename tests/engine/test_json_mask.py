"""Token masks for JSON mode on the default model's vocabulary (49,152 byte-level BPE tokens):
the trie walk and the in-string shortcut equal a brute-force check of every token."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from hetero.engine.json_grammar import (
    DONE,
    ESC_VAL,
    HEX_KEY,
    HEX_VAL,
    INITIAL,
    VALUE,
    JsonLimits,
)
from hetero.engine.json_mask import Constraints, JsonConstraint, JsonVocab


@pytest.fixture(scope="module")
def vocab(smollm2):
    return JsonVocab.from_tokenizer(smollm2, smollm2.vocab_size + 5)  # logits may be wider


def brute_force(vocab: JsonVocab, state) -> np.ndarray:
    m = np.zeros(vocab.width, dtype=np.bool_)
    for i, data in enumerate(vocab.pieces):
        m[i] = bool(data) and vocab.automaton.accepts(state, data) is not None
    return m


def states_of(vocab: JsonVocab, smollm2, text: str) -> list:
    """The states met while reading text's tokens, checking each token is allowed on the way."""
    c, seen = JsonConstraint(vocab), []
    for t in smollm2.encode(text):
        seen.append(c.state)
        assert c.mask()[t], (c.state, smollm2.token_bytes(t))
        c.accept(t)
    assert c.state[0] == DONE
    return seen


def test_masks_equal_brute_force(vocab, smollm2):
    text = (
        json.dumps(
            {"name": 'Ada "L" \\ é', "n": [1, -2.5e3, True, None, {"k": []}], "u": "\u263a"},
            indent=2,
            ensure_ascii=False,
        )
        + "\n"
    )
    states = states_of(vocab, smollm2, text.rstrip())
    escaped = states_of(vocab, smollm2, json.dumps({"é": "\u263a"}))  # \\u escapes
    picks = random.Random(0).sample(states, 10) + escaped[:6] + [INITIAL]
    # the shortcuts: a first byte that opens a string, or ends an escape inside one
    picks += [(VALUE, 0, "{["), (ESC_VAL, 0, "{"), (HEX_VAL, 1, "{"), (HEX_KEY, 1, "{")]
    for s in picks:
        assert (vocab.mask(s) == brute_force(vocab, s)).all(), s


def test_eos_only_when_done(vocab, smollm2):
    eos = sorted(smollm2.eos_ids)
    assert not vocab.mask(INITIAL)[eos].any()
    done = vocab.mask((DONE, 0, ""))
    assert done[eos].all() and done.sum() == len(eos)
    assert not vocab.mask(INITIAL)[smollm2.vocab_size :].any()  # padding columns never


def test_special_tokens_never_allowed(vocab, smollm2):
    special = sorted(smollm2.special_ids)
    for s in (INITIAL, (8, 0, "{"), (4, 0, "{")):
        assert not vocab.mask(s)[special].any()


def test_advance_refuses_a_disallowed_token(vocab, smollm2):
    c = JsonConstraint(vocab)
    with pytest.raises(ValueError, match="cannot continue"):
        c.accept(smollm2.encode("hello")[0])


def test_constraints_batch_rows(smollm2):
    class P:
        json_object = True

    cs = Constraints(smollm2, smollm2.vocab_size)
    assert cs.masks(["a"]) is None  # nothing constrained yet: no mask at all
    cs.add("a", P())
    cs.add("b", object())  # no json_object: unconstrained
    m = cs.masks(["b", "a"])
    assert m.dtype == torch.bool and m.shape == (2, smollm2.vocab_size)
    assert m[0].all() and 0 < int(m[1].sum()) < 1000
    brace = smollm2.encode("{")[0]
    assert not cs.accept("a", brace) and not cs.accept("b", brace)
    assert cs.accept("a", smollm2.encode("}")[0])  # {} is a whole object
    cs.drop("a")
    assert cs.masks(["a", "b"]) is None


def test_tight_limits_still_leave_a_way_on(smollm2):
    v = JsonVocab.from_tokenizer(smollm2, smollm2.vocab_size, JsonLimits(max_ws=1, max_depth=1))
    rng = torch.Generator().manual_seed(0)
    for _ in range(5):  # uniform random allowed tokens until done or 200 tokens
        c = JsonConstraint(v)
        for _ in range(200):
            allowed = np.flatnonzero(c.mask())
            assert len(allowed), c.state
            if c.accept(int(allowed[torch.randint(len(allowed), (1,), generator=rng)])):
                break


def test_sampler_takes_only_allowed_tokens():
    from hetero.sampling import Sampler, SamplingParams, make_batch

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    allowed = torch.rand(4, 50) < 0.2
    allowed[:, 7] = True
    allowed[3] = True  # a free row beside constrained ones
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=1.5, top_p=0.5, top_k=3),
        SamplingParams(temperature=0),
    ]
    state = make_batch(params, [[1]] * 4, [[]] * 4, [0] * 4, "cpu", allowed)
    sampler = Sampler(seed=0)
    for _ in range(30):
        out = sampler(logits, state)
        assert allowed[torch.arange(4), out.token_ids].all()
    masked = logits.masked_fill(~allowed, float("-inf"))
    assert out.token_ids[0] == masked[0].argmax() and out.token_ids[3] == logits[3].argmax()
    # logprobs stay the model's own distribution (vLLM's raw logprobs), not the masked one
    raw = torch.log_softmax(logits[0], -1)[out.token_ids[0]]
    assert torch.allclose(out.logprobs[0], raw)
