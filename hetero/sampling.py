"""Sampling parameters: `SamplingParams` is the per-request contract (vLLM's field names and
meanings), checked when it is made. The batch side (make_batch, Sampler) is hetero.sampler; the
distribution a row draws from is built in hetero.sampling_filters; the text side's stop strings
live in `StopChecker`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from hetero.rng import mix64
from hetero.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # the OpenAI API's bound on top_logprobs
MAX_BIAS = 100  # the OpenAI API's bound on a logit_bias value
SEED_RANGE = (-(1 << 63), 1 << 64)  # int64 (the OpenAI API) or uint64 (splitmix64 state)
GREEDY_BELOW = 1e-5  # vLLM's epsilon: smaller temperatures would overflow logits / T


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens (vLLM's `SamplingParams` shape).

    top_k: 0 or -1 turn it off (vLLM accepts both), k >= 1 keeps the k most likely tokens (and
    any tied with the k-th). top_p keeps the smallest set of most likely tokens whose mass is at
    least top_p (after top-k); min_p drops tokens below min_p times the top token's probability.
    All three act on the temperature-scaled distribution. temperature 0 is greedy: exactly the
    argmax of the penalized logits. logprobs (0..20) asks for the sampled token's logprob plus
    that many top alternatives, taken from the model's raw distribution (log-softmax of the
    logits before penalties and temperature: vLLM's default "raw_logprobs" mode).
    logit_bias (OpenAI): token id -> a value in [-100, 100] added to its logit after the
    penalties, before temperature and top-k/p; -100 in effect bans a token, 100 all but forces
    it. min_tokens (vLLM): the end-of-sequence tokens and stop_token_ids cannot be sampled
    before that many output tokens. structured_outputs: the grammar the output must match
    (hetero.structured_outputs).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        self._check_numbers()
        self._check_lists()

    def _check_numbers(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        t = self.temperature
        _check(_is_real(t) and t >= 0, "temperature", "a finite number >= 0", t)
        _check(_is_real(self.top_p) and 0 <= self.top_p <= 1, "top_p", "in [0, 1]", self.top_p)
        k = self.top_k
        _check(_is_int(k) and k >= -1, "top_k", "-1 or 0 (off) or an integer >= 1", k)
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        r = self.repetition_penalty
        _check(_is_real(r) and r > 0, "repetition_penalty", "a finite number > 0", r)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_real(v) and -2 <= v <= 2, name, "in [-2, 2]", v)
        s = self.seed
        ok = s is None or (_is_int(s) and SEED_RANGE[0] <= s < SEED_RANGE[1])
        _check(ok, "seed", "None or an integer in [-2**63, 2**64)", s)
        m = self.max_tokens
        _check(_is_int(m) and m >= 1, "max_tokens", "an integer >= 1", m)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            ok = v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS)
            _check(ok, name, f"None or an integer in [0, {MAX_LOGPROBS}]", v)

    def _check_lists(self) -> None:
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", "a list of non-empty strings", s)
        for t in self.stop_token_ids:
            _check(_is_int(t) and t >= 0, "stop_token_ids", "a list of integers >= 0", t)
        flags = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
        for name in flags:
            _check(isinstance(getattr(self, name), bool), name, "a bool", getattr(self, name))
        m = self.min_tokens
        ok = _is_int(m) and 0 <= m <= self.max_tokens
        _check(ok, "min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]", m)
        bias = self.logit_bias
        ok = bias is None or isinstance(bias, dict)
        _check(ok, "logit_bias", "a dict of token id -> bias", bias)
        for t, v in (bias or {}).items():
            _check(_is_int(t) and t >= 0, "logit_bias", "keyed by token ids >= 0", t)
            ok = _is_real(v) and -MAX_BIAS <= v <= MAX_BIAS
            _check(ok, "logit_bias", f"valued in [-{MAX_BIAS}, {MAX_BIAS}]", v)
        so = self.structured_outputs
        ok = so is None or isinstance(so, StructuredOutputsParams)
        _check(ok, "structured_outputs", "None or a StructuredOutputsParams", so)

    @property
    def greedy(self) -> bool:
        """temperature 0 (or under GREEDY_BELOW, as in vLLM): take the argmax."""
        return self.temperature < GREEDY_BELOW

    def for_sequence(self, index: int) -> SamplingParams:
        """The parameters of the `index`-th of the n sequences of this request (n=1 each).

        Seeded sequences get distinct derived seeds (index 0 keeps the request's seed), so
        n > 1 with a seed gives n different but reproducible samples rather than n copies.
        """
        _check(_is_int(index) and 0 <= index < self.n, "index", f"in [0, {self.n})", index)
        seed = self.seed
        if seed is not None and index > 0:
            seed = mix64(seed ^ mix64(index))
        return replace(self, n=1, seed=seed)
