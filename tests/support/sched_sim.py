"""A simulated engine for the scheduler tests.

A KV pool whose slots hold (position, token), written through the block manager's slot mapping
and read back through each request's block table, and a "model" that picks the next token as a
fixed function of the tokens it reads from that pool. So a request's output matches the output
of a plain loop over its own token ids only if its KV was placed, shared, copied, evicted and
recomputed correctly.
"""

from __future__ import annotations

from types import SimpleNamespace

from hetero.engine.block_manager import BlockManager
from hetero.engine.config import SchedulerConfig
from hetero.engine.request import Request, RequestStatus
from hetero.engine.scheduler import Scheduler, SchedulerOutput

VOCAB, EOS = 64, 0


def next_token(seq: list[int]) -> int:
    """The simulated model: a deterministic, order-sensitive function of the whole context."""
    acc = len(seq)
    for t in seq:
        acc = (acc * 1_000_003 + t + 1) % 2_147_483_647
    return acc % VOCAB


def reference(prompt: list[int], outputs: list[int], max_tokens: int, eos: int | None) -> list:
    """What a request must generate: the model applied to its own tokens, no engine."""
    out = list(outputs)
    while len(out) < max_tokens:
        out.append(next_token(prompt + out))
        if out[-1] == eos:
            break
    return out


def params(max_tokens: int, **kw) -> SimpleNamespace:
    return SimpleNamespace(max_tokens=max_tokens, **kw)


class Engine:
    """The scheduler, the block manager and a simulated KV pool and model, stepped together."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        config: SchedulerConfig,
        clock=None,
        windows: tuple[int, ...] = (0,),
    ) -> None:
        """windows: the KV cache groups' windows (engine/kv_groups.py); the first must be 0
        (the model reads the whole context through it)."""
        self.bm = BlockManager(num_blocks, block_size, windows=windows)
        self.sched = Scheduler(config, self.bm, *([clock] if clock is not None else []))
        # (position, token, group) of each slot, the null block's included (never written)
        self.kv: list[tuple[int, int, int] | None] = [None] * ((num_blocks + 1) * block_size)
        self.steps = 0
        self.peak_window_blocks = 0  # the most blocks a window group held for one request

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        out = self._schedule()
        sampled, _ = self._run(out, [])
        finished = self.sched.update(out, sampled)
        self._checked()
        return out, finished

    def _schedule(self) -> SchedulerOutput:
        was_running = {r.request_id for r in self.sched.running}
        out = self.sched.schedule()
        ids = {s.req.request_id for s in out.scheduled}
        assert not ids & {r.request_id for r in out.preempted}
        if out.preempted:  # no admissions in a step short of blocks (they would thrash)
            assert ids <= was_running
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.config.max_num_seqs
        return out

    def _run(self, out: SchedulerOutput, source: list[int]) -> tuple[dict, list[int]]:
        """The step on the simulated pool and model: (request id -> next token, the tokens in
        the order of the producing rows). `source`: what placeholders -1 - i read (an
        overlapped step's samples, Scheduler.advance)."""

        def tokens(req: Request, start: int, end: int) -> list[int]:
            return [source[-1 - t] if t < 0 else t for t in req.tokens(start, end)]

        bs = self.bm.block_size
        gathered = [self.kv[s * bs : (s + 1) * bs] for s, _ in out.copies]
        for (_, d), data in zip(out.copies, gathered, strict=True):
            self.kv[d * bs : (d + 1) * bs] = data
        windows = self.bm.windows
        for s in out.scheduled:  # every KV write of the step lands before any read
            end = s.start_pos + s.num_new_tokens
            for g in range(len(windows)):
                slots = self.bm.slot_mapping(s.req, s.start_pos, end, g)
                for pos, slot in enumerate(slots, start=s.start_pos):
                    self.kv[slot] = (pos, tokens(s.req, pos, pos + 1)[0], g)
        sampled, rows = {}, []
        for s in out.scheduled:
            end = s.start_pos + s.num_new_tokens
            for g, w in enumerate(windows):  # a window group: what the first query sees on
                start = max(0, s.start_pos - w + 1) if w else 0
                seen = [self.kv[slot] for slot in self.bm.slot_mapping(s.req, start, end, g)]
                want = [(p, t, g) for p, t in enumerate(tokens(s.req, start, end), start=start)]
                assert seen == want, s.req
            if s.produces_token:
                rows.append(next_token(tokens(s.req, 0, end)))
                sampled[s.req.request_id] = rows[-1]
        return sampled, rows

    def _checked(self) -> None:
        self.bm.check()
        self.check_scheduler()
        self.steps += 1

    def check_scheduler(self) -> None:
        sched = self.sched
        assert len(sched.running) <= sched.config.max_num_seqs
        assert [r.order for r in sched.running] == sorted(r.order for r in sched.running)
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING and r.num_computed_tokens < r.num_tokens
            for w, table in zip(self.bm.windows, r.block_tables):
                if w:
                    n = len([b for b in table if b != self.bm.null_block])
                    self.peak_window_blocks = max(self.peak_window_blocks, n)
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.block_table == []

    def has_work(self) -> bool:
        return self.sched.has_work()

    def run(self, max_steps: int = 10_000) -> None:
        while self.has_work():
            self.step()
            assert self.steps < max_steps, "the scheduler made no progress"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))


class OverlapEngine(Engine):
    """The engine's overlapped steps (engine/overlap.py): the step before is advanced past
    (placeholders for its tokens), the next is scheduled and run, its placeholders read from
    the step before's samples, and only then is the step before settled with its tokens.

    Between two calls of step() one step has run and waits to be settled (`pending`), as an
    overlapped step is in flight on a device."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.pending: tuple[SchedulerOutput, dict, list[int]] | None = None
        self.wasted = 0  # rows run for requests that had stopped at the step before

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        prev, finished = self.pending, []
        if prev is not None:
            self.sched.advance(prev[0])
        out = self._schedule()
        sampled, rows = self._run(out, [] if prev is None else prev[2])
        if prev is not None:
            finished = self.sched.update(prev[0], prev[1])
            self.wasted += sum(1 for s in out.scheduled if s.produces_token and s.req.is_finished)
        self.pending = (out, sampled, rows) if out.scheduled else None
        self._checked()
        return out, finished

    def has_work(self) -> bool:
        return self.sched.has_work() or self.pending is not None
