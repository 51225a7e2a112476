"""One choice's generated text as an assistant message: reasoning, content and tool calls.

The text streams through two stages: the reasoning splitter (`<think>` templates) takes the
reasoning off, then the tool parser of the model's format finds calls in the rest. gpt-oss's
Harmony parser does both at once (its analysis channel is the reasoning). Both the streamed
deltas and the final message come from the same pass, so they always agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetero.reasoning import ThinkSplitter
from hetero.tool_parsers import Delta, ToolCall, ToolFormat, ToolParser
from hetero.tool_parsers.harmony import HarmonyParser


@dataclass(frozen=True)
class ChatFormat:
    """How one request's answers are read (the same for each of its choices)."""

    tool_format: ToolFormat | None  # None: the text is not searched for calls
    tools: Sequence[Mapping[str, Any]] = ()
    parallel: bool = True
    thinks: bool = False  # split off <think> reasoning
    in_reasoning: bool = False  # the prompt opened the think block already
    id_prefix: str = "call_"
    tools_enabled: bool = True  # Harmony: False reads calls to functions as plain content

    def new_output(self) -> ChatOutput:
        fmt = self.tool_format
        kw: dict[str, Any] = {"parallel": self.parallel, "id_prefix": self.id_prefix}
        if fmt is not None and fmt.parser is HarmonyParser:
            parser = HarmonyParser(self.tools, tools_enabled=self.tools_enabled, **kw)
            return ChatOutput(parser, None)  # its analysis channel is the reasoning
        if fmt is None:
            parser = ToolParser()
        else:
            parser = fmt.parser(self.tools, id_length=fmt.id_length, **kw)
        splitter = ThinkSplitter(self.in_reasoning) if self.thinks else None
        return ChatOutput(parser, splitter)


@dataclass
class ChatOutput:
    parser: ToolParser
    splitter: ThinkSplitter | None
    content: str = ""
    reasoning: str = ""
    finished: bool = field(default=False)

    def feed(self, text: str) -> Delta:
        if self.splitter is None:
            return self._keep(self.parser.feed(text))
        reasoning, content = self.splitter.feed(text)
        delta = self.parser.feed(content)
        delta.reasoning = reasoning + delta.reasoning
        return self._keep(delta)

    def finish(self) -> Delta:
        """The text held back, once the choice has ended."""
        self.finished = True
        delta = Delta()
        if self.splitter is not None:
            reasoning, content = self.splitter.finish()
            delta.reasoning += reasoning
            delta.add(self.parser.feed(content))
        delta.add(self.parser.finish())
        return self._keep(delta)

    def _keep(self, delta: Delta) -> Delta:
        self.content += delta.content
        self.reasoning += delta.reasoning
        return delta

    @property
    def calls(self) -> list[ToolCall]:
        return self.parser.calls
