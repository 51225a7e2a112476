"""gpt-oss's Harmony format: the answer is a sequence of messages, each on a channel.

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}                                          (then <|call|>, which ends the turn)

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>Hi!

The prompt ends with `<|start|>assistant`, so the answer opens with a header: the channel and,
for a call, the recipient (`to=functions.NAME`, before or after the channel). `analysis` is
reasoning, `final` is content, `commentary` to a function is a tool call whose message is its JSON
arguments, and `commentary` to no one (a preamble) is content. `<|call|>` and `<|return|>` end
generation and never reach the text; `<|end|>` ends one message. These markers are ordinary
(user-defined) tokens in gpt-oss's vocabulary, so they are in the decoded text. A reply that
opens with no header at all is taken as content.
"""

from __future__ import annotations

import re

from hetero.tool_parsers.base import ToolParser
from hetero.tool_parsers.stream import held_back

MESSAGE, END = "<|message|>", "<|end|>"
_HEADER_STARTS = ("<|channel|>", "<|start|>", "<|constrain|>", " to=", "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyParser(ToolParser):
    def __init__(self, *args, tools_enabled: bool = True, **kw) -> None:
        super().__init__(*args, **kw)
        self.tools_enabled = tools_enabled
        self.state = "header"

    def _step(self, final: bool) -> bool:
        return getattr(self, "_in_" + self.state)(final)

    def _in_header(self, final: bool) -> bool:
        text = self.buf.lstrip()
        if not text:
            return False
        i = text.find(MESSAGE)
        if i < 0:
            could_be = any(s.startswith(text) or text.startswith(s) for s in _HEADER_STARTS)
            if could_be and not final:
                return False
            self.channel, self.recipient = "final", None  # no header: plain content
            self.buf, self.state = text, "body"
            return True
        header = text[:i]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else "final"
        self.recipient = recipient.group(1) if recipient else None
        self.buf, self.state = text[i + len(MESSAGE) :], "body"
        name = self._function()
        if name is not None and not self._start_call(name):
            self.state = "drop"
        return True

    def _function(self) -> str | None:
        if self.tools_enabled and self.recipient and self.recipient.startswith("functions."):
            return self.recipient.removeprefix("functions.")
        return None

    def _in_body(self, final: bool) -> bool:
        i = self.buf.find(END)
        if i < 0:
            keep = 0 if final else held_back(self.buf, (END,))
            piece, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        else:
            piece, self.buf = self.buf[:i], self.buf[i + len(END) :]
        self._emit(piece)
        if i < 0:
            return False
        self.state = "header"
        return True

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self._function() is not None:
            self._arguments(text)
        elif self.channel == "analysis":
            self._out.reasoning += text
        else:
            self._content(text)

    def _in_drop(self, final: bool) -> bool:
        self.buf = ""
        return False
