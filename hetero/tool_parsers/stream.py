"""What a tool parser emits while the model's text streams in, and the pieces every parser uses.

A parser is fed the text of one choice as it arrives and answers with a `Delta`: content for the
user, reasoning, and tool-call pieces in OpenAI's streaming order (a call's index, id and name
first, then fragments of its JSON arguments). Text that might be the start of a marker
(`<tool_c` of `<tool_call>`) is held back until the next piece decides it, so content never shows
half a marker. Fed all at once, the same parser gives the non-streaming answer: the deltas of
both paths join to the same message.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

_ALNUM = string.ascii_letters + string.digits


def new_call_id(length: int | None = None, prefix: str = "call_") -> str:
    """OpenAI-style `call_` + 24 random letters and digits; `length`: exactly that many letters
    and digits and no prefix (Mistral's templates refuse ids that are not 9 alphanumerics)."""
    if length is not None:
        return "".join(secrets.choice(_ALNUM) for _ in range(length))
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(24))


@dataclass
class CallDelta:
    """A piece of one tool call: the first carries id and name, the rest argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def add(self, other: Delta) -> Delta:
        self.content += other.content
        self.reasoning += other.reasoning
        for c in other.calls:  # consecutive argument pieces of one call are merged
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == c.index and c.id is None:
                last.arguments += c.arguments
            else:
                self.calls.append(CallDelta(c.index, c.id, c.name, c.arguments))
        return self


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `markers` (held back)."""
    keep = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), keep, -1):
            if text.endswith(m[:k]):
                keep = k
                break
    return keep


class JsonScan:
    """Where one JSON value ends, fed piece by piece (the value's own syntax is not checked:
    json.loads does that where it matters). `depth=1` starts inside an object already open."""

    _STRING_STOP = re.compile(r'["\\]')

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.in_string = False
        self.escape = False
        self.started = depth > 0
        self.scalar = False

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the value's end, or None when it goes on."""
        i, n = 0, len(text)
        while i < n:
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                else:  # jump to the next quote or backslash
                    m = self._STRING_STOP.search(text, i)
                    i = m.start() if m else n
                    continue
            elif self.scalar:  # a number or literal ends at the first byte that is not part of it
                if ch in ",}] \t\r\n":
                    return i
            elif ch == '"':
                self.in_string = self.started = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
            elif not ch.isspace() and not self.started:
                self.scalar = self.started = True
            i += 1
        return None


@dataclass
class Head:
    """How far the head of a `{"name": ..., "arguments": ...}` object is known.

    state: "more" (need text), "ready" (name known, `pos` is where the arguments value starts),
    "whole" (valid so far but in another order: parse the whole object), "fail" (not a call).
    """

    state: str
    name: str | None = None
    pos: int = 0


_WS = re.compile(r"\s*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)


def _string_at(buf: str, pos: int) -> tuple[str | None, int, str]:
    """A JSON string at `pos`: (value, end, state) with state "ok", "more" or "fail"."""
    if pos >= len(buf):
        return None, pos, "more"
    if buf[pos] != '"':
        return None, pos, "fail"
    m = _STRING.match(buf, pos)
    if m is None:
        return None, pos, "more"
    return json.loads(m.group()), m.end(), "ok"


def call_head(
    buf: str,
    pos: int = 0,
    arg_keys: tuple[str, ...] = ("arguments", "parameters"),
    strict: bool = False,
) -> Head:
    """Read `{"name": "f", "arguments": ` (and `"type": "function"` before it, as Llama writes)
    from `buf[pos:]`. With `strict`, any other key means the object is not a call ("fail"), as
    for Llama, whose calls are bare JSON that a plain JSON answer must not be taken for."""
    pos = _WS.match(buf, pos).end()
    if pos >= len(buf):
        return Head("more")
    if buf[pos] != "{":
        return Head("fail")
    pos += 1
    name = None
    while True:
        pos = _WS.match(buf, pos).end()
        key, pos, state = _string_at(buf, pos)
        if state != "ok":
            return Head(state)
        pos = _WS.match(buf, pos).end()
        if pos >= len(buf):
            return Head("more")
        if buf[pos] != ":":
            return Head("fail")
        pos = _WS.match(buf, pos + 1).end()
        if pos >= len(buf):
            return Head("more")
        if key in arg_keys:
            return Head("ready", name, pos) if name is not None else Head("whole")
        if key not in ("name", "type"):
            return Head("fail" if strict else "whole")
        value, pos, state = _string_at(buf, pos)
        if state != "ok":
            return Head(state)
        if key == "name":
            name = value
        pos = _WS.match(buf, pos).end()
        if pos >= len(buf):
            return Head("more")
        if buf[pos] != ",":
            return Head("whole" if buf[pos] == "}" and not strict else "fail")
        pos += 1
