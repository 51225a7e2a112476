"""Sampling parameters and the next-token choice.

`SamplingParams` is the per-request contract (vLLM's field names and meanings). `make_batch`
turns a step's requests into a `SamplingState` of a few device tensors plus host-side flags, and
`Sampler` picks one token per row for the whole batch in one call without a host sync. The
distribution a row draws from (penalties, temperature, top-k/p, min-p) is built in
hetero.sampling_filters; the text side's stop strings live in `StopChecker`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import torch

from hetero.penalties import PAD_ID
from hetero.rng import gumbel, mix64, random_keys, stream_key
from hetero.sampling_filters import filtered, penalized
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


@dataclass(frozen=True)
class SamplingState:
    """One step's sampling inputs as device tensors ([B] each unless noted), built by make_batch.

    The bool/int fields after the tensors are host-side summaries, known without a device
    sync, that let the sampler skip work no row of this batch needs.
    """

    temperature: torch.Tensor  # float32; 1.0 on greedy rows, which never divide by it
    greedy: torch.Tensor  # bool
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # float32; 1.0 = off
    min_p: torch.Tensor  # float32; 0.0 = off
    repetition: torch.Tensor  # float32
    presence: torch.Tensor  # float32
    frequency: torch.Tensor  # float32
    seeded: torch.Tensor  # bool
    seed_keys: torch.Tensor  # int64 rng.stream_key(seed, step); 0 on unseeded rows
    prompt_ids: torch.Tensor | None  # [B, Lp] int64, PAD_ID-padded; None: no repetition penalty
    output_ids: torch.Tensor | None  # [B, Lo] int64, PAD_ID-padded; None: no penalties
    num_logprobs: tuple[int | None, ...]  # per row, as requested
    all_greedy: bool
    any_greedy: bool
    max_top_k: int  # largest k of the rows using top-k; 0 = none
    any_top_p: bool
    any_min_p: bool
    any_repetition: bool
    any_presence: bool
    any_frequency: bool
    any_seeded: bool
    all_seeded: bool
    # [B, ceil(V / 32)] int32 packed bits, the tokens each row may take (structured outputs,
    # engine/grammar_mask.py); None: all of them
    allowed: torch.Tensor | None = None
    # logit_bias and min_tokens as one sparse addition: (rows [K], token ids [K], values [K]
    # float32, -inf for a token min_tokens holds back); None: no row has either
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.num_logprobs)

    @property
    def max_logprobs(self) -> int | None:
        """Width of the top-logprobs tensors (None: no row asked for logprobs)."""
        asked = [k for k in self.num_logprobs if k is not None]
        return max(asked) if asked else None


def _padded(rows: list[Sequence[int]]) -> torch.Tensor:
    """Token-id lists -> [B, L] int64 padded with PAD_ID (L = the longest row)."""
    out = torch.full((len(rows), max((len(r) for r in rows), default=0)), PAD_ID)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # pinned + non_blocking: the copy does not wait on queued kernels
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def make_batch(
    params_list: Sequence[SamplingParams],
    prompt_ids_list: Sequence[Sequence[int]],
    output_ids_list: Sequence[Sequence[int]],
    steps: Sequence[int],
    device: torch.device | str,
    allowed: torch.Tensor | None = None,
    eos_ids: Collection[int] = (),
) -> SamplingState:
    """Per-request parameters -> SamplingState, once per step on the host.

    `steps[i]` is the index of the token row i is about to sample (its output length so far),
    which with its seed fixes its random numbers. Token ids may be lists or 1-D int64 CPU
    tensors (an engine that keeps each prompt as a tensor skips the list conversion); they are
    read only for rows that use a penalty. `allowed` ([B, ceil(V / 32)] int32 packed bits, CPU)
    masks each row's choices: the per-request hook of structured outputs (all bits set on free
    rows). `eos_ids`: the tokens min_tokens holds back, beside each row's stop_token_ids.
    """
    b = len(params_list)
    if not b == len(prompt_ids_list) == len(output_ids_list) == len(steps):
        raise ValueError(
            f"make_batch needs one entry per row: {b} params, {len(prompt_ids_list)} prompts, "
            f"{len(output_ids_list)} outputs, {len(steps)} steps"
        )
    if b == 0:
        raise ValueError("make_batch needs at least one request")
    device = torch.device(device)
    ps = params_list
    floats = torch.tensor(
        [
            [1.0 if p.greedy else p.temperature for p in ps],
            [p.top_p for p in ps],
            [p.min_p for p in ps],
            [p.repetition_penalty for p in ps],
            [p.presence_penalty for p in ps],
            [p.frequency_penalty for p in ps],
        ],
        dtype=torch.float32,
    )
    keys = [0 if p.seed is None else stream_key(p.seed, s) for p, s in zip(ps, steps, strict=True)]
    ints = torch.tensor(
        [
            [max(p.top_k, 0) for p in ps],
            keys,
            [p.seed is not None for p in ps],
            [p.greedy for p in ps],
        ],
        dtype=torch.int64,
    )
    floats, ints = _to_device(floats, device), _to_device(ints, device)
    rep = [p.repetition_penalty != 1 for p in ps]
    pen = [
        r or p.presence_penalty != 0 or p.frequency_penalty != 0
        for r, p in zip(rep, ps, strict=True)
    ]
    # Only rows that use a penalty pay for their token ids; None when no row needs them.
    prompts = [ids if r else () for ids, r in zip(prompt_ids_list, rep, strict=True)]
    outputs = [ids if u else () for ids, u in zip(output_ids_list, pen, strict=True)]
    greedy = [p.greedy for p in ps]
    sampled = [p for p in ps if not p.greedy]  # masks and noise matter only on these rows
    return SamplingState(
        temperature=floats[0],
        greedy=ints[3].bool(),
        top_k=ints[0],
        top_p=floats[1],
        min_p=floats[2],
        repetition=floats[3],
        presence=floats[4],
        frequency=floats[5],
        seeded=ints[2].bool(),
        seed_keys=ints[1],
        prompt_ids=_to_device(_padded(prompts), device) if any(rep) else None,
        output_ids=_to_device(_padded(outputs), device) if any(pen) else None,
        num_logprobs=tuple(p.logprobs for p in ps),
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        max_top_k=max((p.top_k for p in sampled if p.top_k > 0), default=0),
        any_top_p=any(p.top_p < 1 for p in sampled),
        any_min_p=any(p.min_p > 0 for p in sampled),
        any_repetition=any(rep),
        any_presence=any(p.presence_penalty != 0 for p in ps),
        any_frequency=any(p.frequency_penalty != 0 for p in ps),
        any_seeded=any(p.seed is not None for p in sampled),
        all_seeded=all(p.seed is not None for p in sampled),
        allowed=None if allowed is None else _to_device(allowed, device),
        bias=_bias(ps, steps, eos_ids, device),
    )


def _bias(
    ps: Sequence[SamplingParams], steps: Sequence[int], eos_ids: Collection[int], device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The rows' logit_bias entries, and -inf on the end tokens of rows under min_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, (p, step) in enumerate(zip(ps, steps)):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            cols += p.logit_bias.keys()
            vals += p.logit_bias.values()
        if step < p.min_tokens:
            ends = set(eos_ids).union(p.stop_token_ids)
            rows += [i] * len(ends)
            cols += ends
            vals += [-math.inf] * len(ends)
    if not rows:
        return None
    idx = _to_device(torch.tensor([rows, cols], dtype=torch.int64), device)
    return idx[0], idx[1], _to_device(torch.tensor(vals, dtype=torch.float32), device)


@dataclass(frozen=True)
class SamplerOutput:
    """Device tensors; the caller moves them to the host once per step."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, sampled token's raw logprob (None: not asked)
    top_ids: torch.Tensor | None  # [B, K] int64, K = max requested logprobs; slice per row
    top_logprobs: torch.Tensor | None  # [B, K] float32, descending


class Sampler:
    """Picks one token per row of a [B, V] logits batch: penalties, temperature, top-k, top-p,
    min-p, then Gumbel-max with counter-based noise (hetero.rng), all in batched torch ops.

    Seeded rows draw noise from (seed, step) alone, so they are reproducible and independent of
    their batch; unseeded rows draw fresh keys from this sampler's own generator (`seed`
    makes that stream reproducible too).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != state.batch_size:
            raise ValueError(f"logits must be [{state.batch_size}, V], got {tuple(logits.shape)}")
        logits = logits.float()
        x = penalized(logits, state)
        if state.all_greedy:
            ids = x.argmax(-1)
        else:
            ids = self._sample(x, state)
            if state.any_greedy:
                ids = torch.where(state.greedy, x.argmax(-1), ids)
        return _with_logprobs(logits, ids, state.max_logprobs)

    def _sample(self, x: torch.Tensor, state: SamplingState) -> torch.Tensor:
        """x [B, V] penalized logits -> [B] sampled ids (greedy rows' ids are discarded)."""
        batch, vocab = x.shape
        x = filtered(x, state)
        return (x + gumbel(self.row_keys(state, x.device), vocab)).argmax(-1)

    def row_keys(self, state: SamplingState, device: torch.device) -> torch.Tensor:
        """[B] int64 noise keys: (seed, step) on seeded rows, fresh ones from `seed` elsewhere."""
        keys = state.seed_keys
        if not state.all_seeded:
            fresh = random_keys(state.batch_size, self._generator(device), device)
            keys = torch.where(state.seeded, keys, fresh) if state.any_seeded else fresh
        return keys


def _with_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int | None) -> SamplerOutput:
    """Logprobs from the raw logits [B, V] (the model's distribution, vLLM's default)."""
    if k is None:
        return SamplerOutput(ids, None, None, None)
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, ids[:, None]).squeeze(1)
    top = logp.topk(k, dim=-1)
    return SamplerOutput(ids, chosen, top.indices, top.values)


def sample_next(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N]; temperature 0 is exactly argmax."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
