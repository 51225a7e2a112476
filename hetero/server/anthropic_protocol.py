"""Anthropic's Messages API in the chat's terms: requests in, messages out, its error shape.

A request becomes the same `ChatInput` an OpenAI request does (chat_request.py), so both APIs run
one engine path: `system` is the first message; a user message's `tool_result` blocks become
`tool` messages (before its text, as Anthropic orders them); an assistant message's `tool_use`
blocks become `tool_calls` and its `thinking` blocks its reasoning; `tools` (name, description,
input_schema) become functions; `tool_choice` auto/any/tool/none becomes auto/required/a named
function/none, and `disable_parallel_tool_use` turns parallel calls off; `thinking` enabled or
disabled is the template's `enable_thinking`.
"""

from __future__ import annotations

import json
from typing import Any

from hetero.server.chat_request import ChatInput
from hetero.server.protocol import Field, bad
from hetero.server.tool_checks import check_tool_choice, check_tools

MESSAGES_FIELDS: dict[str, Field] = {
    "model": Field("string"),
    "messages": Field("array", required=True),
    "max_tokens": Field("integer", 1, required=True),
    "system": Field("prompt"),  # a string or an array of text blocks
    "stop_sequences": Field("stop"),
    "temperature": Field("number", 0, 1),
    "top_p": Field("number", 0, 1),
    "top_k": Field("integer", 0),
    "stream": Field("boolean"),
    "tools": Field("array"),
    "tool_choice": Field("object"),
    "thinking": Field("object"),
    "metadata": Field("object"),
    "service_tier": Field("string"),
}
COUNT_FIELDS = {k: v for k, v in MESSAGES_FIELDS.items() if k != "max_tokens"}
# Fields that change what Claude does in ways a local model cannot: a 400, never ignored.
MESSAGES_UNSUPPORTED = ("mcp_servers", "container")

# HTTP status -> Anthropic's error type
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text(content: Any, where: str) -> str:
    """A string, or the text of an array of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of content blocks", param="messages")
    texts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad(f"{where}: only text blocks can be here, not {kind!r}", param="messages")
        texts.append(str(block.get("text", "")))
    return "\n".join(texts)


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": _text(block.get("content", ""), f"{where}.content[{j}]"),
                }
            )
        elif kind == "text":
            texts.append(str(block.get("text", "")))
        else:
            raise bad(
                f"{where}.content[{j}]: a {kind!r} block is not supported by this server "
                "(text and tool_result are)",
                param="messages",
            )
    out = results
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    calls, thinking = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            message["content"] += str(block.get("text", ""))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": block.get("input", {})},
                }
            )
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind != "redacted_thinking":  # Claude's encrypted reasoning: nothing to render
            raise bad(f"{where}.content[{j}]: a {kind!r} block is not supported", param="messages")
    if calls:
        message["tool_calls"] = calls
        message["content"] = message["content"] or None
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text(body["system"], "system")})
    for i, m in enumerate(body["messages"]):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where} must be an object with role 'user' or 'assistant'", "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
        elif not isinstance(content, list):
            raise bad(f"{where}.content must be a string or an array of blocks", "messages")
        elif m["role"] == "user":
            out.extend(_user(content, where))
        else:
            out.append(_assistant(content, where))
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(f"tools[{i}]: the server tool {kind!r} is not available here", "tools")
        fn = {"name": t.get("name")}  # in OpenAI's order: templates print the tools as JSON
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t.get("input_schema")
        out.append({"type": "function", "function": fn})
    return check_tools(out)


def _tool_choice(choice: dict[str, Any] | None, tools: list | None) -> tuple[Any, bool]:
    if choice is None:
        return check_tool_choice(None, tools), True
    kind = choice.get("type")
    openai = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        openai = {"type": "function", "function": {"name": choice.get("name")}}
    if openai is None:
        raise bad(f"tool_choice type {kind!r} is not one of auto, any, tool, none", "tool_choice")
    return check_tool_choice(openai, tools), not choice.get("disable_parallel_tool_use")


def chat_input(body: dict[str, Any]) -> ChatInput:
    tools = _tools(body)
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    kwargs = {}
    thinking = body.get("thinking")
    if thinking is not None:
        if thinking.get("type") not in ("enabled", "disabled"):
            raise bad("thinking.type must be 'enabled' or 'disabled'", param="thinking")
        kwargs["enable_thinking"] = thinking["type"] == "enabled"
    return ChatInput(_messages(body), tools, choice, parallel, kwargs, id_prefix="toolu_")


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams fields of a Messages request (max_tokens is resolved by the handler)."""
    kw = {k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}
    stop = body.get("stop_sequences")
    if stop:
        kw["stop"] = [stop] if isinstance(stop, str) else list(stop)
    return kw


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the `input` object of a tool_use block."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}
