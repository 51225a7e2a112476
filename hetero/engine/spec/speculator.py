"""The engine's speculation hook: guesses before schedule(), bookkeeping after update().

    guesses = speculator.propose(scheduler.decoding())   # rid -> up to k tokens
    out = scheduler.schedule(guesses)                     # 1 + k tokens per guessing decode
    logits = runner.run(out)                              # 1 + k rows per guessing decode
    tokens = verify (spec/verify.py)                      # accepted guesses + one more
    scheduler.update(out, tokens)                         # rejected KV slots dropped
    speculator.observe(out, tokens, finished)             # adapt k, n, the off-switch

Counters `proposed` and `accepted` (tokens) feed /metrics and `hetero bench`.
"""

from __future__ import annotations

from hetero.engine.request import Request
from hetero.engine.scheduler import SchedulerOutput
from hetero.engine.spec.adapt import AdaptConfig, SpecState
from hetero.engine.spec.ngram import NgramCache, NgramIndex
from hetero.engine.spec.verify import accept_rows


def fit_rows(guesses: dict[str, list[int]], room: int) -> dict[str, list[int]]:
    """At most `room` guessed tokens in all, the first requests' guesses kept whole (a verify
    step's rows must fit the largest decode graph: engine._guesses)."""
    out = {}
    for rid, guess in guesses.items():
        if room <= 0:
            break
        out[rid] = guess[:room]
        room -= len(out[rid])
    return out


class Speculator:
    """Bookkeeping shared by the proposers: per-request control and the counters."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.adapt = AdaptConfig(k_max=num_speculative_tokens)
        self.states: dict[str, SpecState] = {}
        self.proposed = 0  # guessed tokens sent to verification
        self.accepted = 0  # of them, tokens the target accepted
        self.steps = 0  # verification steps (requests x steps that carried guesses)
        self.max_decodes: int | None = None  # guess only while at most this many decode
        # proposals cost little host time (n-grams; a draft model's cost a forward pass): the
        # engine may ask after every step whether there would be any (overlapped steps run
        # while there are none)
        self.cheap_proposals = True

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def active(self, requests: list[Request]) -> list[tuple[Request, SpecState]]:
        """The requests whose controller lets them guess this step."""
        out = []
        for req in requests:
            state = self.states.get(req.request_id)
            if state is None:
                state = self.states[req.request_id] = SpecState(self.adapt)
            if state.active:
                out.append((req, state))
        return out

    def accept(self, producing, spans, ids, logits, state, sampler) -> list[list[int]]:
        """Each request's tokens from its rows' plain samples (point-mass guesses)."""
        return accept_rows(producing, spans, ids)

    def observe(
        self, out: SchedulerOutput, tokens: dict[str, list[int]], finished: list[Request]
    ) -> None:
        """After update(): how many guesses each request had accepted; learn from the ended."""
        for s in out.scheduled:
            state = self.states.get(s.req.request_id)
            if state is None or not s.produces_token:
                continue
            got = tokens.get(s.req.request_id)
            accepted = 0 if got is None else len(got) - 1
            state.observe(len(s.spec_ids), accepted)
            if s.spec_ids:
                self.proposed += len(s.spec_ids)
                self.accepted += accepted
                self.steps += 1
        for req in finished:
            self.finish(req)

    def finish(self, req: Request) -> None:
        self.forget(req.request_id)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)


class NgramSpeculator(Speculator):
    """Prompt lookup over each request's own tokens, then over the engine's n-gram cache."""

    def __init__(self, num_speculative_tokens: int, cache_capacity: int = 200_000) -> None:
        super().__init__(num_speculative_tokens)
        a = self.adapt
        self.cache = NgramCache(a.min_n, a.max_n, a.k_max, cache_capacity)
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        guesses = {}
        for req, state in self.active(requests):
            guess = self._lookup(req, state)
            if guess:
                guesses[req.request_id] = guess
        return guesses

    def _lookup(self, req: Request, state: SpecState) -> list[int]:
        index = self.indexes.get(req.request_id)
        if index is None:
            index = self.indexes[req.request_id] = NgramIndex(self.adapt.min_n, self.adapt.max_n)
        ids = req.all_ids
        index.extend(ids)
        return index.lookup(ids, state.k, state.min_n) or self.cache.lookup(
            ids, state.k, state.min_n
        )

    def finish(self, req: Request) -> None:
        """A request ended: its n-grams join the engine-wide cache (not an aborted one's)."""
        if req.request_id in self.states and req.finish_reason != "abort":
            self.cache.add(req.all_ids)
        self.forget(req.request_id)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self.indexes.pop(request_id, None)
