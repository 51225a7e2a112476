"""The text side of one sequence: incremental detokenization and stop strings.

The engine core produces token ids; a TextStream per sequence turns them into text deltas that
never hold broken UTF-8 and never show a stop string (unless asked to).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from hetero.detokenizer import IncrementalDetokenizer
from hetero.engine.output import StepOutput, TokenLogprob
from hetero.sampling import SamplingParams
from hetero.stop import StopChecker


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0


class TextStream:
    """Token ids in, text deltas out, for one sequence."""

    def __init__(self, tokenizer, params: SamplingParams, index: int = 0):
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, skip_special=params.skip_special_tokens)
        self.stop = (
            StopChecker(params.stop, params.include_stop_str_in_output) if params.stop else None
        )
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else tokenizer.eos_ids
        )
        self.out = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self.stopped_by_string = False
        self.step_logprobs: list[TokenLogprob] | None = None  # the last step's, of shown tokens
        self._starts: list[int] = []  # where each token's text starts in the text fed to stop
        self._fed = self._shown = 0  # text fed to the stop checker, and shown of it

    @property
    def finished(self) -> bool:
        return self.out.finish_reason is not None

    def add(self, step: StepOutput) -> str:
        """Apply one step; returns the new text. Sets finish_reason when the sequence ends."""
        if self.finished:  # ended by a stop string; the engine's abort echo is ignored
            self.step_logprobs = None
            return ""
        delta = ""
        for token in step.new_token_ids:
            self.out.token_ids.append(token)
            if self.stop is not None:  # only a stop string cuts tokens off
                self._starts.append(self._fed)
            ends_on_token = (
                step.finished and step.finish_reason == "stop" and token in self.stop_ids
            )
            if ends_on_token:
                self.out.stop_reason = token
                if not self.params.include_stop_str_in_output:
                    continue  # the stop token's text is not shown
            delta += self._text(self.detok.add(token))
            if self.stopped_by_string:
                break
        self.step_logprobs = step.logprobs
        if self.out.logprobs is not None and step.logprobs:
            before = len(self.out.logprobs)
            self.out.logprobs.extend(step.logprobs)
            if self.stopped_by_string:  # none for the tokens wholly inside the stop string
                del self.out.logprobs[self._shown_tokens() :]
                self.step_logprobs = self.out.logprobs[before:]
        if step.finished and not self.stopped_by_string:
            delta += self._text(self.detok.flush())
            if self.stop is not None and not self.stopped_by_string:
                delta += self.stop.flush()
            self.out.finish_reason = step.finish_reason
        self.out.text += delta
        return delta

    def _text(self, piece: str) -> str:
        if self.stop is None or self.stopped_by_string:
            return piece if not self.stopped_by_string else ""
        self._fed += len(piece)
        r = self.stop.feed(piece)
        self._shown += len(r.text)
        if r.stopped:
            self.stopped_by_string = True
            self.out.finish_reason, self.out.stop_reason = "stop", r.stop
        return r.text

    def _shown_tokens(self) -> int:
        """How many tokens have text in the shown output (a stop string cut the rest)."""
        return bisect.bisect_left(self._starts, self._shown)
