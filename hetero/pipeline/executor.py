"""The pipeline executor: the model's layers over stage processes, several steps in flight.

Each stage holds a contiguous range of layers and its own KV pool; steps go to stage 0 and their
sampled tokens come back from the last stage, in the order they went (processes.py). All stages
share one block table per request, so the engine's block manager gets the smallest stage's block
count (each stage sizes its pool from its own memory; the log shows every stage's capacity, which
is what a better layer split would even out).

`max_in_flight` is the number of micro-batch groups (one per stage unless asked otherwise), so
that every stage has work: the engine keeps that many steps submitted. A stage that dies, fails
or hangs raises ExecutorFailure from `submit` or `collect`; `restart` starts the stages again,
up to max_restarts times.
"""

from __future__ import annotations

import logging
import weakref

from hetero.config import PipelineConfig, RuntimeConfig
from hetero.engine.config import EngineConfig
from hetero.engine.executor import (
    ExecutorFailure,
    ExecutorInfo,
    ModelOutput,
    SampledRows,
    StageLayout,
    Step,
)
from hetero.pipeline.processes import Pipeline, StageFailure
from hetero.pipeline.stages import StageSpec
from hetero.pipeline.step import StepPlan

log = logging.getLogger("hetero.pipeline")


class PipelineExecutor:
    kv_tiers = None  # lower KV tiers are per device pool: not across stages yet

    def __init__(
        self,
        model_path: str,
        stages: list[StageSpec],
        runtime: RuntimeConfig,
        config: EngineConfig,
        pipeline: PipelineConfig,
        progress: bool = False,
    ):
        self.model_path, self.stages = model_path, stages
        self.runtime, self.config, self.pipeline_config = runtime, config, pipeline
        self.progress = progress
        self.restarts = 0
        self.failure = ""  # why the last step failed (named again when giving up)
        self.pipeline: Pipeline | None = None
        self._expect: list[int] = []  # step ids in flight, oldest first
        self._start()

    def _start(self) -> None:
        log.info("pipeline: %s", ", ".join(s.describe() for s in self.stages))
        self.pipeline = Pipeline(
            self.model_path,
            self.stages,
            self.runtime,
            self.config,
            self.pipeline_config,
            self.progress,
        )
        self._finalizer = weakref.finalize(self, self.pipeline.close)
        self._expect.clear()
        reports = self.pipeline.reports  # what each stage resolved for its device
        kv = {r["kv_dtype"] for r in reports}
        self.info = ExecutorInfo(
            num_blocks=self.pipeline.num_blocks,
            device=self.stages[-1].device,
            weights=reports[-1]["weights"],
            kv_dtype=kv.pop() if len(kv) == 1 else "mixed",
            max_in_flight=self.pipeline_config.micro_batches or len(self.stages),
            samples=True,
            description=self.pipeline.describe(),
            stages=tuple(
                _layout(s, r, self.pipeline.num_blocks) for s, r in zip(self.stages, reports)
            ),
            kv_windows=tuple(reports[0]["kv_windows"]),
        )
        self._devices = [s.device for s in self.stages]

    def submit(self, step: Step) -> None:
        try:
            self.pipeline.submit(StepPlan.build(step, self.config.block_size))
        except StageFailure as e:
            raise self._failed(str(e)) from e
        self._expect.append(step.id)

    def collect(self) -> ModelOutput:
        try:
            res = self.pipeline.result()
        except StageFailure as e:
            raise self._failed(str(e)) from e
        expected = self._expect.pop(0)
        if res.micro_batch != expected:
            raise self._failed(
                f"pipeline answered micro-batch {res.micro_batch}, expected {expected}"
            )
        sampled = SampledRows(res.token_ids, res.logprobs, res.top)
        # every step goes through every stage; each measured its own time (the host's on a GPU:
        # its launches, and the last stage's wait for its tokens)
        return ModelOutput(sampled=sampled, stages=tuple(zip(self._devices, res.stage_s)))

    def _failed(self, why: str) -> ExecutorFailure:
        self.failure = why
        log.error("%s", why)
        return ExecutorFailure(why)

    def embed(self, prompts: list[list[int]]):
        raise ValueError(
            "embeddings are not served by a pipeline's stages yet; give the daemon an "
            "--embedding-model"
        )

    def restart(self) -> None:
        """Start the stages again after a failure, or raise once max_restarts are used."""
        self.pipeline.close(graceful=False)
        self._finalizer.detach()
        limit = self.pipeline_config.max_restarts
        if self.restarts >= limit:
            raise RuntimeError(
                f"{self.failure}; giving up after {self.restarts} restarts (max_restarts)"
            )
        self.restarts += 1
        log.warning("pipeline: restart %d of %d", self.restarts, limit)
        self._start()

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()


def _layout(spec: StageSpec, report: dict, num_blocks: int) -> StageLayout:
    """A stage as its process loaded it (its report: worker.Stage._report)."""
    return StageLayout(
        device=spec.device,
        layer_start=spec.layer_start,
        layer_end=spec.layer_end,
        weights=report["weights"],
        kernels=report["kernels"],
        kv_dtype=report["kv_dtype"],
        num_kv_blocks=num_blocks,
        kv_bytes=report["kv_bytes"],
        weight_bytes=report["weight_bytes"],
    )
