"""Structured outputs' token masks on the default model's vocabulary (49,152 byte-level BPE
tokens), through the engine's `Constraints`: random walks that take any token a mask allows end
in text that the `jsonschema` package (an independent validator) accepts, a valid answer's own
tokens are allowed at every step, and the packed bits mean what the sampler reads."""

from __future__ import annotations

import json
import random
import re
import sys

import jsonschema
import pytest
import torch

from hetero.engine.grammar_mask import Constraints
from hetero.sampling import SamplingParams
from hetero.sampling_filters import unpack_allowed
from hetero.structured_outputs import StructuredOutputsParams, json_rule, lark_string

WIDER = 7  # the logits may be wider than the vocabulary: those rows are never allowed
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {
            "type": "array",
            "items": {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": 5}},
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 10}},
    "required": ["zone"],
    "additionalProperties": False,
}


def tool_call_grammar(tools: dict[str, dict], parallel: bool) -> str:
    """The module docstring's Hermes-format example, as the tool-calling code would write it."""

    def call(name: str, params: dict) -> str:
        return json_rule(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )

    names = " | ".join(f"fn_{n}" for n in tools)
    rules = "\n".join(f"fn_{n}: {call(n, p)}" for n, p in tools.items())
    more = ' ("\\n" tool_call)*' if parallel else ""
    open_, close = lark_string("<tool_call>\n"), lark_string("\n</tool_call>")
    return f"start: tool_call{more}\ntool_call: {open_} ({names}) {close}\n{rules}\n"


@pytest.fixture(scope="module")
def constraints(smollm2):
    c = Constraints(smollm2, smollm2.vocab_size + WIDER)
    c.prepare()
    return c


def allowed_ids(constraints: Constraints, rid: str) -> torch.Tensor:
    bits = constraints.masks([rid])
    return unpack_allowed(bits, constraints.width)[0].nonzero().flatten()


def walk(
    constraints, tok, so: StructuredOutputsParams, seed: int, limit: int = 400, eos: bool = False
) -> str:
    """Take random allowed tokens until the grammar ends (asserting it does within `limit`).
    `eos`: the grammar may end or go on, so an end token may come (not part of the text)."""
    rng, rid = random.Random(seed), f"walk-{seed}"
    constraints.add(rid, SamplingParams(structured_outputs=so, max_tokens=limit))
    ids: list[int] = []
    try:
        for _ in range(limit):
            choices = allowed_ids(constraints, rid).tolist()
            assert choices and all(c < tok.vocab_size for c in choices)
            # prefer short tokens and closing ones now and then, so walks end within the limit
            t = rng.choice(choices if rng.random() < 0.5 else choices[:64])
            if t in tok.eos_ids:
                assert eos, "a grammar that cannot go on stops before an end token is needed"
                assert constraints.accept(rid, t)
                return tok.decode(ids)
            ids.append(t)
            if constraints.accept(rid, t):
                return tok.decode(ids)
        raise AssertionError(f"no end within {limit} tokens: {tok.decode(ids)!r}")
    finally:
        constraints.drop(rid)


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_satisfy_the_schema(constraints, smollm2, seed):
    text = walk(constraints, smollm2, StructuredOutputsParams(json=PERSON), seed)
    jsonschema.validate(json.loads(text), PERSON)


def test_a_valid_answer_is_allowed_token_by_token(constraints, smollm2):
    value = {
        "name": "Ada é",
        "age": 36,
        "role": "admin",
        "scores": [[1.5, -2], []],
        "address": {"city": "Paris", "zip": "75001"},
        "ok": True,
    }
    for text in (json.dumps(value), json.dumps(value, indent=2, ensure_ascii=False)):
        constraints.add(
            "v", SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON))
        )
        ids = smollm2.encode(text)
        for k, t in enumerate(ids):
            assert t in allowed_ids(constraints, "v"), (k, smollm2.decode(ids[: k + 1]))
            ended = constraints.accept("v", t)
            assert ended == (k == len(ids) - 1)  # ends exactly on the closing brace
        constraints.drop("v")


def test_the_schema_refuses_what_it_rules_out(constraints, smollm2):
    so = StructuredOutputsParams(json=PERSON)
    for bad in ('{"name": "A"', '{"age"', '{"name": "Ada", "age": 121', '{"name": "Ada", "extra'):
        constraints.add("b", SamplingParams(structured_outputs=so))
        ids = smollm2.encode(bad)
        ok = True
        for t in ids:
            if t not in allowed_ids(constraints, "b"):
                ok = False
                break
            constraints.accept("b", t)
        constraints.drop("b")
        assert not ok, bad


def test_packed_rows_and_free_rows(constraints, smollm2):
    so = StructuredOutputsParams(json_object=True)
    constraints.add("a", SamplingParams(structured_outputs=so))
    constraints.add("b", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+")))
    bits = constraints.masks(["a", "free", "b"])
    assert bits.shape == (3, -(-constraints.width // 32)) and bits.dtype == torch.int32
    rows = unpack_allowed(bits, constraints.width)
    assert rows[1].all()  # an unconstrained row beside them is free
    opens = {smollm2.decode([int(t)]).strip() for t in rows[0].nonzero()}
    assert opens and all(s.startswith("{") for s in opens), sorted(opens)[:5]
    digits = [smollm2.decode([int(t)]) for t in rows[2].nonzero()]
    assert digits and all(re.fullmatch("[0-9]+", d) for d in digits)
    assert not rows[[0, 2], smollm2.vocab_size :].any()  # rows past the vocabulary
    assert not rows[[0, 2]][:, sorted(smollm2.special_ids)].any()  # control tokens are not text
    assert constraints.masks(["free"]) is None
    for rid in ("a", "b"):
        constraints.drop(rid)
    assert constraints.masks(["a"]) is None


def test_end_tokens_are_allowed_exactly_where_the_grammar_may_end(constraints, smollm2):
    constraints.add("r", SamplingParams(structured_outputs=StructuredOutputsParams(regex="ab+")))
    eos = sorted(smollm2.eos_ids)
    for t in smollm2.encode("ab"):
        assert not set(eos) & set(allowed_ids(constraints, "r").tolist())
        assert not constraints.accept("r", t)  # "ab" may go on: "abb"
    assert set(eos) <= set(allowed_ids(constraints, "r").tolist())
    assert constraints.accept("r", eos[0])  # an end token ends it
    constraints.drop("r")


@pytest.mark.parametrize("seed", range(4))
def test_tool_call_grammar(constraints, smollm2, seed):
    tools = {"get_weather": WEATHER, "get_time": CLOCK}
    grammar = tool_call_grammar(tools, parallel=seed % 2 == 1)
    so = StructuredOutputsParams(grammar=grammar)
    so.check()
    text = walk(constraints, smollm2, so, seed, limit=600, eos=seed % 2 == 1)
    calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
    assert calls and "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls) == text
    for c in calls:
        call = json.loads(c)
        assert list(call) == ["name", "arguments"]
        jsonschema.validate(call["arguments"], tools[call["name"]])


def test_choice_and_bad_grammars(constraints, smollm2):
    text = walk(constraints, smollm2, StructuredOutputsParams(choice=["yes", "no", "maybe"]), 1)
    assert text in ("yes", "no", "maybe")
    for bad in (
        StructuredOutputsParams(grammar="start: nowhere"),
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
        StructuredOutputsParams(regex="(unclosed"),
    ):
        with pytest.raises(ValueError, match="invalid structured output"):
            bad.check()
        with pytest.raises(ValueError, match="invalid structured output"):
            constraints.add("bad", SamplingParams(structured_outputs=bad))
        assert not constraints.has("bad")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def test_logits_narrower_than_the_vocabulary(smollm2):
    narrow = Constraints(smollm2, smollm2.vocab_size - 40)
    narrow.add("n", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+")))
    bits = narrow.masks(["n"])
    assert bits.shape == (1, -(-narrow.width // 32))
    allowed = unpack_allowed(bits, narrow.width)[0].nonzero().flatten().tolist()
    assert allowed and all(re.fullmatch("[a-z]+", smollm2.decode([t])) for t in allowed)


def test_without_llguidance_only_constrained_requests_are_refused(smollm2, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # what an install without it imports
    c = Constraints(smollm2, smollm2.vocab_size)
    c.warm()  # an engine still starts
    assert "need the llguidance package" in caplog.text
    c.add("free", SamplingParams())
    assert c.masks(["free"]) is None
    so = StructuredOutputsParams(json_object=True)
    with pytest.raises(ValueError, match="pip install llguidance"):
        c.add("json", SamplingParams(structured_outputs=so))
    with pytest.raises(ValueError, match="pip install llguidance"):
        so.check()
