"""Reasoning apart from the answer, for templates that think in `<think>...</think>` (Qwen3,
QwQ, DeepSeek-R1 distills), fed as the text streams.

The answer may open with `<think>`, or the prompt may have opened it already (templates that
end the generation prompt with `<think>\\n`, or that always think): then everything up to
`</think>` is reasoning. An answer that does not open with `<think>` is content throughout (Qwen3
with `enable_thinking: false` gets an empty think block in its prompt and answers directly).
The newlines around the tags are markup, as Qwen3's template writes them: reasoning and content
are handed over without them. Reasoning cut off by the length limit stays reasoning.
"""

from __future__ import annotations

from hetero.tool_parsers.stream import held_back

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(template: str | None) -> bool:
    return bool(template) and OPEN in template and CLOSE in template


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt leaves a think block open for the answer to fill."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN) or (tail.rfind(OPEN) > tail.rfind(CLOSE) and OPEN in tail)


class ThinkSplitter:
    """Text in, (reasoning, content) out."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""
        self.fresh = True  # at the start of reasoning or content: leading newlines are markup

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if self.state == "start":
                text = self.buf.lstrip()
                if text.startswith(OPEN):
                    self.buf, self.state, self.fresh = text[len(OPEN) :], "reasoning", True
                    continue
                if not final and OPEN.startswith(text):
                    return reasoning, content  # empty or a part of the tag: wait
                self.state, self.fresh = "content", False
            if self.state == "reasoning":
                r, done = self._reasoning(final)
                reasoning += r
                if not done:
                    return reasoning, content
                continue
            if self.fresh:
                self.buf = self.buf.lstrip()
                self.fresh = not self.buf
            content += self.buf
            self.buf = ""
            return reasoning, content

    def _reasoning(self, final: bool) -> tuple[str, bool]:
        if self.fresh:
            self.buf = self.buf.lstrip("\n")
            self.fresh = not self.buf
        i = self.buf.find(CLOSE)
        if i >= 0:
            text, self.buf = self.buf[:i].rstrip("\n"), self.buf[i + len(CLOSE) :]
            self.state, self.fresh = "content", True
            return text, True
        # hold back a part of the closing tag, and newlines that may be the markup before it
        keep = 0 if final else held_back(self.buf, (CLOSE,))
        body = self.buf[: len(self.buf) - keep]
        cut = len(body) if final else len(body.rstrip("\n"))
        self.buf = self.buf[cut:]
        return body[:cut], False
