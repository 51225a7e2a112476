"""Hermes-style calls, as Qwen2.5 and Qwen3 (and Hermes, and the generic fallback) write them:

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before a call is content; several calls follow one another. The name is sent as soon as the
object's head is read and the arguments stream as the model writes them (their text verbatim).
An object in another key order is parsed whole when it closes; one that is not a call at all
stays content, markers included.
"""

from __future__ import annotations

from hetero.tool_parsers.base import ToolParser
from hetero.tool_parsers.stream import JsonScan, call_head

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    def _step(self, final: bool) -> bool:
        return getattr(self, "_in_" + self.state)(final)

    def _in_text(self, final: bool) -> bool:
        i = self.buf.find(OPEN)
        if i < 0:
            self._pass_text(final, (OPEN,))
            return False
        self._content(self.buf[:i])
        self.buf = self.buf[i + len(OPEN) :]
        self.state = "head"
        return True

    def _in_head(self, final: bool) -> bool:
        head = call_head(self.buf)
        if head.state == "more" and CLOSE in self.buf:
            head.state = "whole"  # closed before its head was complete: decide on the whole
        if head.state == "more":
            if final:
                self._not_a_call()
            return final
        if head.state == "ready":
            if not self._start_call(head.name):
                self.state = "drop"
                return True
            self.buf = self.buf[head.pos :]
            self.scan = JsonScan()
            self.state = "arguments"
            return True
        if head.state == "whole":
            self.state = "whole"
            return True
        self._not_a_call()
        return True

    def _not_a_call(self) -> None:
        self._content(OPEN)
        self.state = "text"

    def _in_arguments(self, final: bool) -> bool:
        if self._stream_arguments(self.scan):
            self.state = "tail"
            return True
        return False

    def _in_tail(self, final: bool) -> bool:
        """After the arguments: the object's `}` and the closing tag, both dropped."""
        i = self.buf.find(CLOSE)
        if i < 0:
            if final:
                self.buf = ""
            return False
        self.buf = self.buf[i + len(CLOSE) :]
        self.state = "text"
        return True

    def _in_whole(self, final: bool) -> bool:
        i = self.buf.find(CLOSE)
        if i < 0 and not final:
            return False
        body = self.buf if i < 0 else self.buf[:i]
        rest = "" if i < 0 else self.buf[i + len(CLOSE) :]
        if not self._whole_call(body):
            self._content(OPEN + body + ("" if i < 0 else CLOSE))
        self.buf, self.state = rest, "text"
        return True

    def _in_drop(self, final: bool) -> bool:
        """Parallel calls are off and one was made: the rest of the answer is not shown."""
        self.buf = ""
        return False
