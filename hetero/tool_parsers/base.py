"""The parser every tool-call format builds on: a buffer, a state, and the emitting helpers.

Subclasses define `_step(final)`, which consumes what it can of `self.buf` in its current state
and returns True when it made progress (it is called again until it makes none). `final` is set
once the model has stopped: nothing more will come, so what was held back is decided now.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from hetero.tool_parsers.stream import (
    CallDelta,
    Delta,
    JsonScan,
    ToolCall,
    held_back,
    new_call_id,
)


class ToolParser:
    """Model text in, content and tool-call deltas out (plain content: no calls)."""

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] = (),
        *,
        parallel: bool = True,
        id_length: int | None = None,
        id_prefix: str = "call_",
    ) -> None:
        # name -> the function's JSON schema of parameters (the XML form types values by it)
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        self.parallel = parallel
        self.id_length, self.id_prefix = id_length, id_prefix
        self.buf = ""
        self.state = "text"
        self.calls: list[ToolCall] = []
        self._ws = ""  # trailing whitespace of content, held until something else follows it
        self._out = Delta()

    # -- driving ---------------------------------------------------------------------------

    def feed(self, text: str) -> Delta:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> Delta:
        out = self._run(final=True)
        if not self.calls and self._ws:  # whitespace around calls is not content
            out.content += self._ws
        self._ws = ""
        return out

    def _run(self, final: bool) -> Delta:
        self._out = Delta()
        while self._step(final):
            pass
        return self._out

    def _step(self, final: bool) -> bool:
        self._content(self.buf)
        self.buf = ""
        return False

    # -- emitting --------------------------------------------------------------------------

    def _content(self, text: str) -> None:
        if not text:
            return
        text = self._ws + text
        kept = text.rstrip()
        self._ws = text[len(kept) :]
        self._out.content += kept

    def _pass_text(self, final: bool, markers: tuple[str, ...]) -> None:
        """All of buf is content but what could begin one of `markers` (unless `final`)."""
        keep = 0 if final else held_back(self.buf, markers)
        self._content(self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]

    def _start_call(self, name: str) -> bool:
        """A new call named `name`; False when parallel calls are off and one was made."""
        if self.calls and not self.parallel:
            return False
        self._ws = ""
        call = ToolCall(new_call_id(self.id_length, self.id_prefix), name, "")
        self.calls.append(call)
        self._out.calls.append(CallDelta(len(self.calls) - 1, call.id, name, ""))
        return True

    def _arguments(self, text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            self._out.calls.append(CallDelta(len(self.calls) - 1, arguments=text))

    def _whole_call(self, text: str) -> bool:
        """A call given as one JSON object (`{"name": .., "arguments": {..}}`), emitted at once;
        False when `text` is not such an object."""
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models send the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return False
        if self._start_call(obj["name"]):
            self._arguments(json.dumps(args, ensure_ascii=False))
        return True

    # -- shared states ---------------------------------------------------------------------

    def _stream_arguments(self, scan: JsonScan) -> bool:
        """Pass the arguments value on as it comes; True once it has ended (buf: what follows)."""
        end = scan.feed(self.buf)
        if end is None:
            self._arguments(self.buf)
            self.buf = ""
            return False
        self._arguments(self.buf[:end])
        self.buf = self.buf[end:]
        return True
