"""Tools, tolerance and the Anthropic Messages API against a real daemon, with real clients.

The daemon serves SmolLM2 (whose ChatML template knows no tools: the generic Hermes rewrite puts
them in the system prompt) with an alias; a second serves a `hetero synth --chat qwen3` model
(Qwen3's real template). Neither model calls tools on its own, so these tests check what does not
depend on the model's choice: the requests are taken and rendered (the tools reach the prompt),
the answers have the clients' shapes, bad input gets the clients' error shapes. The parsing of
calls is tested on exact text in test_tool_parsers.py.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from hetero.synth import write_synthetic
from tests.support.server_fixture import sse_events, start_daemon

KEY = "tools-key"
ALIAS = "gpt-4o-mini"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(
        "--api-key", KEY, "--alias", ALIAS, "--threads", "1", "--max-model-len", "2048"
    )
    yield d
    assert d.finish() == 0, d.log()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0)


def test_tools_reach_the_prompt_and_the_answer_has_openai_shape(client):
    plain = client.chat.completions.create(model=ALIAS, messages=ASK, max_tokens=4)
    raw = client.chat.completions.with_raw_response.create(
        model="any-name-at-all", messages=HISTORY, tools=TOOLS, max_tokens=4,
        extra_body={"cache_prompt": True, "verbosity": "low"},
    )  # fmt: skip
    done = raw.parse()
    assert raw.headers["X-Hetero-Ignored-Fields"] == "cache_prompt, verbosity"
    assert plain.model == ALIAS and done.model == "SmolLM2-135M-Instruct.Q4_1"
    # the tool's schema, the call and its result are in the prompt
    assert done.usage.prompt_tokens > plain.usage.prompt_tokens + 60
    choice = done.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)


def test_a_streamed_tools_request_is_reassembled_by_the_client(client):
    state = ChatCompletionStreamState()  # the client's own accumulator of chunks
    kw = {"model": ALIAS, "messages": HISTORY, "tools": TOOLS, "max_tokens": 6, "temperature": 0}
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]
    whole = client.chat.completions.create(**kw).choices[0]
    assert streamed.message.content == whole.message.content  # greedy: the same both ways
    assert streamed.message.content and streamed.finish_reason == whole.finish_reason


def test_paths_without_v1_and_the_alias_are_served(daemon):
    head = {"Authorization": f"Bearer {KEY}"}
    status, _, raw = daemon.request("GET", "/models", headers=head)
    assert status == 200
    assert [m["id"] for m in json.loads(raw)["data"]] == ["SmolLM2-135M-Instruct.Q4_1", ALIAS]
    body = {"model": "x", "messages": ASK, "max_tokens": 2, "stream": True}
    status, _, raw = daemon.request("POST", "/chat/completions", body, headers=head)
    assert status == 200 and sse_events(raw)[-1] == "[DONE]"


def test_bad_tool_input_gets_openai_errors(client):
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]
    cases = [
        ({"tools": bad_schema}, "not a valid JSON Schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not among the tools"),
        ({"messages": [*ASK, HISTORY[2]]}, "must be a response to a preceding message"),
    ]  # fmt: skip
    for extra, message in cases:
        kw = {"model": ALIAS, "messages": HISTORY, "max_tokens": 2, **extra}
        with pytest.raises(openai.BadRequestError, match=message) as e:
            client.chat.completions.create(**kw)
        assert e.value.body["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def claude(daemon):
    return anthropic.Anthropic(base_url=daemon.url, api_key=KEY, max_retries=0)


ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "The weather in a city",
     "input_schema": TOOLS[0]["function"]["parameters"]}
]  # fmt: skip
ANTHROPIC_HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]},
]  # fmt: skip


def test_anthropic_messages_on_the_chat_path(claude, client):
    greedy = {"temperature": 0}  # current clients no longer have the argument; the API has it
    kw = {"max_tokens": 5, "extra_body": greedy, "tools": ANTHROPIC_TOOLS}
    message = claude.messages.create(model="claude-x", messages=ANTHROPIC_HISTORY, **kw)
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason in ("max_tokens", "end_turn")
    (block,) = message.content
    assert block.type == "text"
    # the same conversation through the OpenAI API renders the same prompt and text
    history = json.loads(json.dumps(HISTORY))
    history[1]["content"] = "Let me look."
    history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = "toolu_1"
    same = client.chat.completions.create(
        model=ALIAS, messages=history, tools=TOOLS, max_tokens=5, temperature=0
    )
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == (
        same.usage.prompt_tokens
    )
    assert block.text == same.choices[0].message.content
    counted = claude.messages.count_tokens(model="x", messages=ANTHROPIC_HISTORY, tools=kw["tools"])
    assert counted.input_tokens == same.usage.prompt_tokens


def test_anthropic_stream_events(claude):
    kinds = []
    with claude.messages.stream(
        model="claude-x", max_tokens=5, extra_body={"temperature": 0}, messages=ANTHROPIC_HISTORY,
        tools=ANTHROPIC_TOOLS,
    ) as stream:  # fmt: skip
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert kinds[-2] == "message_delta"
    assert final.content[0].type == "text" and final.content[0].text
    assert final.usage.output_tokens == 5 and final.stop_reason == "max_tokens"


def test_anthropic_errors_have_anthropic_shape(daemon, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="x", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}])  # fmt: skip
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=daemon.url, api_key="wrong", max_retries=0).messages.create(
            model="x", max_tokens=4, messages=ANTHROPIC_HISTORY
        )
    status, _, raw = daemon.request(
        "POST", "/v1/messages", {"messages": ASK}, headers={"x-api-key": KEY}
    )
    body = json.loads(raw)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3") / "qwen3.gguf"
    write_synthetic(path, "tiny-qwen3", "q8_0", progress=False, chat="qwen3")
    d = start_daemon(str(path), "--threads", "1")
    yield d
    assert d.finish() == 0, d.log()


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(qwen3):
    def prompt_tokens(**extra):
        body = {"messages": ASK, "max_tokens": 1, **extra}
        status, headers, raw = qwen3.request("POST", "/v1/chat/completions", body)
        assert status == 200, raw
        return json.loads(raw)["usage"]["prompt_tokens"], headers

    thinking, _ = prompt_tokens()
    direct, headers = prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert direct > thinking  # Qwen3's template closes an empty think block
    assert "X-Hetero-Ignored-Fields" not in headers
    _, headers = prompt_tokens(reasoning_effort="low")  # Qwen3's template does not read it
    assert headers["X-Hetero-Ignored-Fields"] == "reasoning_effort"
