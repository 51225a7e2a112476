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
    dist_init: the rendezvous of the stages' process group, tcp://HOST:PORT on this machine
        (None: a free loopback port; give a reachable address when stages run on other hosts).
    remote_stages: "1,2": stage ranks this engine does not start, started on other hosts with
        `hetero stage MODEL --rank R --dist-init tcp://HOST:PORT` and the same split options.
    """

    devices: str | None = None
    split: str | None = None
    plan: str | None = None
    micro_batches: int = 0
    stage_timeout: float = 600.0
    max_restarts: int = 3
    dist_init: str | None = None
    remote_stages: str | None = None

    def __post_init__(self) -> None:
        if self.micro_batches < 0:
            raise ValueError(f"micro_batches must be >= 0 (0: one per stage), got "
                             f"{self.micro_batches}")
        if self.stage_timeout <= 0:
            raise ValueError(f"stage_timeout must be > 0 seconds, got {self.stage_timeout}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")

    def remote_ranks(self) -> set[int]:
        text = self.remote_stages or ""
        try:
            ranks = {int(r) for r in text.split(",") if r.strip()}
        except ValueError as e:
            raise ValueError(f"--remote-stages {text!r}: expected stage ranks like 1,2") from e
        if 0 in ranks:
            raise ValueError("--remote-stages: stage 0 runs beside the engine; it cannot be remote")
        return ranks

    @property
    def enabled(self) -> bool:
        return bool(self.devices or self.split or self.plan)
