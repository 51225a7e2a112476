"""Frozen configuration of a pipeline: how the stages are asked for, and how they are watched.

Exactly one of devices / split / plan asks for a pipeline (devices and split may be given
together when they agree); none of them means one process, as before. The stages themselves are
found at start (hetero/dist/stages.py) and live in the engine, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineConfig:
    """devices: "cuda:0,cpu" (the planner splits, or an even split without it);
    split: "cuda:0=0-19,cpu=20-31" (inclusive layer ranges); plan: a saved plan's JSON path.
    micro_batches: batches in flight at once (0: one per stage, so every stage has work).
    stage_timeout: seconds a step (or the start of the stages) may take before the pipeline is
        declared stuck: a dead stage is seen at once, this bounds a hung one.
    max_restarts: how often a failed pipeline is restarted before the engine gives up.
    """

    devices: str | None = None
    split: str | None = None
    plan: str | None = None
    micro_batches: int = 0
    stage_timeout: float = 600.0
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if self.micro_batches < 0:
            raise ValueError(f"micro_batches must be >= 0 (0: one per stage), got "
                             f"{self.micro_batches}")
        if self.stage_timeout <= 0:
            raise ValueError(f"stage_timeout must be > 0 seconds, got {self.stage_timeout}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")

    @property
    def enabled(self) -> bool:
        return bool(self.devices or self.split or self.plan)
