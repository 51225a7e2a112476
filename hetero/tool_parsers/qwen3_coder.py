"""Qwen3-Coder's XML calls:

    <tool_call>
    <function=write_file>
    <parameter=path>
    src/main.py
    </parameter>
    <parameter=content>
    print("hi")
    </parameter>
    </function>
    </tool_call>

Values are raw text (one newline after the opening tag and one before the closing tag belong to
the markup), typed by the function's parameter schema as Qwen's own parser does: strings stay
text, integers, numbers and booleans are read as such, objects and arrays as JSON; a parameter
the schema does not type is JSON when it parses and text otherwise. The arguments stream as one
JSON object, a parameter at a time: `{"path": "src/main.py"`, then `, "content": ...`, then `}`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from hetero.tool_parsers.base import ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_END, PARAM_END = "</function>", "</parameter>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>")


def _typed(value: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if value.lower() == "null" and "string" not in kinds:
        return None
    if "string" in kinds:
        return value
    try:
        if "integer" in kinds:
            return int(value)
        if "number" in kinds:
            number = float(value)
            return int(number) if number.is_integer() and "." not in value else number
    except ValueError:
        return value
    if "boolean" in kinds and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        return value


class Qwen3CoderParser(ToolParser):
    def _step(self, final: bool) -> bool:
        return getattr(self, "_in_" + self.state)(final)

    def _in_text(self, final: bool) -> bool:
        starts = [i for i in (self.buf.find(OPEN), self.buf.find("<function=")) if i >= 0]
        if not starts:
            self._pass_text(final, (OPEN, "<function="))
            return False
        i = min(starts)
        self._content(self.buf[:i])
        self.opener = OPEN if self.buf.startswith(OPEN, i) else ""
        self.buf = self.buf[i + len(self.opener) :]
        self.state = "function"
        return True

    def _in_function(self, final: bool) -> bool:
        m = _FUNCTION.match(self.buf)
        if m is None:
            if final or (">" in self.buf or len(self.buf) > 200):  # not this form: content
                self._content(self.opener + self.buf)
                self.buf, self.state = "", "text"
            return False
        name = m.group(1).strip()
        if not self._start_call(name):
            self.buf, self.state = "", "drop"
            return False
        self.properties = self.schemas.get(name, {}).get("properties") or {}
        self.n_params = 0
        self.buf, self.state = self.buf[m.end() :], "parameters"
        return True

    def _in_parameters(self, final: bool) -> bool:
        text = self.buf.lstrip()
        if text.startswith(FUNCTION_END):
            self._arguments("}" if self.n_params else "{}")
            self.buf, self.state = text[len(FUNCTION_END) :], "tail"
            return True
        m = _PARAM.match(text)
        if m is None:
            if final and self.n_params:
                self._arguments("}")
            return False
        end = self._value_end(text, m.end())
        if end is None:
            return False
        value = text[m.end() : end[0]].removeprefix("\n").removesuffix("\n")
        key = m.group(1).strip()
        piece = json.dumps(key) + ": " + json.dumps(_typed(value, self.properties.get(key)))
        self._arguments(("{" if self.n_params == 0 else ", ") + piece)
        self.n_params += 1
        self.buf = text[end[1] :]
        return True

    @staticmethod
    def _value_end(text: str, start: int) -> tuple[int, int] | None:
        """(end of the value, end of its closing tag); a missing `</parameter>` before the next
        parameter or the function's end is tolerated, as Qwen's parser does."""
        i = text.find(PARAM_END, start)
        if i >= 0:
            return i, i + len(PARAM_END)
        for tag in ("<parameter=", FUNCTION_END):
            j = text.find(tag, start)
            if j >= 0:
                return j, j
        return None

    def _in_tail(self, final: bool) -> bool:
        text = self.buf.lstrip()
        if text.startswith(CLOSE):
            self.buf, self.state = text[len(CLOSE) :], "text"
            return True
        if not text or CLOSE.startswith(text):
            return False
        self.buf, self.state = text, "text"  # a call without its closing tag
        return True

    def _in_drop(self, final: bool) -> bool:
        self.buf = ""
        return False
