"""Forced tool calls against real daemons on 127.0.0.1, with the real client libraries.

`tool_choice` "required" or a named function (Anthropic's `any` and `tool`) makes even a
random-weight model call: the answer is decoded under the grammar of the model's tool-call format
(tool_grammars.py). The family templates are `hetero synth --chat` models (random weights, the real
templates and special tokens of Qwen2.5, Qwen3, Llama 3.1 and Mistral Nemo); SmolLM2 (whose
template knows no tools: the generic format) serves the tests where a real model helps: the
`openai` client's `parse` with a pydantic model, the `anthropic` client, and the `openai-agents`
SDK running a tool loop. Every call's arguments are checked by the `jsonschema` package against
the tool's schema; a second turn's prompt (the call and its result rendered by the template) is
checked against HF transformers' `apply_chat_template`.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Annotated, Literal

import anthropic
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel, Field

from hetero.synth import write_synthetic
from tests.support.server_fixture import start_daemon

transformers = pytest.importorskip("transformers")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 16},
        "unit": {"type": "string", "enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                      "parameters": CLOCK}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
FAMILIES = {"qwen2.5": "tiny-qwen2", "qwen3": "tiny-qwen3", "llama3.1": "tiny-llama",
            "mistral-nemo": "tiny-llama"}  # fmt: skip
# Qwen3 thinks unless told not to: a random model's reasoning would run to the bound first
TEMPLATE_KWARGS = {"qwen3": {"enable_thinking": False}}


def client_of(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def assert_valid(calls, names=SCHEMAS) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
    write_synthetic(path, FAMILIES[name], "q8_0", progress=False, chat=name)
    d = start_daemon(str(path), "--threads", "1", "--max-model-len", "2048")
    yield name, path, d
    assert d.finish() == 0, d.log()


def hf_messages(messages: list[dict]) -> list[dict]:
    """The conversation as transformers' templates take it (arguments as objects)."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("tool_calls") and m.get("content") is None:
            m["content"] = ""
        for call in m.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def test_forced_calls_and_the_second_turn(family):
    name, path, daemon = family
    client, kwargs = client_of(daemon), TEMPLATE_KWARGS.get(name, {})
    kw = dict(model="any", tools=TOOLS, temperature=0, max_tokens=400, parallel_tool_calls=False,
              extra_body={"chat_template_kwargs": kwargs})  # fmt: skip
    named = client.chat.completions.create(messages=ASK, tool_choice=NAMED, **kw).choices[0]
    assert named.finish_reason == "tool_calls", named
    assert named.message.content is None and len(named.message.tool_calls) == 1
    assert_valid(named.message.tool_calls, names=["get_weather"])
    call = named.message.tool_calls[0]
    if name == "mistral-nemo":  # Mistral's templates take ids of 9 letters and digits only
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id)
    required = client.chat.completions.create(messages=ASK, tool_choice="required", **kw)
    assert required.choices[0].finish_reason == "tool_calls"
    assert len(required.choices[0].message.tool_calls) == 1  # parallel_tool_calls off
    assert_valid(required.choices[0].message.tool_calls)

    # the call and its result go back: the template renders them as transformers does
    history = [*ASK, named.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]  # fmt: skip
    second = client.chat.completions.create(
        messages=history, tools=TOOLS, model="any", max_tokens=1,
        extra_body={"chat_template_kwargs": kwargs},
    )  # fmt: skip
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    want = hf.apply_chat_template(
        hf_messages(history), tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs
    )
    status, tokens = daemon.post("/tokenize", {"content": want, "parse_special": True})
    assert status == 200 and second.usage.prompt_tokens == len(tokens["tokens"])
    assert "sunny, 21 C" in want and want.count("get_weather") >= 2  # the tool and the call


def test_streamed_call_equals_the_whole_one(family):
    name, _, daemon = family
    client = client_of(daemon)
    kw = dict(model="any", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
              max_tokens=400, parallel_tool_calls=False,
              extra_body={"chat_template_kwargs": TEMPLATE_KWARGS.get(name, {})})  # fmt: skip
    state, pieces = ChatCompletionStreamState(), []  # the client's own accumulator of chunks
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        pieces += [p for c in chunk.choices for p in c.delta.tool_calls or ()]
    streamed = state.current_completion_snapshot.choices[0]
    whole = client.chat.completions.create(**kw).choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"

    def calls(message):
        return [(c.function.name, c.function.arguments) for c in message.tool_calls]

    assert calls(streamed.message) == calls(whole.message)  # greedy: the same call both ways
    assert_valid(streamed.message.tool_calls)
    # OpenAI's deltas: id and name first, then the arguments in pieces under the same index
    assert pieces[0].id and pieces[0].function.name and len(pieces) > 2
    assert all(p.id is None and p.function.name is None and p.index == 0 for p in pieces[1:])


# -- SmolLM2 ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    d = start_daemon("--threads", "1", "--max-model-len", "2048")
    yield d
    assert d.finish() == 0, d.log()


class Forecast(BaseModel):
    city: str = Field(max_length=20)
    days: int = Field(ge=1, le=7)
    unit: Literal["C", "F"]


def test_parse_with_a_pydantic_model(smol):
    done = client_of(smol).chat.completions.parse(
        model="any", messages=[{"role": "user", "content": "The forecast for Paris, 3 days."}],
        response_format=Forecast, temperature=0, max_tokens=200,
    )  # fmt: skip
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    jsonschema.validate(json.loads(choice.message.content), Forecast.model_json_schema())


ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]} for t in TOOLS
]  # fmt: skip
GREEDY = {"temperature": 0}  # current clients no longer have the argument; the API has it


def test_anthropic_tool_use_forced_and_answered(smol):
    claude = anthropic.Anthropic(base_url=smol.url, api_key="unused", max_retries=0)
    kw = dict(model="claude-x", max_tokens=300, tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    forced = claude.messages.create(messages=ASK, tool_choice={"type": "any"}, **kw)
    assert forced.stop_reason == "tool_use"
    uses = [b for b in forced.content if b.type == "tool_use"]
    assert uses and len(uses) == len(forced.content)  # a forced answer is calls only
    for use in uses:
        assert use.id.startswith("toolu_")
        jsonschema.validate(use.input, SCHEMAS[use.name])
    named = claude.messages.create(
        messages=ASK, tool_choice={"type": "tool", "name": "get_time"}, **kw
    )
    assert [(b.type, b.name) for b in named.content] == [("tool_use", "get_time")]
    jsonschema.validate(named.content[0].input, CLOCK)

    # the results go back as tool_result blocks; the next turn's prompt holds call and result
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny"} for u in uses]
    turn = [*ASK, {"role": "assistant", "content": forced.content},
            {"role": "user", "content": results}]  # fmt: skip
    answer = claude.messages.create(messages=turn, **{**kw, "max_tokens": 4})
    counted = claude.messages.count_tokens(model="x", messages=turn, tools=ANTHROPIC_TOOLS)
    used = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert used == counted.input_tokens
    assert used > forced.usage.input_tokens + forced.usage.output_tokens


def test_anthropic_streamed_tool_use(smol):
    claude = anthropic.Anthropic(base_url=smol.url, api_key="unused", max_retries=0)
    kw = dict(model="claude-x", max_tokens=300, tools=ANTHROPIC_TOOLS, extra_body=GREEDY,
              messages=ASK, tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    partial = []
    with claude.messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        final = stream.get_final_message()
    whole = claude.messages.create(**kw)
    assert final.stop_reason == whole.stop_reason == "tool_use"
    (use,) = final.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert len(partial) > 1 and json.loads("".join(partial)) == use.input
    assert use.input == whole.content[0].input  # greedy: the same call both ways
    jsonschema.validate(use.input, WEATHER)


def test_an_agent_runs_a_tool_loop(smol):
    """The openai-agents SDK: the model must call the tool (tool_choice required), the SDK runs
    the function and sends its result back, and the model answers with it in its context."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # no trace export: nothing leaves this machine
    ran: list[tuple[str, int]] = []

    @agents.function_tool
    def get_weather(
        city: Annotated[str, Field(max_length=20)], days: Annotated[int, Field(ge=1, le=7)]
    ) -> str:
        """The weather in a city for the next days."""
        ran.append((city, days))
        return f"sunny in {city} for {days} days"

    model = agents.OpenAIChatCompletionsModel(
        model="smol", openai_client=openai.AsyncOpenAI(base_url=smol.url + "/v1", api_key="x")
    )
    agent = agents.Agent(
        name="forecaster", instructions="Answer with the weather tool's help.", model=model,
        tools=[get_weather],
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=120
        ),
    )  # fmt: skip
    result = agents.Runner.run_sync(agent, ASK[0]["content"], max_turns=4)
    assert len(ran) >= 1  # the framework executed the function the model called
    for city, days in ran:
        assert isinstance(city, str) and len(city) <= 20 and 1 <= days <= 7
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)
    assert len(result.raw_responses) >= 2  # a turn with the call, one after its result


def test_what_a_forced_call_cannot_take_is_a_400(smol):
    def post(tools: list, **extra) -> tuple[int, dict]:
        body = {"messages": ASK, "tools": tools, "tool_choice": "required", "max_tokens": 1}
        return smol.post("/v1/chat/completions", {**body, **extra})

    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    status, body = post(TOOLS, response_format=schema)
    assert status == 400 and body["error"]["param"] == "response_format"
    assert "forces a tool call" in body["error"]["message"]
    lookaround = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    tool = [{"type": "function", "function": {"name": "f", "parameters": lookaround}}]
    status, body = post(tool)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == "tools" and "look-around" in body["error"]["message"]
    assert post(tool, tool_choice="auto")[0] == 200  # unforced, the schema is only shown
    # keywords the grammar does not implement are not enforced, not refused
    negated = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    tool = [{"type": "function", "function": {"name": "f", "parameters": negated}}]
    assert post(tool)[0] == 200
