"""Stop strings over a stream of text increments: the text never shows the stop string."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetero.sampling import _check


@dataclass(frozen=True)
class StopResult:
    text: str  # safe to show now
    stopped: bool  # a stop string completed: the stream is over
    stop: str | None  # which one


class StopChecker:
    """Stop strings over one stream of text increments (the detokenizer's output).

    Text that could still be the start of a stop string is held back until it is decided, so
    the emitted text never shows a stop string or a piece of one (unless
    include_stop_str_in_output, which emits it once it is complete). When several stop strings
    occur, the one that completes first (then the longest) wins, as in a char-by-char stream.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        stop = [stop] if isinstance(stop, str) else list(stop)
        for s in stop:
            _check(isinstance(s, str) and s != "", "stop", "a list of non-empty strings", s)
        self._stop = stop
        self._include = include_stop_str_in_output
        self._pending = ""  # held back: a suffix that is a proper prefix of some stop string
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str) -> StopResult:
        if self._stopped:
            raise ValueError("StopChecker.feed after a stop string completed")
        text = self._pending + delta
        hit = self._first_stop(text)
        if hit is not None:
            start, s = hit
            self._pending, self._stopped = "", True
            return StopResult(text[: start + len(s)] if self._include else text[:start], True, s)
        hold = self._held_suffix(text)
        self._pending = text[len(text) - hold :]
        return StopResult(text[: len(text) - hold], False, None)

    def flush(self) -> str:
        """The held-back text, at the end of the stream (no stop string completed)."""
        text, self._pending = self._pending, ""
        return text

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        return None if best is None else (best[0] + best[1], best[2])

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
