"""Per-request speculation control: how many tokens to propose, how long a match to trust, and
when to stop guessing because the guesses do not pay.

A verified step costs about the same as a plain decode when few tokens are proposed (decoding
is memory bound), but a rejected guess still costs its rows of the batch. So each request keeps
an estimate of its recent acceptance rate and:
  - k (tokens proposed) grows after a step whose guesses were all accepted and shrinks to what
    was accepted (+1) after a rejection, within [k_min, k_max] (k_min = k_max where a step's
    rows cost the same up to its graph bucket: on CUDA, spec/__init__.py);
  - the shortest n-gram trusted grows by one while acceptance is poor (short matches are the
    unreliable ones) and returns to min_n when it recovers;
  - after `probe_rounds` verified steps with acceptance under `off_below`, or with fewer
    accepted tokens per verified step than `min_gain` on average, speculation switches off for
    the request for `backoff` decode steps, then probes again (backoff doubling each time it
    fails, up to `max_backoff`).

min_gain prices the verified step: where it costs c plain steps, it pays only while it yields
more than c tokens, i.e. more than c - 1 accepted guesses (0 on a CPU, whose extra rows cost in
proportion; on a GPU a one-stream step with guesses leaves the GEMV kernels for the tensor-core
ones, spec/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptConfig:
    k_max: int = 8
    k_min: int = 1  # the fewest tokens proposed after a rejection
    min_n: int = 2
    max_n: int = 4
    ema: float = 0.3  # weight of the newest step in the acceptance estimate
    poor_below: float = 0.4  # acceptance under which matches must be one token longer
    off_below: float = 0.15  # acceptance under which speculation switches off for a while
    probe_rounds: int = 4  # verified steps before the off-switch may trip
    backoff: int = 16  # decode steps without speculation after the first trip
    max_backoff: int = 512
    min_gain: float = 0.0  # accepted guesses a verified step must average to keep guessing


class SpecState:
    """One request's speculation controller (pure Python, no engine state)."""

    __slots__ = ("cfg", "k", "acceptance", "gain", "rounds", "steps", "off_until", "backoff")

    def __init__(self, cfg: AdaptConfig) -> None:
        self.cfg = cfg
        self.k = _start_k(cfg)  # start moderate: a first guess is often a short match
        self.acceptance = 0.5  # neutral prior
        self.gain = 1.0  # accepted guesses per verified step (estimate; a neutral prior)
        self.rounds = 0  # verified steps since the last (re)probe
        self.steps = 0  # decode steps seen
        self.off_until = 0  # speculation is off while steps < off_until
        self.backoff = cfg.backoff

    @property
    def active(self) -> bool:
        return self.steps >= self.off_until

    @property
    def min_n(self) -> int:
        poor = self.acceptance < self.cfg.poor_below
        return min(self.cfg.min_n + int(poor), self.cfg.max_n)

    def observe(self, proposed: int, accepted: int) -> None:
        """One decode step's result: `accepted` of the `proposed` guesses were right."""
        self.steps += 1
        if proposed == 0:
            return
        c = self.cfg
        self.rounds += 1
        self.acceptance += c.ema * (accepted / proposed - self.acceptance)
        self.gain += c.ema * (accepted - self.gain)
        shrunk = max(c.k_min, accepted + 1)
        self.k = min(c.k_max, self.k + 2 if accepted == proposed else shrunk)
        poor = self.acceptance < c.off_below or self.gain < c.min_gain
        if self.rounds >= c.probe_rounds and poor:
            self.off_until = self.steps + self.backoff
            self.backoff = min(2 * self.backoff, c.max_backoff)
            self.rounds, self.acceptance, self.gain, self.k = 0, 0.5, 1.0, _start_k(c)


def _start_k(cfg: AdaptConfig) -> int:
    return min(max(4, cfg.k_min), cfg.k_max)
