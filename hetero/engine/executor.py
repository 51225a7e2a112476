"""The engine's one seam to whatever runs the model: an Executor.

The engine schedules, samples and speculates; an executor runs scheduled steps through the model
and gives back what the sampler needs. One call per step each way (nano-vllm's `LLMEngine.step`
calls its runner the same way for one rank or many; vLLM's executors too):

    executor.submit(Step(id, scheduler_output, sampling))   # start the step
    executor.collect() -> ModelOutput                       # the oldest step's output

An executor that runs steps one at a time (`info.max_in_flight == 1`: the local executor, one
device, execution/local.py) runs the step inside `submit` and hands its logits back from
`collect`; the engine samples them (and verifies speculative guesses against them). A pipeline
of stage processes (pipeline/executor.py) keeps `max_in_flight` micro-batches in flight and
samples in its last stage, beside the logits, from the rows the engine describes in
`Step.sampling`: then `collect` gives token ids instead of logits (`ModelOutput.sampled`).

The engine never learns which it has: it reads `info`, submits, collects, and on an
`ExecutorFailure` (a stage died) fails its requests and asks the executor to `restart`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from hetero.engine.scheduler import SchedulerOutput
    from hetero.kv_tiers.tiering import TieredKV
    from hetero.sampling import SamplingParams


class ExecutorFailure(RuntimeError):
    """The executor cannot run steps any more (a stage died, failed or hung); `restart` may
    bring it back. The message names the cause; requests in flight are lost."""


@dataclass(frozen=True)
class StageLayout:
    """Where one run of layers lives, as it was loaded: what a status page draws (the planner's
    StagePlan has the same names for the same things, so one drawing serves both)."""

    device: str
    layer_start: int
    layer_end: int  # exclusive
    weights: str  # the resolved weights mode
    kernels: dict[str, str]  # op -> the implementation the registry selected there
    kv_dtype: str
    num_kv_blocks: int
    kv_bytes: int  # the KV pool on this device
    weight_bytes: int  # tensors of the layers (and embedding or head) held on this device

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class ExecutorInfo:
    """What the engine needs to know of an executor.

    num_blocks: KV blocks every request's block table indexes (each stage holds that many).
    device: where the decode step's logits live ("cpu", "cuda:0"; a pipeline: its last stage's).
    weights: the resolved weights mode there (speculation prices a verify step by it).
    kv_dtype: the resolved KV dtype ("mixed" when pipeline stages differ).
    max_in_flight: steps that may be submitted before the oldest is collected.
    samples: True when the executor samples beside the logits (Step.sampling is then required).
    graph_rows: the most rows a step may carry and still replay a CUDA graph (0: no graphs);
        with prompt_graphs, steps with prompt rows replay too and the scheduler keeps a step
        beside running decodes within it.
    description: the KV pool (and the stages) in words, for the start line.
    stages: where the layers are, in order (a status page's drawing of the running model).
    kv_windows: the attention window of each KV cache group the pools hold, one block table a
        group (engine/kv_groups.py: from the model's config; (0,): full attention only).
    """

    num_blocks: int
    device: str
    weights: str
    kv_dtype: str
    max_in_flight: int = 1
    samples: bool = False
    graph_rows: int = 0
    prompt_graphs: bool = False
    description: str = ""
    stages: tuple[StageLayout, ...] = ()
    kv_windows: tuple[int, ...] = (0,)


@dataclass
class SampleRow:
    """What a sampler needs of one token-producing sequence, beside its logits row."""

    params: SamplingParams
    prompt_ids: Sequence[int]  # empty unless a repetition penalty reads them
    output_ids: Sequence[int]  # empty unless a penalty reads them
    step: int  # index of the token being sampled (fixes a seeded row's random numbers)


@dataclass
class StepSampling:
    """The sampling side of a step, for executors that sample (info.samples)."""

    rows: list[SampleRow] = field(default_factory=list)
    allowed: torch.Tensor | None = None  # constrained rows' masks (None: no row has one)
    eos_ids: tuple[int, ...] = ()  # masked in rows still short of their min_tokens


@dataclass
class Step:
    id: int
    out: SchedulerOutput
    sampling: StepSampling | None = None


@dataclass
class SampledRows:
    """Tokens an executor sampled: one per SampleRow, in order (logprobs when any row asked)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top: tuple[list, list] | None = None  # (top ids, top logprobs) per row


@dataclass
class ModelOutput:
    """One step's result: logits for the engine to sample, or the executor's samples."""

    logits: torch.Tensor | None = None  # [N, V] float32: ModelRunner.run's rows
    sampled: SampledRows | None = None
    graphed: bool = False  # the step replayed CUDA graphs
    # each stage the step went through, in order: (where it ran, seconds; None: not measured)
    stages: tuple[tuple[str, float | None], ...] = ()


class Executor(Protocol):
    info: ExecutorInfo
    # the lower KV tiers of the executor's pool (RAM, disk), driven by the engine once a step;
    # None where there are none (a pipeline's pools are per stage)
    kv_tiers: TieredKV | None

    def submit(self, step: Step) -> None: ...

    def collect(self) -> ModelOutput: ...

    def embed(self, prompts: list[list[int]]):
        """[N, C] float32 pooled last hidden states of token-id prompts (ValueError where the
        executor does not serve embeddings)."""

    def restart(self) -> None:
        """After an ExecutorFailure: start again (fresh KV pools), or raise when it cannot."""

    def close(self) -> None: ...
