"""Forced tool calls' grammars (tool_grammars.py) on real vocabularies, through the engine's masks.

Every path through a format's grammar is a valid call: random walks that take any token the mask
allows (what a random-weight model does under the constraint) end where the grammar ends, and
the format's own parser reads the text as calls of the allowed functions only, with no content,
whose arguments the `jsonschema` package validates against the function's `parameters`. And the
grammar does not get in a trained model's way: the text a family's template writes for a past
call (what the model learned to write) is allowed token by token.

Vocabularies: SmolLM2's (the generic format; its ChatML template knows no tools), and `hetero
synth --chat` files of Qwen2.5, Qwen3, Llama 3.1 and Mistral Nemo, whose markers are single
tokens of the families' kinds (`<tool_call>` text, `[TOOL_CALLS]` a control token). Qwen3-Coder's
XML and gpt-oss's Harmony are walked on Qwen2.5's vocabulary (their markers spelled in text).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from hetero.chat_output import ChatFormat
from hetero.engine.grammar_mask import Constraints
from hetero.sampling import SamplingParams
from hetero.sampling_filters import unpack_allowed
from hetero.server.chat_request import ChatInput, chat_prompt
from hetero.structured_outputs import StructuredOutputsParams
from hetero.synth import write_synthetic
from hetero.tokenizer import Tokenizer
from hetero.tool_grammars import forced_call, forced_call_grammar
from hetero.tool_parsers import FORMATS

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"type": "string", "enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
PLOT = {  # as pydantic writes a nested model: a reference into $defs
    "$defs": {
        "Point": {
            "type": "object",
            "properties": {"x": {"type": "number", "minimum": 0, "maximum": 9},
                           "y": {"type": "boolean"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {"at": {"$ref": "#/$defs/Point"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["at"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: {} only
    {"type": "function", "function": {"name": "plot.point", "parameters": PLOT}},
]
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": NO_PARAMETERS, "plot.point": PLOT}
SYNTH = {"qwen2.5": "tiny-qwen2", "qwen3": "tiny-qwen3", "llama3.1": "tiny-llama",
         "mistral-nemo": "tiny-llama"}  # fmt: skip
# (case, vocabulary, format, template the format reads, reasoning)
CASES = [
    ("generic", "smollm2", "generic", "", None),
    ("hermes", "qwen2.5", "hermes", "", None),
    ("hermes-may-think", "qwen3", "hermes", "", "may"),
    ("hermes-thinking", "qwen3", "hermes", "", "open"),
    ("llama3", "llama3.1", "llama3_json", "", None),
    ("mistral-array", "mistral-nemo", "mistral", "", None),
    ("mistral-args", "mistral-nemo", "mistral", "[ARGS]", None),
    ("qwen3-coder", "qwen2.5", "qwen3_coder", "", None),
    ("harmony", "qwen2.5", "harmony", "", None),
]
CHOICES = {
    "required": ("required", True),
    "required-one": ("required", False),
    "named": ({"name": "get_weather"}, True),
}
THINK_CHARS = 40  # reasoning bound in these walks (the server's is tool_grammars.THINK_CHARS)


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("vocabularies")
    out = {"smollm2": smollm2}
    for family, shape in SYNTH.items():
        path = root / f"{family}.gguf"
        write_synthetic(path, shape, "q8_0", progress=False, chat=family)
        out[family] = Tokenizer.from_gguf(path)
    return out


class MaskSets(dict):
    """The engine's Constraints per vocabulary, built on first use (seconds for 151k tokens)."""

    def __init__(self, vocabularies: dict[str, Tokenizer]) -> None:
        super().__init__()
        self.vocabularies = vocabularies

    def __missing__(self, name: str) -> Constraints:
        tok = self.vocabularies[name]
        self[name] = Constraints(tok, tok.vocab_size)
        return self[name]


@pytest.fixture(scope="module")
def constraints(vocabularies):
    return MaskSets(vocabularies)


def allowed(c: Constraints, rid: str) -> list[int]:
    return unpack_allowed(c.masks([rid]), c.width)[0].nonzero().flatten().tolist()


def walk(c: Constraints, tok: Tokenizer, grammar: str, seed: int, limit: int = 800) -> list[int]:
    """Random allowed tokens until the grammar ends (an end token, where one may come, is not
    part of the answer)."""
    rng, rid = random.Random(seed), f"walk-{seed}"
    so = StructuredOutputsParams(grammar=grammar)
    so.check()  # what the server does before queueing the request
    c.add(rid, SamplingParams(structured_outputs=so, max_tokens=limit))
    ids: list[int] = []
    try:
        for _ in range(limit):
            choices = allowed(c, rid)
            # short tokens half the time (the lowest ids are bytes), so walks end in the limit
            t = rng.choice(choices if rng.random() < 0.5 else choices[:64])
            if t in tok.eos_ids:
                assert c.accept(rid, t)
                return ids
            ids.append(t)
            if c.accept(rid, t):
                return ids
        raise AssertionError(f"no end within {limit} tokens: {tok.decode(ids)!r}")
    finally:
        c.drop(rid)


def read(tok: Tokenizer, fmt_name: str, ids: list[int], reasoning: str | None, parallel: bool):
    """The answer as the server reads it (control tokens shown where the format needs them)."""
    fmt = FORMATS[fmt_name]
    text = tok.decode(ids, skip_special=not fmt.special_tokens)
    thinks = reasoning is not None
    chat = ChatFormat(fmt, TOOLS, parallel, thinks=thinks, in_reasoning=reasoning == "open")
    out = chat.new_output()
    out.feed(text)
    out.finish()
    return out, text


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("choice", list(CHOICES))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_path_is_a_valid_call(vocabularies, constraints, case, choice, seed):
    _, vocab, fmt_name, template, reasoning = case
    tool_choice, parallel = CHOICES[choice]
    tok = vocabularies[vocab]
    forced = forced_call(TOOLS, tool_choice, parallel)
    grammar = forced_call_grammar(tok, fmt_name, template, forced, reasoning, THINK_CHARS)
    ids = walk(constraints[vocab], tok, grammar, seed)
    out, text = read(tok, fmt_name, ids, reasoning, parallel)
    assert out.calls and out.content == "", text
    names = [c.name for c in out.calls]
    if choice == "named":
        assert names == ["get_weather"], text
    else:
        assert set(names) <= set(SCHEMAS) and (parallel or len(names) == 1), text
    for call in out.calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert len(out.reasoning) <= THINK_CHARS


def template_answer(tok: Tokenizer, tools: list, call: dict, **kw) -> str:
    """What the template writes for a past call: the assistant turn after the generation prompt,
    without the end-of-turn marker (the grammar ends before it)."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    asked = chat_prompt(tok, ChatInput(ask, tools, "auto", template_kwargs=kw)).text
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    turn = ChatInput(
        [*ask, message], tools, "auto", add_generation_prompt=False, template_kwargs=kw
    )
    whole = chat_prompt(tok, turn).text
    assert whole.startswith(asked)
    answer = whole[len(asked) :].rstrip()
    for end in ("<|im_end|>", "<|eot_id|>", "</s>"):
        answer = answer.removesuffix(end)
    return answer


def refused_at(c: Constraints, tok: Tokenizer, grammar: str, text: str) -> str | None:
    """Feed the tokens of `text` (control tokens parsed) one by one: the text up to the first
    one the mask refuses, or None when all are allowed."""
    so = StructuredOutputsParams(grammar=grammar)
    c.add("trained", SamplingParams(structured_outputs=so))
    try:
        ids = tok.encode(text)
        for k, t in enumerate(ids):
            if t not in allowed(c, "trained"):
                return tok.decode(ids[: k + 1])
            c.accept("trained", t)
        return None
    finally:
        c.drop("trained")


def assert_allowed(c: Constraints, tok: Tokenizer, grammar: str, text: str) -> None:
    """Each token of `text` is allowed in turn, and the grammar ends there (or may)."""
    assert refused_at(c, tok, grammar, text) is None
    so = StructuredOutputsParams(grammar=grammar)
    c.add("whole", SamplingParams(structured_outputs=so))
    try:
        ended = [c.accept("whole", t) for t in tok.encode(text)][-1]
        assert ended or set(allowed(c, "whole")) & set(tok.eos_ids), text
    finally:
        c.drop("whole")


ARGUMENTS = {"city": "Paris", "days": 3}
CALL = {"id": "call00001", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}  # fmt: skip
WRITTEN = {  # formats without a synth family: their calls as the models write them
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "harmony": "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris",'
    ' "days": 3}',
}


@pytest.mark.parametrize("vocab", ["smollm2", "qwen2.5", "qwen3", "llama3.1", "mistral-nemo"])
def test_what_the_template_writes_for_a_call_is_allowed(vocabularies, constraints, vocab):
    tok = vocabularies[vocab]
    kw = {"enable_thinking": False} if vocab == "qwen3" else {}
    answer = template_answer(tok, TOOLS, json.loads(json.dumps(CALL)), **kw)
    prompt = chat_prompt(tok, ChatInput([{"role": "user", "content": "Hi"}], TOOLS, "required",
                                        template_kwargs=kw))  # fmt: skip
    assert "get_weather" in answer and prompt.constraint is not None
    c = constraints[vocab]
    assert_allowed(c, tok, prompt.constraint.grammar, answer)
    # the parser reads it back as the call
    out, _ = read(tok, prompt.format.tool_format.name, tok.encode(answer), None, True)
    assert [(x.name, json.loads(x.arguments)) for x in out.calls] == [("get_weather", ARGUMENTS)]


@pytest.mark.parametrize("fmt_name", list(WRITTEN))
def test_qwen3_coder_and_harmony_calls_as_written_are_allowed(vocabularies, constraints, fmt_name):
    tok = vocabularies["qwen2.5"]
    grammar = forced_call_grammar(tok, fmt_name, "", forced_call(TOOLS, "required", False))
    assert_allowed(constraints["qwen2.5"], tok, grammar,
                   WRITTEN[fmt_name])  # fmt: skip


def test_the_xml_form_keeps_the_schema(vocabularies, constraints):
    """A raw-text value ends at its first closing tag and keeps minLength and maxLength; enums
    are their strings; an unknown or a missing required parameter is refused."""
    tok = vocabularies["qwen2.5"]
    c = constraints["qwen2.5"]
    grammar = forced_call_grammar(tok, "qwen3_coder", "", forced_call(TOOLS, "required", False))
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
    days = "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    assert_allowed(c, tok, grammar, head + "Paris</parameter>\n" + days)  # Qwen's parser's too
    value = head + "Paris\n</parameter>\n"
    for fine, bad in (
        (head + "Pa</parameter", ">x"),  # a value goes on after its closing tag
        (head, "</parameter>"),  # minLength 1
        (head + "Paris is a l", "ong name"),  # maxLength 12
        (value + "<parameter=unit>\n", "K"),  # not in the enum
        (value + "<parameter=", "zone>"),  # no such parameter
        (value, "</function>"),  # days is required
    ):
        assert refused_at(c, tok, grammar, fine) is None
        assert refused_at(c, tok, grammar, fine + bad) is not None, fine + bad


def test_forced_choice_follows_tool_choice():
    assert forced_call(TOOLS, "auto", True) is None and forced_call(TOOLS, "none", True) is None
    assert forced_call(None, "required", True) is None
    named = forced_call(TOOLS, {"name": "plot.point"}, True)
    assert list(named.functions) == ["plot.point"] and not named.several
    required = forced_call(TOOLS, "required", True)
    assert list(required.functions) == list(SCHEMAS) and required.several
    assert required.functions["get_time"] == NO_PARAMETERS
    assert not forced_call(TOOLS, "required", False).several


def test_a_constraint_only_where_a_call_is_forced(vocabularies):
    tok = vocabularies["qwen3"]
    ask = [{"role": "user", "content": "Hi"}]
    assert chat_prompt(tok, ChatInput(ask, TOOLS, "auto")).constraint is None
    thinking = chat_prompt(tok, ChatInput(ask, TOOLS, "required")).constraint.grammar
    direct = chat_prompt(
        tok, ChatInput(ask, TOOLS, "required", template_kwargs={"enable_thinking": False})
    ).constraint.grammar
    assert "think" in thinking and "think" not in direct  # the prompt closed the think block
