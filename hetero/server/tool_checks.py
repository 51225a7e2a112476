"""Checks of what a chat request says about tools, answered in OpenAI's error shape.

- `tools`: function definitions, each parameters object a valid JSON Schema (checked against
  its declared draft by `jsonschema`), names unique and as OpenAI allows them.
- `tool_choice`: "none", "auto", "required" or a named function that is among the tools.
- the history: every `tool` message answers a call that an earlier assistant message made, and
  calls' JSON `arguments` strings become objects for the template (templates write
  `arguments | tojson` or iterate over them, as HF transformers, vLLM and llama.cpp hand them).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import jsonschema

from hetero.server.protocol import bad

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
CHOICES = ("none", "auto", "required")


def check_tools(tools: Any, param: str = "tools") -> list[dict[str, Any]]:
    """The tools as OpenAI's `{"type": "function", "function": {...}}` objects."""
    if not isinstance(tools, list):
        raise bad(f"'{param}' must be an array of tools", param=param)
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad(f"{where} must be an object of type 'function'", param=param)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{where} has no 'function' object", param=param)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad(
                f"{where}.function.name must be 1-128 letters, digits, '_', '-', '.' or ':', "
                f"got {name!r}",
                param=param,
            )
        if name in names:
            raise bad(f"{where}: the function name {name!r} is given twice", param=param)
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"{where}.function.description must be a string", param=param)
        check_schema(fn.get("parameters"), f"{where}.function.parameters", param)
    return tools


def check_schema(schema: Any, where: str, param: str) -> None:
    """A JSON Schema object, valid under the draft it names (2020-12 where it names none)."""
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise bad(f"{where} must be a JSON Schema object", param=param)
    validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "/".join(str(p) for p in e.absolute_path) or "(top)"
        raise bad(f"{where} is not a valid JSON Schema: {e.message} at {at}", param=param) from e


def check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, str]:
    """ "none", "auto", "required", or {"name": NAME} for one named function."""
    if choice is None:
        return "auto" if tools else "none"
    if not tools:
        if choice == "none":
            return "none"
        raise bad("'tool_choice' is only allowed when 'tools' are specified", param="tool_choice")
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad(
                f"Invalid value for 'tool_choice': {choice!r}; use 'none', 'auto', 'required' "
                "or a named function",
                param="tool_choice",
            )
        return choice
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad(
            '\'tool_choice\' as an object must be {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    known = [t["function"]["name"] for t in tools]
    if name not in known:
        raise bad(
            f"'tool_choice' names the function {name!r}, which is not among the tools "
            f"({', '.join(known)})",
            param="tool_choice",
        )
    return {"name": name}


def _arguments(value: Any) -> Any:
    """A call's `arguments` for the template: the JSON object a string holds, else as given."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def _short_id(call_id: str, length: int) -> str:
    """An id of `length` letters and digits for a template that takes no other (Mistral)."""
    if len(call_id) == length and call_id.isalnum():
        return call_id
    return hashlib.sha1(call_id.encode()).hexdigest()[:length]


def check_history(messages: list[dict[str, Any]], id_length: int | None = None) -> None:
    """Calls and their answers, in place: arguments as objects, every tool message answering an
    earlier call (400 otherwise), ids shortened where the format requires (`id_length`)."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            _check_calls(m, i, made, id_length)
        elif m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad(f"messages[{i}] (tool) needs a string 'tool_call_id'", param="messages")
            if call_id not in made:
                raise bad(
                    f"messages[{i}] (tool) answers the call {call_id!r}, but no earlier assistant "
                    "message made a call with that id: a 'tool' message must be a response to a "
                    "preceding message with 'tool_calls'",
                    param="messages",
                )
            if id_length is not None:
                m["tool_call_id"] = _short_id(call_id, id_length)


def _check_calls(m: dict[str, Any], i: int, made: set[str], id_length: int | None) -> None:
    calls = m["tool_calls"]
    if not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls must be an array", param="messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(
                f"messages[{i}].tool_calls[{j}] needs a 'function' with a string 'name'",
                param="messages",
            )
        fn["arguments"] = _arguments(fn.get("arguments", {}))
        if isinstance(call.get("id"), str):
            made.add(call["id"])
            if id_length is not None:
                call["id"] = _short_id(call["id"], id_length)
