"""The engine over a pipeline of stage processes: same requests, same outputs, layers elsewhere.

The scheduler and block manager stay here. Each step() keeps every micro-batch group busy:
groups whose last step has come back are scheduled and submitted, then the oldest step in
flight is awaited and applied. All stages share one block table per request, so the block
manager gets the smallest stage's block count (each stage sizes its pool from its own memory;
the log shows every stage's capacity, which is what a better layer split would even out).

A failed stage fails every unfinished request with the reason, and the pipeline is started
again (up to max_restarts times, then the engine raises).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque

from hetero.config import RuntimeConfig
from hetero.dist.microbatch import MicroBatchScheduler
from hetero.dist.pipeline import Pipeline, StageFailure
from hetero.dist.stages import resolve_stages
from hetero.dist.step import StepPlan
from hetero.engine.block_manager import BlockManager
from hetero.engine.config import EngineConfig
from hetero.engine.engine import Engine, EngineStats, StepOutput, token_output
from hetero.engine.grammar_mask import Constraints
from hetero.engine.request import RequestStatus
from hetero.engine.scheduler import SchedulerOutput
from hetero.models import resolve_model

log = logging.getLogger("hetero.dist")


class PipelineEngine(Engine):
    def __init__(
        self,
        model: str | None = None,
        config: EngineConfig | None = None,
        runtime: RuntimeConfig | None = None,
        progress: bool = False,
        loaded=None,
    ):
        from hetero.gguf_loader import load_gguf
        from hetero.tokenizer import Tokenizer

        if loaded is not None:
            raise ValueError(
                "a pipeline loads its layers in its stage processes: it cannot share a model "
                "loaded in this process (drop `loaded`, or drop devices/split/plan)"
            )
        self.config = config or EngineConfig()
        self.runtime = runtime or RuntimeConfig()
        self.model_path = resolve_model(model)
        self.gguf = load_gguf(self.model_path)  # metadata and tokenizer only: weights are mapped
        self.model_config = self.gguf.config
        self.tokenizer = Tokenizer.from_gguf(self.gguf.reader)
        pc = self.config.pipeline
        self.stages = resolve_stages(
            self.model_path,
            self.model_config.n_layers,
            pc.devices,
            pc.split,
            pc.plan,
            self._plan_options(),
        )
        self.num_groups = pc.micro_batches or len(self.stages)
        self.params = {}
        self.constraints = Constraints(self.tokenizer, self.model_config.vocab_size)
        self.kv_dtype = self.config.kv_dtype  # each stage resolves "auto" for its own device
        self.kv_tiers = None  # lower KV tiers are per device pool: not across stages yet
        self.spec = None  # no speculative decoding across stages (yet): plain decode steps
        self.stats = EngineStats()
        self.restarts = 0
        self._progress = progress
        self.pipeline: Pipeline | None = None
        self._start()

    def _plan_options(self) -> dict:
        """What the planner must plan for: this engine's KV, weights and batch limits."""
        cfg, sched = self.config, self.config.scheduler
        return {
            "kv_dtype": cfg.kv_dtype,
            "block_size": cfg.block_size,
            "kv_memory_fraction": cfg.kv_memory_fraction,
            "weights": self.runtime.weights,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "enforce_eager": cfg.enforce_eager,
            "cuda_graph_max_tokens": cfg.cuda_graph_max_tokens,
        }

    def _start(self) -> None:
        log.info("pipeline: %s", ", ".join(s.describe() for s in self.stages))
        self.pipeline = Pipeline(
            self.model_path, self.stages, self.runtime, self.config, self._progress
        )
        self._finalizer = weakref.finalize(self, self.pipeline.close)
        cfg = self.config
        self.block_manager = BlockManager(
            self.pipeline.num_blocks, cfg.block_size, cfg.enable_prefix_caching
        )
        self.scheduler = MicroBatchScheduler(
            self._scheduler_config(), self.block_manager, self.num_groups
        )
        self._inflight: deque[tuple[int, SchedulerOutput, float]] = deque()
        self._next_mb = 0
        self._last_done = time.perf_counter()

    def embed(self, prompts: list[list[int]]):
        raise ValueError(
            "embeddings are not served by a pipeline's stages yet; give the daemon an "
            "--embedding-model"
        )

    def describe_kv(self) -> str:
        return f"{self.pipeline.describe()} ({self.config.kv_dtype} KV)"

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        results: dict[str, StepOutput] = {}
        try:
            self._fill(results)
            if self._inflight:
                self._complete_oldest(results)
        except StageFailure as e:
            self._recover(e, results)
        return list(results.values())

    def _fill(self, results: dict[str, StepOutput]) -> None:
        """Schedule and submit every group that has no step in flight."""
        busy = {g for g, _, _ in self._inflight}
        for g in range(self.num_groups):
            if g in busy:
                continue
            out = self.scheduler.schedule_group(g)
            for req in out.finished:
                results[req.request_id] = self._final(req)
            if not out.scheduled:
                continue
            plan = StepPlan.build(
                self._next_mb, out, self.params, self.config.block_size, self.constraints
            )
            plan.eos_ids = tuple(self.tokenizer.eos_ids)
            self.pipeline.submit(plan)
            self._inflight.append((g, out, self._next_mb))
            self._next_mb += 1

    def _complete_oldest(self, results: dict[str, StepOutput]) -> None:
        g, out, mb = self._inflight.popleft()
        res = self.pipeline.result()
        if res.micro_batch != mb:
            raise StageFailure(f"pipeline answered micro-batch {res.micro_batch}, expected {mb}")
        producing = [s.req for s in out.scheduled if s.produces_token]
        sampled = {}
        for i, req in enumerate(producing):
            p = self.params.get(req.request_id)
            if p is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while its step was in flight
            sampled[req.request_id] = res.token_ids[i]
            req.stop_now = self.constraints.accept(req.request_id, res.token_ids[i])
            results[req.request_id] = token_output(
                req, p, i, res.token_ids, res.logprobs, res.top
            )
        for req in self.scheduler.update(out, sampled):
            results[req.request_id].finished = True
            results[req.request_id].finish_reason = req.finish_reason
            self.params.pop(req.request_id, None)
            self.constraints.drop(req.request_id)
        now = time.perf_counter()
        self.stats.record(out, now - self._last_done)
        self._last_done = now

    # -- failure -------------------------------------------------------------------------------

    def _recover(self, err: StageFailure, results: dict[str, StepOutput]) -> None:
        """Fail every unfinished request with the reason, then restart (or give up)."""
        log.error("%s", err)
        sched = self.scheduler
        for req in list(sched.running) + list(sched.waiting):
            results[req.request_id] = StepOutput(
                req.request_id,
                finished=True,
                finish_reason="abort",
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                error=str(err),
            )
            self.params.pop(req.request_id, None)
            self.constraints.drop(req.request_id)
        self.pipeline.close(graceful=False)
        self._finalizer.detach()
        if self.restarts >= self.config.pipeline.max_restarts:
            raise RuntimeError(
                f"{err}; giving up after {self.restarts} restarts (max_restarts)"
            ) from err
        self.restarts += 1
        log.warning("pipeline: restart %d of %d", self.restarts, self.config.pipeline.max_restarts)
        self._start()
