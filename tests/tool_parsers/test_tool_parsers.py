"""The tool-call parsers and the reasoning splitter on exact model text.

Each case is the text a model of that family writes (the markers as its template teaches them)
and the message it must become: content, reasoning, and calls with their JSON arguments. Every
case runs whole (the non-streaming answer), one character at a time and in random pieces (the
streamed answer): the pieces must join to the same message, calls must announce id and name
before any argument text, and no piece of content may hold part of a marker.
"""

from __future__ import annotations

import json
import random

import pytest

from hetero.chat_output import ChatFormat
from hetero.reasoning import ThinkSplitter, prompt_opens_thinking
from hetero.tool_parsers import FORMATS, Delta, detect_format
from hetero.tool_parsers.stream import JsonScan, call_head

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]
WEATHER = {"city": "Paris", "days": 3}

# (id, format, thinks, text, content, reasoning, [(name, arguments as a JSON value)])
CASES = [
    ("hermes-one", "hermes", False,
     'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}\n</tool_call>', "Let me check.", "", [("get_weather", WEATHER)]),
    ("hermes-two", "hermes", False,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "", "", [("get_weather", WEATHER), ("get_time", {})]),
    ("hermes-braces-in-strings", "hermes", False,
     '<tool_call>{"name": "get_weather", "arguments": {"city": "}{\\"</tool_call>"}}'
     "</tool_call>", "", "", [("get_weather", {"city": '}{"</tool_call>'})]),
    ("hermes-arguments-first", "hermes", False,
     '<tool_call>\n{"arguments": {"city": "Paris", "days": 3}, "name": "get_weather"}\n'
     "</tool_call>", "", "", [("get_weather", WEATHER)]),
    ("hermes-not-json", "hermes", False, "a <tool_call> tag in prose, b", "a <tool_call> tag in "
     "prose, b", "", []),
    ("hermes-plain", "hermes", False, "No tools needed: 2 + 2 = 4.\n", "No tools needed: 2 + 2 = "
     "4.\n", "", []),
    ("qwen3-think-then-call", "hermes", True,
     '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Paris", "days": 3}}\n</tool_call>', "", "The user wants weather.",
     [("get_weather", WEATHER)]),
    ("qwen3-think-answer", "hermes", True, "<think>\nhmm <tool_call> maybe\n</think>\n\nHello!",
     "Hello!", "hmm <tool_call> maybe", []),
    ("qwen3-no-think", "hermes", True, "Hello <think> is a tag", "Hello <think> is a tag", "", []),
    ("qwen3-coder", "qwen3_coder", False,
     "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
     "<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>", "I will look.", "",
     [("get_weather", {"city": "Paris", "days": 3, "metric": True, "hours": [1, 2]})]),
    ("qwen3-coder-multiline-string", "qwen3_coder", False,
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nline 1\n  line 2\n</parameter>\n"
     "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "", "", [("get_weather", {"city": "line 1\n  line 2"}), ("get_time", {})]),
    ("llama3", "llama3_json", False,
     '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "", "",
     [("get_weather", WEATHER)]),
    ("llama3-python-tag", "llama3_json", False,
     '<|python_tag|>{"type": "function", "name": "get_weather", "parameters": {"city": "Paris",'
     ' "days": 3}}', "", "", [("get_weather", WEATHER)]),
    ("llama3-two", "llama3_json", False,
     '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
     '{"city": "Paris", "days": 3}}', "", "", [("get_time", {}), ("get_weather", WEATHER)]),
    ("llama3-json-answer", "llama3_json", False, '{"answer": 4}', '{"answer": 4}', "", []),
    ("llama3-prose", "llama3_json", False, 'Sure: {"name": "x", "parameters": {}}',
     'Sure: {"name": "x", "parameters": {}}', "", []),
    ("mistral-array", "mistral", False,
     'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
     '{"name": "get_time", "arguments": {}}]', "Checking.", "",
     [("get_weather", WEATHER), ("get_time", {})]),
    ("mistral-v11", "mistral", False,
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time'
     "[CALL_ID]a1b2c3d4e[ARGS]{}", "", "", [("get_weather", WEATHER), ("get_time", {})]),
    ("harmony-call", "harmony", False,
     "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
     'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", '
     '"days": 3}', "", "Need the weather.", [("get_weather", WEATHER)]),
    ("harmony-recipient-first", "harmony", False,
     ' to=functions.get_time<|channel|>commentary json<|message|>{}', "", "",
     [("get_time", {})]),
    ("harmony-final", "harmony", False,
     "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
     "It is 4.", "It is 4.", "Easy.", []),
]  # fmt: skip


def run(fmt_name: str, thinks: bool, pieces: list[str]) -> tuple[Delta, list[Delta], object]:
    out = ChatFormat(FORMATS[fmt_name], TOOLS, thinks=thinks).new_output()
    deltas = [out.feed(p) for p in pieces] + [out.finish()]
    total = Delta()
    for d in deltas:
        total.add(d)
    return total, deltas, out


def splits(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [[text], list(text), pieces]


@pytest.mark.parametrize(
    "fmt, thinks, text, content, reasoning, calls",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_whole_and_streamed_text_give_the_same_message(
    fmt, thinks, text, content, reasoning, calls
):
    for seed, pieces in enumerate(splits(text, 0)):
        total, deltas, out = run(fmt, thinks, pieces)
        assert total.content == out.content == content, (seed, total)
        assert total.reasoning == out.reasoning == reasoning
        got = [(c.name, json.loads(c.arguments)) for c in out.calls]
        assert got == calls
        assert len({c.id for c in out.calls}) == len(calls)
        seen: set[int] = set()
        for d in deltas:
            for c in d.calls:
                if c.index not in seen:  # a call's first piece names it
                    assert c.id == out.calls[c.index].id and c.name == calls[c.index][0]
                    seen.add(c.index)
                else:
                    assert c.id is None and c.name is None
        joined = {i: "".join(c.arguments for d in deltas for c in d.calls if c.index == i)
                  for i in seen}  # fmt: skip
        assert joined == {i: c.arguments for i, c in enumerate(out.calls)}


def test_no_content_piece_holds_part_of_a_marker():
    text = 'Hi <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    _, deltas, _ = run("hermes", False, list(text))
    assert "".join(d.content for d in deltas) == "Hi"
    assert all("<" not in d.content for d in deltas)


def test_parallel_calls_off_keeps_the_first():
    text = (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    )
    out = ChatFormat(FORMATS["hermes"], TOOLS, parallel=False).new_output()
    out.feed(text)
    out.finish()
    assert [c.name for c in out.calls] == ["get_time"]


def test_mistral_ids_are_nine_letters_and_digits():
    out = ChatFormat(FORMATS["mistral"], TOOLS).new_output()
    out.feed('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]')
    out.finish()
    (call,) = out.calls
    assert len(call.id) == 9 and call.id.isalnum()


def test_reasoning_cut_by_the_length_limit_stays_reasoning():
    s = ThinkSplitter()
    r1, c1 = s.feed("<think>\nstep one\n")
    r2, c2 = s.finish()
    assert (r1 + r2, c1 + c2) == ("step one\n", "")


def test_a_prompt_that_opens_the_think_block_starts_in_reasoning():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    s = ThinkSplitter(in_reasoning=True)
    r, c = s.feed("plan\n</think>\n\nanswer")
    assert (r, c) == ("plan", "answer")


def test_json_scan_finds_the_end_of_a_value_fed_in_pieces():
    scan = JsonScan()
    assert scan.feed('{"a": "}') is None
    assert scan.feed('\\"", "b": [1, {}]') is None
    assert scan.feed("} tail") == 1
    assert JsonScan().feed("12, x") == 2


def test_call_head_reads_name_then_arguments():
    head = call_head('{"name": "f", "arguments": {"x"')
    assert (head.state, head.name) == ("ready", "f")
    assert call_head('{"name": "f').state == "more"
    assert call_head('{"arguments": {}').state == "whole"
    assert call_head('{"answer": 1}', strict=True).state == "fail"
    assert call_head("plain").state == "fail"


@pytest.mark.parametrize(
    "template, name",
    [
        ("{{ '<tool_call>' }}{% for t in tools %}{% endfor %}", "hermes"),
        ("<tool_call>\n<function={{ name }}>\n<parameter=x>", "qwen3_coder"),
        ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", "mistral"),
        ('<|start_header_id|>ipython<|end_header_id|>"parameters"', "llama3_json"),
        ("<|start|>{{ m }}<|channel|>final<|message|>", "harmony"),
        ("{% if tools %}{{ tools | tojson }}{% endif %}", "hermes"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "generic"),
    ],
)
def test_the_format_is_read_from_the_template(template, name):
    assert detect_format(template).name == name
