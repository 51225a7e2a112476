"""Mistral calls, after the `[TOOL_CALLS]` control token (shown: this format asks for special
tokens' text). Two forms:

    [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]
                                     (Mistral 7B v0.3, Nemo, Small 3.1: a JSON array)
    [TOOL_CALLS]f[ARGS]{"x": 1}      (tokenizer v11 and later: Small 3.2, Devstral, Magistral;
    [TOOL_CALLS]f[CALL_ID]ab12cd34e[ARGS]{"x": 1}    one marker per call)

Text before the marker is content. Mistral's templates take call ids of exactly 9 letters and
digits, so its ids are made that way.
"""

from __future__ import annotations

import re

from hetero.tool_parsers.base import ToolParser
from hetero.tool_parsers.stream import JsonScan, call_head

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"\s*([^\[\]{}\s]+)\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]")


class MistralParser(ToolParser):
    def _step(self, final: bool) -> bool:
        return getattr(self, "_in_" + self.state)(final)

    def _in_text(self, final: bool) -> bool:
        i = self.buf.find(MARKER)
        if i < 0:
            self._pass_text(final, (MARKER,))
            return False
        self._content(self.buf[:i])
        self.buf = self.buf[i + len(MARKER) :]
        self.state = "form"
        return True

    def _in_form(self, final: bool) -> bool:
        text = self.buf.lstrip()
        if not text:
            return False
        self.buf = text
        self.state = "array" if text[0] == "[" else "named"
        if self.state == "array":
            self.buf = text[1:]
        return True

    # -- [{"name": ..., "arguments": ...}, ...] ----------------------------------------------

    def _in_array(self, final: bool) -> bool:
        """Between elements: `,` goes on, `]` ends the array, `{` starts a call."""
        text = self.buf.lstrip().lstrip(",").lstrip()
        if not text:
            self.buf = ""
            return False
        if text[0] == "]":
            self.buf, self.state = text[1:], "text"
            return True
        head = call_head(text)
        if head.state == "more":
            self.buf = text
            return False
        if head.state != "ready":  # another key order: the element is parsed whole
            self.buf, self.scan, self.state = text, JsonScan(), "element"
            return True
        return self._begin(head.name, text[head.pos :], "array")

    def _in_element(self, final: bool) -> bool:
        end = self.scan.feed(self.buf)
        if end is None:
            return False
        if not self._whole_call(self.buf[:end]):
            self._content(self.buf[:end])
        self.buf, self.state = self.buf[end:], "array"
        return True

    # -- name[ARGS]{...} ----------------------------------------------------------------------

    def _in_named(self, final: bool) -> bool:
        m = _NAME.match(self.buf)
        if m is None:
            if final or "{" in self.buf:  # not this form either: content
                self._content(MARKER + self.buf)
                self.buf, self.state = "", "text"
            return False
        return self._begin(m.group(1), self.buf[m.end() :], "text")

    # -- shared --------------------------------------------------------------------------------

    def _begin(self, name: str, rest: str, after: str) -> bool:
        if not self._start_call(name):
            self.buf, self.state = "", "drop"
            return False
        self.buf, self.after = rest, after
        self.scan, self.state = JsonScan(), "arguments"
        return True

    def _in_arguments(self, final: bool) -> bool:
        if not self._stream_arguments(self.scan):
            return False
        if self.after == "array":  # the rest of the element object, up to its `}`
            self.scan, self.state = JsonScan(depth=1), "tail"
        else:
            self.state = "text"
        return True

    def _in_tail(self, final: bool) -> bool:
        end = self.scan.feed(self.buf)
        if end is None:
            self.buf = ""
            return False
        self.buf, self.state = self.buf[end:], "array"
        return True

    def _in_drop(self, final: bool) -> bool:
        self.buf = ""
        return False
