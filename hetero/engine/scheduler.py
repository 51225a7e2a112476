"""Continuous batching with chunked prefill: which requests compute which tokens this step.

One step, under a budget of max_num_batched_tokens tokens:

  1. running decodes, oldest first: one token each (the budget always covers them, since
     max_num_batched_tokens >= max_num_seqs);
  2. running prompts still being prefilled, oldest first: the next chunk, as much as the budget
     (and long_prefill_token_threshold) leaves;
  3. unless this step preempted someone, waiting requests in FIFO order while the budget and
     max_num_seqs allow, a prompt longer than what is left being cut into a first chunk; with
     admit_wait_ms, new prompts wait while decodes run until the oldest has waited that long or
     enough wait to fill the free seats (arrivals a few ms apart then share one prefill step).

So a long prompt never stalls the running streams: it gets what they leave. Where the engine
replays CUDA graphs for steps with prompt rows, a step that runs decodes also stays within the
largest graph (graph_rows tokens in all): past it the step would run eagerly, and an eager step
costs every running stream several decode steps' time. When the pool has no
block for a running request, the newest running request (latest arrival) is preempted: its KV is
freed and it goes back to the front of the waiting queue, keeping its generated tokens, which are
recomputed with the prompt when it is admitted again (its named blocks stay parked in the prefix
cache, so often little is recomputed). The oldest request can always proceed, since add() refuses
any request that could not fit in the pool alone.

With lower KV tiers, a request whose prefix hit is in RAM or on disk is admitted with its blocks
but not scheduled until the restore fills them (BlockManager.is_loading); the others keep running.
Its parked blocks evicted under pressure move to RAM, so a preempted request usually comes back by
restore rather than recompute (the block manager's cost model picks the faster).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from hetero.engine.advance import Advancing
from hetero.engine.block_manager import BlockManager
from hetero.engine.config import SchedulerConfig
from hetero.engine.request import Request, RequestStatus
from hetero.engine.scheduled import ScheduledRequest, SchedulerOutput


class Scheduler(Advancing):
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock  # the clock of Request.arrival (admit_wait_ms)
        self.held_steps = 0  # steps that ran decodes while new prompts waited (admit_wait_ms)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in arrival order: the newest is last
        self.num_preemptions = 0
        self.graph_rows = 0  # the largest CUDA graph's rows, set by the engine (0: no cap)
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._finished: list[Request] = []  # finished since the last schedule(), not by update()
        self._ending: set[str] = set()  # advanced to their last token: not scheduled again
        # state of the step being built by schedule()
        self._step: dict[str, ScheduledRequest] = {}
        self._budget = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # -- entering and leaving ----------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queue a new request; ValueError if it could never fit the pool or the model."""
        self._validate_new(req)
        self._requests[req.request_id] = req
        self.waiting.append(req)

    def fork(self, parent_id: str, child: Request) -> None:
        """Add child (another choice of parent's prompt) sharing parent's computed KV.

        child must agree with parent on the tokens parent has computed. It joins the running
        batch at once when parent is running and a seat is free; otherwise it waits like a new
        request (and finds parent's full blocks in the prefix cache).
        """
        parent = self._requests.get(parent_id)
        if parent is None:
            raise ValueError(f"no unfinished request {parent_id!r} to fork")
        self._validate_new(child)
        running = parent.status is RequestStatus.RUNNING
        if running and len(self.running) < self.config.max_num_seqs:
            self.block_manager.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self._insert_running(child)
        else:
            self.waiting.append(child)
        self._requests[child.request_id] = child

    def abort(self, request_id: str) -> bool:
        """Finish a request now, whatever its state, freeing its KV; False if it is unknown."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        self._finished.append(req)
        return True

    def _validate_new(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.status is not RequestStatus.WAITING or req.block_table:
            raise ValueError(f"request {req.request_id!r} is not new ({req.status.value})")
        limit = self.config.max_model_len
        if limit is not None and req.num_tokens >= limit:
            raise ValueError(
                f"request {req.request_id!r}: {req.num_tokens} prompt tokens leave no room to "
                f"generate within max_model_len {limit}"
            )
        need = req.num_prompt_tokens + req.max_tokens
        if limit is not None:
            need = min(need, limit)
        bm = self.block_manager
        blocks = bm.blocks_needed(need, self.step_tokens)
        if blocks > bm.num_blocks:
            raise ValueError(
                f"request {req.request_id!r}: {req.num_prompt_tokens} prompt tokens + "
                f"max_tokens {req.max_tokens} need {need} tokens of KV "
                f"({blocks} blocks) but the whole pool holds "
                f"{bm.max_tokens(self.step_tokens, need)} tokens ({bm.num_blocks} blocks)"
            )

    @property
    def step_tokens(self) -> int:
        """The most tokens one request computes in a step (its longest prompt chunk)."""
        cap = self.config.long_prefill_token_threshold
        budget = self.config.max_num_batched_tokens
        return min(budget, cap) if cap > 0 else budget

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.status = status
        del self._requests[req.request_id]
        self._ending.discard(req.request_id)

    def _insert_running(self, req: Request) -> None:
        bisect.insort(self.running, req, key=lambda r: r.order)

    # -- one step ------------------------------------------------------------------------------

    def decoding(self) -> list[Request]:
        """Running requests whose next step is a plain decode (the ones that may speculate)."""
        return [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]

    def schedule(self, spec: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """spec: speculative tokens per request id, for requests in decoding() (see spec/)."""
        self._step, self._budget = {}, self.config.max_num_batched_tokens
        out = SchedulerOutput()
        decodes = self.decoding()
        if self._ending:
            decodes = [r for r in decodes if r.request_id not in self._ending]
        if decodes and self.graph_rows:
            self._budget = min(self._budget, max(self.graph_rows, len(decodes)))
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if self._budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            if self.block_manager.is_loading(req):  # its prefix is still being restored
                continue
            n = self._chunk(req, req.num_computed_tokens)
            if self._reserve(req, n, out):
                self._put(req, req.num_computed_tokens, n)
        if not out.preempted and not self._holding():
            self._admit(out)
        if spec:
            self._speculate(spec)
        out.scheduled = list(self._step.values())
        out.copies = self.block_manager.take_copies()
        out.finished, self._finished = self._finished, []
        self._step = {}
        return out

    def _chunk(self, req: Request, start: int) -> int:
        """Tokens req may compute this step from `start`: all it has, capped by the budget."""
        n = min(req.num_tokens - start, self._budget)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap > 0 else n

    def _put(self, req: Request, start: int, n: int, spec: tuple[int, ...] = ()) -> None:
        self._step[req.request_id] = ScheduledRequest(
            req=req,
            num_new_tokens=n,
            start_pos=start,
            is_prefill_chunk=n > 1 or start < req.num_prompt_tokens,
            produces_token=start + n == req.num_tokens + len(spec),
            spec_ids=spec,
        )
        self._budget -= n

    def _speculate(self, spec: dict[str, list[int]]) -> None:
        """Extend this step's plain decodes by their guesses, with what the budget has left
        after decodes, prefill chunks and admissions (guesses are the most expendable work).

        Guesses never preempt anyone: without free blocks a request decodes plainly. Nor do
        they pass max_tokens or max_model_len: a step appends at most 1 + len(guess) tokens.
        """
        limit = self.config.max_model_len
        for rid, guess in spec.items():
            s = self._step.get(rid)
            if self._budget == 0 or s is None or s.is_prefill_chunk:
                continue
            req = s.req
            room = min(self._budget, req.max_tokens - len(req.output_ids) - 1)
            if limit is not None:
                room = min(room, limit - req.num_tokens - 1)
            guess = guess[: max(room, 0)]
            if guess and self.block_manager.append_slots(req, 1 + len(guess)):
                self._budget += 1  # _put charges the decode's own token again
                self._put(req, s.start_pos, 1 + len(guess), tuple(guess))

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Slots for req's n tokens, preempting the newest running requests until they fit.

        False when req itself was the newest and got preempted (or failed: see below).
        """
        while not self.block_manager.append_slots(req, n):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1 and not self._blocks_held_elsewhere():
                # Alone with the whole pool and still short: only a request add() should have
                # refused gets here. Fail it rather than preempt and retry forever.
                req.error = f"needs more KV blocks than the pool's {self.block_manager.num_blocks}"
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                self._finished.append(req)
                return False
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _blocks_held_elsewhere(self) -> bool:
        """Whether requests outside self.running hold blocks (a pipeline's other micro-batches,
        hetero/engine/microbatch.py): then a request short of blocks waits instead of failing."""
        return False

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        cancelled = self._step.pop(victim.request_id, None)
        if cancelled is not None:  # scheduled earlier in this step: give its tokens back
            self._budget += cancelled.num_new_tokens
        self.block_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def _holding(self) -> bool:
        """Whether new prompts wait this step (admit_wait_ms): decodes are scheduled, the head
        of the queue is new (not preempted), it has waited less than admit_wait_ms, and fewer
        prompts wait than there are free seats."""
        wait = self.config.admit_wait_ms / 1e3
        if wait <= 0 or not self.waiting or not self._step:
            return False
        head = self.waiting[0]
        if head.num_preemptions or self.clock() - head.arrival >= wait:
            return False
        if len(self.waiting) >= self.config.max_num_seqs - len(self.running):
            return False
        self.held_steps += 1
        return True

    def _admit(self, out: SchedulerOutput) -> None:
        """Admit waiting requests in FIFO order while budget, seats and blocks last."""
        bm = self.block_manager
        while self.waiting and self._budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if bm.fetching(req):  # its prefix is being read from disk: the head waits for it
                break
            hit = bm.cached_prefix_len(req)
            n = self._chunk(req, hit)
            if not bm.allocate(req, n):
                if not self.running and not self._blocks_held_elsewhere():  # pool all free
                    req.error = f"needs more KV blocks than the pool's {bm.num_blocks}"
                    self._finish(req, RequestStatus.FINISHED_ABORTED)
                    self._finished.append(req)
                    continue
                break  # head of line waits: FIFO, no overtaking by smaller prompts
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.admitted is None:  # its timeline's end of queueing (engine/timeline.py)
                req.admitted = time.perf_counter()
            self._insert_running(req)
            if not bm.is_loading(req):  # else it runs once its restored prefix is in place
                self._put(req, req.num_computed_tokens, n)

    # -- after the step --------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """Apply a computed step: advance KV, append sampled tokens, finish and free requests.

        sampled maps request_id -> next token for each scheduled request whose step produced a
        token (produces_token); other keys are ignored. A request that speculated gets a list:
        its accepted guesses and the token after them (1 .. 1 + len(spec_ids) tokens); the KV
        of rejected guesses is dropped. Requests aborted since schedule() are skipped. Returns
        the requests this step finished.
        """
        if output.advanced:
            return self._settle(output, sampled)
        live = [s for s in output.scheduled if s.req.status is RequestStatus.RUNNING]
        missing = [
            s.req.request_id for s in live if s.produces_token and s.req.request_id not in sampled
        ]
        if missing:
            raise ValueError(f"no sampled token for {missing}")
        finished = []
        for s in live:
            req = s.req
            if req.num_computed_tokens != s.start_pos:
                raise RuntimeError(
                    f"request {req.request_id!r}: step applied twice or out of order"
                )
            if not s.produces_token:
                req.num_computed_tokens += s.num_new_tokens
                self.block_manager.commit(req)
                continue
            status = self._append(req, s, sampled[req.request_id])
            self.block_manager.commit(req)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
            elif s.spec_ids:
                self.block_manager.trim(req, req.num_tokens)
        return finished

    def _stops(self, req: Request, token: int) -> RequestStatus | None:
        """The finished status that `token` (just appended) brings req to, if any: a stop,
        its max_tokens, or the model's length."""
        status = req.stops_at(token)
        limit = self.config.max_model_len
        if status is None and limit is not None and req.num_tokens >= limit:
            return RequestStatus.FINISHED_LENGTH
        return status

    def _append(self, req: Request, s: ScheduledRequest, tokens: int | list[int]):
        """Append a step's tokens, up to the first that finishes req (the rest are dropped);
        advance num_computed_tokens over the KV that holds accepted tokens only."""
        tokens = [tokens] if isinstance(tokens, int) else tokens
        if not 1 <= len(tokens) <= 1 + len(s.spec_ids):
            raise ValueError(
                f"request {req.request_id!r}: {len(tokens)} tokens for a step with "
                f"{len(s.spec_ids)} guesses (1 .. {1 + len(s.spec_ids)} expected)"
            )
        status, taken = None, 0
        for token in tokens:
            req.output_ids.append(token)
            taken += 1
            status = self._stops(req, token)
            if status is not None:
                break
        # KV is valid for the last token and the taken tokens but the newest one (computed next)
        req.num_computed_tokens = s.start_pos + s.num_new_tokens - len(s.spec_ids) + taken - 1
        return status
