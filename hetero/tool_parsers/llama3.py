"""Llama 3.x calls: the whole answer is bare JSON, `{"name": "f", "parameters": {...}}`.

Llama 3.1/3.3's template asks for `{"name": function name, "parameters": dictionary}`; the model
may put `<|python_tag|>` first (a control token, shown because this format asks for special
tokens' text) and Llama 3.2 joins several calls with `;`. Only an answer that starts with such an
object is a call: one that starts with anything else is content from there on, and so is a JSON
answer whose first key is not `name` or `type` (a plain JSON reply is not taken for a call).
"""

from __future__ import annotations

from hetero.tool_parsers.base import ToolParser
from hetero.tool_parsers.stream import JsonScan, call_head

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.state = "start"
        self.held = ""  # the answer's text while it may still be a call

    def _step(self, final: bool) -> bool:
        return getattr(self, "_in_" + self.state)(final)

    def _in_start(self, final: bool) -> bool:
        """Before a call: whitespace, separators and the python tag are skipped."""
        text = self.buf.lstrip()
        if self.calls:
            text = text.lstrip(";").lstrip()
        if text.startswith(PYTHON_TAG):
            self.held += self.buf[: len(self.buf) - len(text) + len(PYTHON_TAG)]
            self.buf = text[len(PYTHON_TAG) :]
            return True
        if not text or (PYTHON_TAG.startswith(text) and not final):
            return self._wait_or_give_up(final)
        if text[0] != "{":
            return self._plain()
        self.held += self.buf[: len(self.buf) - len(text)]
        self.buf = text
        self.state = "head"
        return True

    def _wait_or_give_up(self, final: bool) -> bool:
        if final:
            return self._plain()
        return False

    def _plain(self) -> bool:
        """Not a call: what was held and everything after it is content."""
        self.buf, self.held = self.held + self.buf, ""
        self.state = "text"
        return True

    def _in_text(self, final: bool) -> bool:
        self._content(self.buf)
        self.buf = ""
        return False

    def _in_head(self, final: bool) -> bool:
        head = call_head(self.buf, strict=True)
        if head.state == "more":
            return self._plain() if final else False
        if head.state != "ready":
            return self._plain()
        self.held = ""
        if not self._start_call(head.name):
            self.buf, self.state = "", "drop"
            return False
        self.buf = self.buf[head.pos :]
        self.scan = JsonScan()
        self.state = "arguments"
        return True

    def _in_arguments(self, final: bool) -> bool:
        if self._stream_arguments(self.scan):
            self.scan = JsonScan(depth=1)  # the rest of the call's object, up to its `}`
            self.state = "tail"
            return True
        return False

    def _in_tail(self, final: bool) -> bool:
        end = self.scan.feed(self.buf)
        if end is None:
            self.buf = ""
            return False
        self.buf = self.buf[end:]
        self.state = "start"
        return True

    def _in_drop(self, final: bool) -> bool:
        self.buf = ""
        return False
