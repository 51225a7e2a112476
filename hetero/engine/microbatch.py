"""Micro-batches for a pipeline: the running requests split into groups, one step in flight each.

With S stages and one batch, stage 2 waits while stage 1 computes and then stage 1 waits: the
stages alternate. With G >= S groups (vLLM's "virtual engines"), group 0's step runs on stage 2
while group 1's runs on stage 1, so the stages overlap:

    stage 1 | g0 | g1 | g0 | g1 | ...
    stage 2 |    | g0 | g1 | g0 | ...

A request belongs to one group from admission until it finishes or is preempted; a group is
scheduled only when its previous step has come back, so a scheduled request never has a step
in flight. The groups share one block manager (one block table per request serves every stage),
so a group short of blocks preempts only its own requests and otherwise waits for the others to
free theirs (Scheduler._blocks_held_elsewhere).
"""

from __future__ import annotations

import math
from dataclasses import replace

from hetero.engine.block_manager import BlockManager
from hetero.engine.config import SchedulerConfig
from hetero.engine.request import Request
from hetero.engine.scheduler import Scheduler, SchedulerOutput


class MicroBatchScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, num_groups: int):
        super().__init__(config, block_manager)
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_groups = num_groups
        self.group_of: dict[str, int] = {}  # request id -> group, for running requests
        self._others: list[Request] = []  # running requests of the other groups (in schedule)

    def group_size(self, group: int) -> int:
        return sum(1 for r in self.running if self.group_of.get(r.request_id) == group)

    def _seat_cap(self) -> int:
        """Seats per group: the live requests shared evenly, within max_num_seqs overall."""
        live = len(self.running) + len(self.waiting)
        per_group_max = math.ceil(self.config.max_num_seqs / self.num_groups)
        return max(1, min(per_group_max, math.ceil(live / self.num_groups)))

    def schedule_group(self, group: int) -> SchedulerOutput:
        """One step for `group` alone: its running requests, then admissions up to its seats."""
        base, cap = self.config, self._seat_cap()
        mine = [r for r in self.running if self.group_of.get(r.request_id) == group]
        self._others = [r for r in self.running if self.group_of.get(r.request_id) != group]
        self.running = mine
        self.config = replace(base, max_num_seqs=cap)
        try:
            out = super().schedule()
        finally:
            for r in self.running:
                self.group_of[r.request_id] = group
            self.running = sorted(self.running + self._others, key=lambda r: r.order)
            self._others, self.config = [], base
        live = {r.request_id for r in self.running}
        self.group_of = {k: g for k, g in self.group_of.items() if k in live}
        return out

    def schedule(self) -> SchedulerOutput:
        raise RuntimeError("a pipeline schedules one micro-batch at a time: use schedule_group")

    def _blocks_held_elsewhere(self) -> bool:
        return any(r.block_table for r in self._others)
