"""Chat templates render as transformers renders them; bad templates and messages are refused."""

from __future__ import annotations

import json
import os
from datetime import datetime

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from hetero.chat_template import CHATML_TEMPLATE, ChatTemplateError, _compile, render_chat
from hetero.tokenizer import Tokenizer
from hetero.tokenizer_metadata import read_tokenizer_metadata

os.environ["HF_HUB_OFFLINE"] = "1"

CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? <b>bold</b> & 'quotes' \"double\" 中文 😀"},
    ],
    [{"role": "user", "content": "  spaces\n\nand newlines\t"}],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <in °C>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

# Templates exercising what real ones use: tools as JSON, namespace, loop controls, strftime.
TEMPLATES = {
    "tools_json": (
        "{% if tools %}Tools: {{ tools | tojson(indent=2) }}\n{% endif %}"
        "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    ),
    "namespace_loopcontrols": (
        "{% set ns = namespace(system='', n=0) %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% set ns.system = m.content %}"
        "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "{% if ns.n > 2 %}{% break %}{% endif %}"
        "<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "SYS={{ ns.system }} N={{ ns.n }} {{ bos_token }}|{{ eos_token }}"
    ),
    "date_and_generation": (
        "{{ bos_token }}Today is {{ strftime_now('%Y') }}.\n"
        "{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    ),
    "chatml": CHATML_TEMPLATE,
}


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_template_matches_transformers(smollm2, hf_smollm2, chat, gen):
    ours = smollm2.apply_chat_template(chat, add_generation_prompt=gen)
    theirs = hf_smollm2.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert ours == theirs
    assert smollm2.encode(ours) == hf_smollm2.encode(theirs, add_special_tokens=False)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
def test_templates_match_transformers_renderer(name, chat):
    kw = {"bos_token": "<s>", "eos_token": "</s>"}
    ours = render_chat(TEMPLATES[name], chat, tools=TOOLS, **kw)
    (theirs,), _ = render_jinja_template(
        [chat], tools=TOOLS, chat_template=TEMPLATES[name], add_generation_prompt=True, **kw
    )
    assert ours == theirs


def test_tojson_is_plain_json():
    out = render_chat(
        "{{ tools | tojson }}|{{ messages | tojson(sort_keys=True) }}", CHATS[1], tools=TOOLS
    )
    tools_json, messages_json = out.split("|", 1)
    assert json.loads(tools_json) == TOOLS and "<in °C>" in tools_json  # no HTML escaping
    assert json.loads(messages_json) == CHATS[1]


def test_helpers_and_extra_variables():
    year = str(datetime.now().year)
    out = render_chat(
        "{{ strftime_now('%Y') }} {{ custom }} {{ dict(a=1) | tojson }}", CHATS[0], custom="x"
    )
    assert out in (f'{year} x {{"a": 1}}', f'{int(year) + 1} x {{"a": 1}}')


def test_raise_exception_becomes_value_error():
    template = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('System first!') }}{% endif %}"
    )
    with pytest.raises(ValueError, match="System first!"):
        render_chat(template, CHATS[0])


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for m in messages %}", "does not compile"),
        ("{{ 1 + 'a' }}", "TypeError"),
        ("{{ messages.append(1) }}", "chat template error"),  # sandbox: no mutation
        ("{% set ns = namespace(_x=1) %}", "not allowed"),
        ("   ", "empty"),
    ],
)
def test_broken_templates_become_clear_errors(template, match):
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(template, CHATS[0])


def test_compiled_templates_are_cached():
    template = "{{ messages[0].content }}-cached"
    render_chat(template, CHATS[0])
    hits = _compile.cache_info().hits
    assert render_chat(template, CHATS[0]) == "Hi!-cached"
    assert _compile.cache_info().hits == hits + 1


def test_content_parts_are_joined_and_tool_calls_kept():
    chat = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
        {"role": "assistant", "reasoning": "hmm", "content": "ok"},
    ]
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content | default('-') }}"
        "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
        "{% if m.reasoning_content %}({{ m.reasoning_content }}){% endif %};{% endfor %}"
    )
    out = render_chat(template, chat, add_generation_prompt=False)
    # a call's null content is "" (templates read it as a string)
    assert out == 'user:a\nb;assistant:[{"function": {"name": "f"}}];assistant:ok(hmm);'


def test_developer_is_system_where_the_template_does_not_name_it():
    chat = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    as_system = [{**chat[0], "role": "system"}, chat[1]]
    assert render_chat(CHATML_TEMPLATE, chat) == render_chat(CHATML_TEMPLATE, as_system)
    knows = "{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m.content }};"
    assert render_chat(knows + "{% endfor %}", chat) == "D:Be terse.;hi;"


def test_tool_calls_the_template_cannot_render_are_refused():
    chat = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
        {"role": "tool", "content": "sunny"},
    ]
    with pytest.raises(
        ChatTemplateError, match=r"messages\[1\] \(assistant\) carries 'tool_calls'"
    ):
        render_chat(CHATML_TEMPLATE, chat)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "messages must be a list"),
        ([], "at least one message"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\] needs a non-empty string 'role'"),
        ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\] \(user\) has no"),
        ([{"role": "user", "content": None}], "null 'content'"),
        ([{"role": "user", "content": 5}], "must be a string or a list of text parts, not int"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            r"content part 0 must be \{'type': 'text'.*got 'image_url'",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "part 0 has no string 'text'"),
    ],
)
def test_bad_messages_are_refused(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(CHATML_TEMPLATE, messages)


def test_tokenizer_template_choice(smollm2_path):
    meta = read_tokenizer_metadata(smollm2_path)
    meta.pop("tokenizer.chat_template")
    chatml = Tokenizer({**meta, "tokenizer.chat_template.tool_use": "TOOLS {{ tools | length }}"})
    assert chatml.chat_template is None
    assert chatml.apply_chat_template(CHATS[0]) == "<|im_start|>user\nHi!<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    assert chatml.apply_chat_template(CHATS[0], tools=TOOLS) == "TOOLS 1"
    assert chatml.apply_chat_template(CHATS[0], chat_template="{{ bos_token }}") == "<|im_start|>"
    tokens = ["<|im_begin|>" if t == "<|im_start|>" else t for t in meta["tokenizer.ggml.tokens"]]
    bare = Tokenizer({**meta, "tokenizer.ggml.tokens": tokens})
    with pytest.raises(ValueError, match="has no chat template"):
        bare.apply_chat_template(CHATS[0])
