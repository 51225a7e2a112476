"""The next-token choice for a whole batch.

`make_batch` turns a step's requests (their SamplingParams, hetero.sampling) into a
`SamplingState` of a few device tensors plus host-side flags, and `Sampler` picks one token per
row for the whole batch in one call without a host sync. The distribution a row draws from
(penalties, temperature, top-k/p, min-p) is built in hetero.sampling_filters.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hetero.penalties import PAD_ID
from hetero.rng import gumbel, random_keys, stream_key
from hetero.sampling import SamplingParams
from hetero.sampling_filters import filtered, penalized


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


def _to_device_rows(
    ps: Sequence[SamplingParams], steps: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' per-request numbers in one host buffer, int64 [6, B], moved in one copy:
    rows 0-1 top_k and seed keys; rows 2-4 the float32 [6, B] temperature, top_p, min_p,
    repetition, presence and frequency; row 5's bytes the bools seeded and greedy [B] each.
    Returns (ints [2, B], floats [6, B], seeded, greedy) on the device."""
    b = len(ps)
    host = np.empty((6, b), dtype=np.int64)
    host[:2] = [
        [max(p.top_k, 0) for p in ps],
        [0 if p.seed is None else stream_key(p.seed, s) for p, s in zip(ps, steps, strict=True)],
    ]
    host[2:5].view(np.float32).reshape(6, b)[:] = [
        [1.0 if p.greedy else p.temperature for p in ps],
        [p.top_p for p in ps],
        [p.min_p for p in ps],
        [p.repetition_penalty for p in ps],
        [p.presence_penalty for p in ps],
        [p.frequency_penalty for p in ps],
    ]
    host[5].view(np.bool_)[: 2 * b] = [*(p.seed is not None for p in ps), *(p.greedy for p in ps)]
    dev = _to_device(torch.from_numpy(host), device)
    flags = dev[5].view(torch.bool)
    return dev[:2], dev[2:5].view(torch.float32).view(6, b), flags[:b], flags[b : 2 * b]


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
    ints, floats, seeded, greedy_rows = _to_device_rows(ps, steps, device)
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
        greedy=greedy_rows,
        top_k=ints[0],
        top_p=floats[1],
        min_p=floats[2],
        repetition=floats[3],
        presence=floats[4],
        frequency=floats[5],
        seeded=seeded,
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


class SamplingStates:
    """make_batch for the engine's steps, keeping the last state while it cannot change.

    A step's SamplingState depends on the rows' SamplingParams alone unless a row is seeded
    (its noise keys follow the step), has a logit_bias, is short of its min_tokens (the end
    tokens held back, which depends on the step), uses a penalty (read from token ids that grow
    every step), or the step has an `allowed` mask. While every row is free of those and the
    params (equal objects, in the same order) and the device are the last step's, the last
    state's device tensors are the ones make_batch would build, and are returned again: a
    decode step of steady requests skips the host work and the host-to-device copies.
    """

    def __init__(self) -> None:
        self._params: list[SamplingParams] | None = None
        self._device: torch.device | None = None
        self._state: SamplingState | None = None
        self._min_tokens = False  # a kept row has min_tokens (each step checks it is past)
        self.hits = 0

    def make(
        self,
        params_list: Sequence[SamplingParams],
        prompt_ids_list: Sequence[Sequence[int]],
        output_ids_list: Sequence[Sequence[int]],
        steps: Sequence[int],
        device: torch.device | str,
        allowed: torch.Tensor | None = None,
        eos_ids: Collection[int] = (),
    ) -> SamplingState:
        """make_batch's SamplingState (the same arguments)."""
        device = torch.device(device)
        params = params_list if isinstance(params_list, list) else list(params_list)
        if (
            allowed is None
            and self._state is not None
            and device == self._device
            and len(params) == len(prompt_ids_list) == len(output_ids_list) == len(steps)
            and params == self._params  # each row's object first: equal when the same
            and (not self._min_tokens or all(map(_past_min_tokens, params, steps)))
        ):
            self.hits += 1
            return self._state
        state = make_batch(
            params, prompt_ids_list, output_ids_list, steps, device, allowed, eos_ids
        )  # fmt: skip
        steady = allowed is None and all(map(_steady, params, steps))
        self._state = state if steady else None
        self._params, self._device = (list(params), device) if steady else (None, None)
        self._min_tokens = steady and any(p.min_tokens > 0 for p in params)
        return state


def _past_min_tokens(p: SamplingParams, step: int) -> bool:
    return step >= p.min_tokens


def _steady(p: SamplingParams, step: int) -> bool:
    """Whether the row's part of a SamplingState is the same at every step from this one on
    (while it stays past its min_tokens)."""
    return (
        p.seed is None
        and not p.logit_bias
        and step >= p.min_tokens
        and p.repetition_penalty == 1
        and p.presence_penalty == 0
        and p.frequency_penalty == 0
    )


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
