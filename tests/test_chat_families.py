"""Real families' chat templates with tools: hetero's prompt is HF transformers' prompt, byte for
byte, and the tool-call format the server reads is the family's.

Each family is a `hetero synth --chat FAMILY` file (random weights, the real template, the
family's special tokens). transformers reads the same file with its own GGUF reader
(`AutoTokenizer.from_pretrained(..., gguf_file=...)`: its own template and BOS/EOS) and renders
with `apply_chat_template(messages, tools=...)`; hetero renders through the server's path
(`chat_prompt`: the OpenAI-shaped request, arguments as the JSON strings clients send).
"""

from __future__ import annotations

import copy
import json

import pytest

from hetero.server.chat_request import ChatInput, chat_prompt
from hetero.synth import write_synthetic
from hetero.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

FAMILIES = {  # family -> (synth shape, the tool format the server picks)
    "qwen2.5": ("tiny-qwen2", "hermes"),
    "qwen3": ("tiny-qwen3", "hermes"),
    "llama3.1": ("tiny-llama", "llama3_json"),
    "mistral-nemo": ("tiny-llama", "mistral"),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city's name"},
                    "unit": {"type": "string", "enum": ["C", "F"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                      "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip
ARGUMENTS = '{"city": "Paris", "unit": "C"}'  # as OpenAI clients send them: a JSON string
CALL = {"id": "call00001", "type": "function",
        "function": {"name": "get_weather", "arguments": ARGUMENTS}}  # fmt: skip
CONVERSATIONS = {
    "tools-offered": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ],
    "round-trip": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call00001", "content": '{"temp": 21}'},
    ],
    "after-the-answer": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "And the time?"},
    ],
}


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for family, (shape, _) in FAMILIES.items():
        write_synthetic(root / f"{family}.gguf", shape, "q8_0", progress=False, chat=family)
    return root


def hf_messages(messages: list[dict]) -> list[dict]:
    """What the server hands templates, as vLLM and llama.cpp do: call arguments as objects, a
    call's null content as "" (Qwen3's template cannot read None)."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("tool_calls") and m["content"] is None:
            m["content"] = ""
        for call in m.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_equals_transformers(family_files, family, conversation):
    path = family_files / f"{family}.gguf"
    ours = Tokenizer.from_gguf(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(family_files), gguf_file=path.name)
    messages = CONVERSATIONS[conversation]
    prompt = chat_prompt(ours, ChatInput(copy.deepcopy(messages), TOOLS, "auto"))
    want = hf.apply_chat_template(
        hf_messages(messages), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert prompt.text == want
    assert prompt.format.tool_format.name == FAMILIES[family][1]
    assert "get_weather" in prompt.text  # the tools reach the model


def test_qwen3_thinking_switch_and_reasoning_history(family_files):
    path = family_files / "qwen3.gguf"
    ours = Tokenizer.from_gguf(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(family_files), gguf_file=path.name)
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "3+3?"},
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        prompt = chat_prompt(ours, ChatInput(copy.deepcopy(messages), template_kwargs=kwargs))
        want = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert prompt.text == want
        assert prompt.format.thinks  # Qwen3's answers are read for <think> reasoning
        assert prompt.format.in_reasoning is False


def test_family_markers_are_single_tokens_of_the_right_kind(family_files):
    qwen = Tokenizer.from_gguf(family_files / "qwen3.gguf")
    for tag in ("<tool_call>", "</tool_call>", "<think>", "</think>"):
        (i,) = qwen.encode(tag)
        assert not qwen.is_special(i)  # user-defined: decoded as text, as Qwen's files have it
    mistral = Tokenizer.from_gguf(family_files / "mistral-nemo.gguf")
    (i,) = mistral.encode("[TOOL_CALLS]")
    assert mistral.is_special(i)  # a control token: the server decodes it for the parser
    llama = Tokenizer.from_gguf(family_files / "llama3.1.gguf")
    assert llama.eos_id == llama.encode("<|eot_id|>")[0]
    assert llama.eos_id in llama.eos_ids and llama.encode("<|eom_id|>")[0] in llama.eos_ids
