"""The engine core: schedule -> execute -> sample -> update, one step at a time, over token ids.

The engine keeps the scheduler, the block manager, the sampler and speculation; an Executor
(engine/executor.py) runs the model, on one device or as a pipeline of stages, and the engine
does not know which. Text lives at the edges (the server, hetero/text_stream.py); here
everything is integer ids. `hetero.launch.build_engine` builds an engine from options.

Each step keeps every micro-batch group busy (one group when the executor runs one step at a
time): groups with no step in flight are scheduled and submitted, then the oldest step in flight
is collected, sampled and applied. With overlapped steps (engine/overlap.py: one group, the
engine sampling, no guesses to verify; by default on a GPU) the step in flight is sampled on
the device and the next one submitted before the host waits for its tokens.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from hetero.engine.block_manager import BlockManager
from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.engine.executor import (
    Executor,
    ExecutorFailure,
    ModelOutput,
    SampleRow,
    Step,
    StepSampling,
)
from hetero.engine.grammar_mask import Constraints
from hetero.engine.microbatch import MicroBatchScheduler
from hetero.engine.output import StepOutput, final_output, row_outputs
from hetero.engine.overlap import sample_on_device, settled_tokens
from hetero.engine.request import Request
from hetero.engine.scheduler import Scheduler, SchedulerOutput
from hetero.engine.spec import make_speculator
from hetero.engine.spec.speculator import fit_rows
from hetero.engine.stats import EngineGauges, EngineStats, gauges
from hetero.engine.step_sampling import sample_logits
from hetero.engine.timeline import Timelines
from hetero.sampler import Sampler, SamplingStates

if TYPE_CHECKING:
    from hetero.config import ModelConfig


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        model_config: ModelConfig,
        tokenizer,
        draft: Executor | None = None,
    ):
        """`draft`: the draft model's executor, for speculative decoding with a draft model."""
        self.config = config
        self.executor = executor
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.params: dict[str, object] = {}  # request id -> SamplingParams, while it runs
        self.constraints = Constraints(tokenizer, model_config.vocab_size)
        self.spec = make_speculator(config, executor.info, self.params, draft)
        self.sampler = Sampler(config.seed)
        self.stats = EngineStats()
        self.timelines = Timelines(config.trace_steps)
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        """Block manager and scheduler over the executor's pool, and an empty cache of sampling
        states (again after a restart)."""
        info, cfg = self.executor.info, self.config
        self.sampling_states = SamplingStates()  # the steps' SamplingState, kept while steady
        tiers = self.executor.kv_tiers
        self.block_manager = BlockManager(
            info.num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            tiers=None if tiers is None else tiers.tiers,
            windows=info.kv_windows,
        )
        self.num_groups = info.max_in_flight
        sc = self._scheduler_config()
        if self.num_groups == 1:
            self.scheduler = Scheduler(sc, self.block_manager)
        else:
            self.scheduler = MicroBatchScheduler(sc, self.block_manager, self.num_groups)
        if info.prompt_graphs:  # steps beside running decodes stay within the largest graph
            self.scheduler.graph_rows = info.graph_rows
        self._inflight: deque[tuple[int, SchedulerOutput, float, list | None]] = deque()
        self._next_step = 0
        self._last_done = time.perf_counter()
        self.overlap = self._overlaps()
        self._guessing = False  # the last settled step found guesses: steps run plain
        self._proposal: tuple[int, dict | None] | None = None  # (after step, its guesses)

    def _overlaps(self) -> bool:
        """Whether steps overlap (engine/overlap.py): the engine samples, one step at a time;
        with n-gram speculation only while no request has a guess; "auto" where the logits are
        on a GPU."""
        mode, info = self.config.overlap_schedule, self.executor.info
        able = self.num_groups == 1 and not info.samples
        able = able and (self.spec is None or self.spec.cheap_proposals)
        if mode == "on" and not able:
            raise ValueError(
                "overlap_schedule 'on' needs an executor whose logits the engine samples (one "
                "device, or a GPU with the CPU; not a pipeline of stages) and no draft model"
            )
        return able and (mode == "on" or (mode == "auto" and info.device.startswith("cuda")))

    def _scheduler_config(self) -> SchedulerConfig:
        sched = self.config.scheduler
        if sched.max_model_len is None:
            sched = SchedulerConfig(**{**sched.__dict__, "max_model_len": self.max_model_len})
        return sched

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len or self.model_config.context_length

    @property
    def kv_tiers(self):
        return self.executor.kv_tiers

    def describe_kv(self) -> str:
        return self.executor.info.description

    def close(self) -> None:
        """Release what the executor holds (stage processes); nothing else is held."""
        self.executor.close()

    def save_kv_cache(self) -> int:
        """Write the named KV blocks to the disk tier for the next start (0 without one)."""
        tiers = self.executor.kv_tiers
        return 0 if tiers is None else tiers.persist(self.block_manager)

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params) -> None:
        if request_id in self.params:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                f"{self.max_model_len} tokens (room is needed for at least one output token)"
            )
        # ids past the tokenizer's vocabulary (padding rows of the logits) have no text
        check_token_ids(
            prompt_ids, params, min(self.model_config.vocab_size, self.tokenizer.vocab_size)
        )
        self.constraints.add(request_id, params)  # a grammar that does not compile refuses here
        req = Request(request_id, prompt_ids, params, eos_token_id=self.tokenizer.eos_ids)
        req.timeline = self.timelines.new()
        self.scheduler.add(req)
        self.params[request_id] = params

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks (no-op for an unknown or finished one)."""
        found = self.scheduler.abort(request_id)
        self._forget(request_id)
        return found

    def _forget(self, request_id: str) -> None:
        self.params.pop(request_id, None)
        if self.spec is not None:
            self.spec.forget(request_id)
        self.constraints.drop(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    def embed(self, prompts: list[list[int]]):
        """[N, C] float32 embeddings of token-id prompts, pooled as the model's GGUF says; a
        forward of the executor's own, which takes no KV blocks from generation (ValueError for
        a prompt it cannot take, or an executor that does not serve them)."""
        return self.executor.embed(prompts)

    def cached_prompt_tokens(self, request_id: str) -> int:
        req = self.scheduler.get(request_id)
        return 0 if req is None else req.num_cached_tokens

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        results: dict[str, StepOutput] = {}
        if self.overlap and (not self._guessing or self._inflight):
            # (guesses found: the step in flight is settled first, the next runs plain)
            self._overlapped_step(results, submit=not self._guessing)
            return list(results.values())
        try:
            self._fill(results)
            if self._inflight:
                self._complete_oldest(results)
            elif self.executor.kv_tiers is not None:  # only restores pending: wait, not spin
                self.executor.kv_tiers.idle(self.block_manager)
        except ExecutorFailure as e:
            self._recover(e, results)
        return list(results.values())

    def _overlapped_step(self, results: dict[str, StepOutput], submit: bool = True) -> None:
        """Sample the step in flight on the device and advance past it, submit the next step
        (its rows read the samples there), then settle the sampled step on the host. Without
        `submit`, only the step in flight: sampled and settled (its requests may have been
        aborted since it was submitted: their rows are dropped)."""
        sampled = None
        if self._inflight:
            _, out, started, params = self._inflight.popleft()
            sampled = sample_on_device(
                self.executor.collect(), out, params, started, self.constraints, self.sampler,
                self.sampling_states, self.tokenizer.eos_ids,
            )  # fmt: skip
            if submit:
                self.scheduler.advance(out)
        if submit:
            self._fill(results, None if sampled is None else sampled.ids, guess=False)
        if sampled is not None:
            tokens = settled_tokens(sampled, results)
            self._accept(sampled.producing, tokens)
            self._applied(sampled.out, sampled.res, sampled.started, tokens, results, sampled.ready)
            self.stats.overlapped += submit
        elif not self._inflight and self.executor.kv_tiers is not None:
            self.executor.kv_tiers.idle(self.block_manager)

    def _fill(self, results: dict[str, StepOutput], token_source=None, guess=True) -> None:
        """Schedule and submit every group that has no step in flight (`token_source`: the
        samples an advanced step's placeholders index, on the device; `guess`: with the
        speculator's guesses, which an advanced step's placeholders leave none to make)."""
        busy = {g for g, _, _, _ in self._inflight}
        for g in range(self.num_groups):
            if g in busy:
                continue
            out = self._schedule(g, guess)
            for req in out.finished:  # failed by the scheduler (e.g. cannot fit)
                self._forget(req.request_id)
                results[req.request_id] = final_output(req)
            if not out.scheduled:
                continue
            sampling = self._sampling(out) if self.executor.info.samples else None
            out.token_source = token_source
            started = time.perf_counter()
            self.executor.submit(Step(self._next_step, out, sampling))
            params = None  # the rows' params as submitted, for an overlapped step's sampling
            if self.overlap:
                params = [self.params[s.req.request_id] for s in out.scheduled if s.produces_token]
            self._inflight.append((g, out, started, params))
            self._next_step += 1

    def _schedule(self, group: int, guess: bool = True) -> SchedulerOutput:
        if self.num_groups > 1:
            return self.scheduler.schedule_group(group)
        tiered = self.executor.kv_tiers
        guesses = self._proposed() if guess else None
        if tiered is not None:
            tiered.before_schedule(self.block_manager)
        out = self.scheduler.schedule(guesses)
        if tiered is not None:
            tiered.after_schedule()  # offloads and restores the schedule queued
        return out

    def _sampling(self, out: SchedulerOutput) -> StepSampling:
        """The rows an executor that samples needs: one per token-producing request. A request
        has one step in flight at most, so its constraint mask now is the one for this token."""
        producing = [s.req for s in out.scheduled if s.produces_token]
        rows = []
        for r in producing:
            p = self.params[r.request_id]
            rep = p.repetition_penalty != 1
            pen = rep or p.presence_penalty != 0 or p.frequency_penalty != 0
            prompt, output = r.prompt_ids if rep else (), r.output_ids if pen else ()
            rows.append(SampleRow(p, prompt, output, len(r.output_ids)))
        allowed = self.constraints.masks([r.request_id for r in producing]) if rows else None
        return StepSampling(rows, allowed, tuple(self.tokenizer.eos_ids))

    def _complete_oldest(self, results: dict[str, StepOutput]) -> None:
        _, out, started, _ = self._inflight.popleft()
        res = self.executor.collect()
        producing = [s for s in out.scheduled if s.produces_token]
        sampled = self._take(res, producing, results)
        self._applied(out, res, started, sampled, results)

    def _applied(
        self, out, res: ModelOutput, started: float, sampled, results, done: float | None = None
    ) -> None:
        """The scheduler's update with a step's tokens, then the step's stats and the
        finished requests' last outputs. `done`: when the step's tokens were there (an
        overlapped step's time ends then; by default now)."""
        before = [(s.req, len(s.req.output_ids)) for s in out.scheduled if s.spec_ids]
        finished = self.scheduler.update(out, sampled)
        for req, n in before:  # a stop among accepted guesses drops the tokens after it
            o = results[req.request_id]
            kept = len(req.output_ids) - n
            del o.new_token_ids[kept:]
            if o.logprobs is not None:
                del o.logprobs[kept:]
        now = time.perf_counter() if done is None else done
        seconds = now - max(started, self._last_done)
        self._last_done = now
        self.stats.record(out, seconds, res.graphed, res.stages)
        self.timelines.observe(self.stats.steps, out, started, seconds, res.stages, sampled)
        if self.spec is not None:
            self.spec.observe(out, sampled, finished)
            if self.overlap:  # steps overlap again once no request has a guess
                guesses = self._guesses()
                self._guessing = bool(guesses)
                self._proposal = (self.stats.steps, guesses)
        if self.executor.kv_tiers is not None:
            self.executor.kv_tiers.step_done(out.num_batched_tokens, seconds)
        for req in finished:
            o = results[req.request_id]
            o.finished, o.finish_reason = True, req.finish_reason
            o.timeline = Timelines.finish(req)
            self._forget(req.request_id)

    def _take(self, res: ModelOutput, producing, results) -> dict[str, list[int]]:
        """Each producing request's new tokens: sampled here from the logits, or taken from the
        executor's samples (one per row it was sent, aborted requests' rows skipped)."""
        if not producing:
            return {}
        if res.logits is not None:
            sampled = sample_logits(
                res.logits, producing, self.params, self.constraints, self.sampler,
                self.sampling_states, self.spec, self.tokenizer.eos_ids, results,
            )  # fmt: skip
        else:  # (a request aborted while its step was in flight: its row dropped)
            s = res.sampled
            params = [self.params.get(sr.req.request_id) for sr in producing]
            sampled = row_outputs(producing, params, s.token_ids, s.logprobs, s.top, results)
        self._accept(producing, sampled)
        return sampled

    def _accept(self, producing, sampled: dict[str, list[int]]) -> None:
        """Each request's grammar advanced by its new tokens: a completed constraint (a JSON
        object) ends its request now."""
        for sr in producing:
            rid = sr.req.request_id
            for token in sampled.get(rid, ()):
                sr.req.stop_now = self.constraints.accept(rid, token)

    def _proposed(self) -> dict[str, list[int]] | None:
        """_guesses(), or the ones found right after the last step where no token came since
        (a plain step, nothing in flight): the lookup once a step."""
        kept, self._proposal = self._proposal, None
        if kept is not None and kept[0] == self.stats.steps and not self._inflight:
            return kept[1]
        return self._guesses()

    def _guesses(self) -> dict[str, list[int]] | None:
        """Speculative tokens of the decoding requests (none for constrained ones, whose mask
        follows the grammar one accepted token at a time)."""
        if self.spec is None:
            return None
        decoding = self.scheduler.decoding()
        limit = self.spec.max_decodes
        if limit is not None and len(decoding) > limit:
            return None  # "auto": a full batch keeps the device busy without guesses
        free = [r for r in decoding if not self.constraints.has(r.request_id)]
        guesses = self.spec.propose(free)
        rows = self.executor.info.graph_rows
        if not rows:
            return guesses
        # a step of more rows than the largest graph would run eagerly (several times slower)
        return fit_rows(guesses, rows - len(decoding))

    # -- failure and gauges --------------------------------------------------------------------

    def _recover(self, err: ExecutorFailure, results: dict[str, StepOutput]) -> None:
        """Fail every unfinished request with the reason, then restart the executor (it raises
        when it gives up) over fresh KV pools."""
        sched = self.scheduler
        for req in list(sched.running) + list(sched.waiting):
            results[req.request_id] = final_output(req, error=str(err))
            self._forget(req.request_id)
        self.executor.restart()
        self.restarts += 1
        self._start()

    def gauges(self) -> EngineGauges:
        """The engine's queues, pool and counters now (the server's /metrics formats them)."""
        return gauges(self)


def check_token_ids(prompt_ids: list[int], params, vocab: int) -> None:
    """ValueError unless the prompt's, logit_bias's and stop_token_ids' ids are in [0, vocab)."""
    for name, ids in (
        ("prompt token ids", prompt_ids),
        ("logit_bias token ids", params.logit_bias or ()),
        ("stop_token_ids", params.stop_token_ids),
    ):
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"{name} must be in [0, {vocab})")
