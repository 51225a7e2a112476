"""Tools for models whose chat template knows nothing of them (SmolLM2's ChatML, Gemma ...).

The template cannot render tools, past calls or tool results, so the conversation is rewritten
into what it can render, in the Hermes format that the generic parser then reads (as llama.cpp's
generic handler does with its own JSON format):

- the tools are described in a system message (merged into the first system message, or into the
  first user message with `in_user`, for templates that refuse a system role);
- an assistant message's calls become `<tool_call>{json}</tool_call>` lines of its content;
- tool results become a user message of `<tool_response>` blocks (one message for a run of them,
  so user and assistant turns still alternate).
"""

from __future__ import annotations

import json
from typing import Any

INSTRUCTIONS = (
    "# Tools\n\n"
    "You can call functions to help with the user's request. Their signatures are given as "
    "JSON objects within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object of its name and arguments within "
    "<tool_call></tool_call> tags, one per call:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tools_text(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return INSTRUCTIONS.format(tools=lines)


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _with_calls(message: dict[str, Any]) -> dict[str, Any]:
    calls = "\n".join(_call_text(c) for c in message["tool_calls"])
    content = message.get("content") or ""
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = f"{content}\n{calls}" if content else calls
    return out


def rewrite(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, in_user: bool = False
) -> list[dict[str, Any]]:
    """`messages` (checked, content as strings) in a form any template renders."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            out.append(_with_calls(m))
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        _add_instructions(out, tools_text(tools), in_user)
    return out


def _add_instructions(messages: list[dict[str, Any]], text: str, in_user: bool) -> None:
    if in_user:
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is not None:
            first["content"] = f"{text}\n\n{first['content']}"
            return
    elif messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        return
    messages.insert(0, {"role": "user" if in_user else "system", "content": text})
