"""The engine's lower KV tiers: sized at start (a TierPlan), then driven once per step.

    step():  finish restores the mover reports  ->  schedule()  ->  run the queued tier ops
             (offloads before the forward overwrites evicted blocks; restores on their own
             stream)  ->  forward  ->  when nothing was scheduled but restores are in flight,
             wait for them instead of spinning.

Sizes found at run time (RAM slots, disk cap) live in the TierPlan, not in the EngineConfig.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from hetero.engine.block_manager import BlockManager
from hetero.engine.config import EngineConfig
from hetero.engine.stats import TierGauges
from hetero.execution.kv_pool import KVPool
from hetero.kv_tiers.mover import HostKVPool, KVMover
from hetero.kv_tiers.policy import KVTiers
from hetero.kv_tiers.store import DiskStore, default_disk_cap, model_identity

log = logging.getLogger("hetero.kv_tiers")

GiB = 2**30
RAM_KEEP_FREE = 8 * GiB  # the default RAM tier leaves this much (and half the free RAM) alone
RAM_DEFAULT_MAX = 16 * GiB  # pinning takes seconds per 10 GiB at start: more only when asked


@dataclass(frozen=True)
class TierPlan:
    ram_slots: int
    disk_dir: str | None
    disk_cap: int  # bytes (0 without a disk tier)
    block_bytes: int
    pinned: bool

    @property
    def enabled(self) -> bool:
        return self.ram_slots > 0 or self.disk_dir is not None

    def describe(self) -> str:
        ram = self.ram_slots * self.block_bytes / GiB
        pin = "pinned " if self.pinned else ""
        disk = (
            f"; disk {self.disk_dir} up to {self.disk_cap / GiB:.1f} GiB" if self.disk_dir else ""
        )
        return f"KV tiers: {pin}RAM {self.ram_slots} blocks ({ram:.2f} GiB){disk}"


def plan_tiers(config: EngineConfig, block_bytes: int, device: str) -> TierPlan:
    """RAM slots and disk cap from the config, or from free RAM and disk when not given."""
    cuda = torch.device(device).type == "cuda"
    ram = config.kv_ram_gb
    if ram is None:
        avail = psutil.virtual_memory().available
        ram_bytes = max(0, min(avail // 2, avail - RAM_KEEP_FREE, RAM_DEFAULT_MAX)) if cuda else 0
    else:
        ram_bytes = int(ram * GiB)
    disk_cap = 0
    if config.kv_disk_dir is not None:
        gb = config.kv_disk_gb
        disk_cap = default_disk_cap(config.kv_disk_dir) if gb is None else int(gb * GiB)
    if not config.enable_prefix_caching:
        ram_bytes, disk_cap = 0, 0  # blocks are named by the prefix cache: nothing to keep
    disk_dir = config.kv_disk_dir if disk_cap else None
    return TierPlan(ram_bytes // block_bytes, disk_dir, disk_cap, block_bytes, cuda)


class TieredKV:
    """The tiers' index (for the block manager) and the mover (for the engine), together."""

    def __init__(self, plan: TierPlan, pool: KVPool, model_path: str, layers: range) -> None:
        self.plan = plan
        host = HostKVPool(pool, plan.ram_slots, pin=plan.pinned)
        if host.block_bytes != plan.block_bytes:
            raise RuntimeError(
                f"host block {host.block_bytes} B != pool block {plan.block_bytes} B"
            )
        disk = None
        if plan.disk_dir is not None:
            layout = f"kv={pool.kv_dtype}|B={pool.block_size}|layers={layers.start}-{layers.stop}"
            if pool.layout.null_block:  # a block holds one KV cache group's layer slots
                layout += f"|kv-groups={pool.layout.n_groups}x{pool.layout.n_slots}"
            identity = model_identity(model_path, layout)
            disk = DiskStore(plan.disk_dir, identity, host.block_bytes, plan.disk_cap)
            if len(disk):
                log.info("KV disk tier: %d saved blocks found in %s", len(disk), disk.dir)
        self.host = host
        # the RAM tier opens once its buffer is had (pinning runs on a thread; what cannot be had
        # shrinks it: host_memory.py)
        self.tiers = KVTiers(host.num_slots if host.ready else 0, disk, host.block_bytes)
        self.mover = KVMover(pool, host, disk, self.tiers)

    def before_schedule(self, bm: BlockManager) -> None:
        if self.tiers.ram.num_slots < self.host.num_slots and self.host.ready:
            self.tiers.ram.grow(self.host.num_slots)
            log.info("RAM tier open: %d blocks", self.host.num_slots)
        bm.finish_restores(self.mover.poll())

    def after_schedule(self) -> None:
        self.mover.run(self.tiers.take_ops())

    def idle(self, bm: BlockManager) -> None:
        """Nothing was scheduled: wait for the restores or disk reads the waiting ones need."""
        if self.mover.busy:
            bm.finish_restores(self.mover.wait())
        elif self.tiers.prefetch is not None and self.tiers.prefetch.busy:
            self.tiers.prefetch.wait(timeout=1.0)

    def step_done(self, tokens: int, seconds: float) -> None:
        """A step's KV is in place: write through the blocks it filled that the disk tier lost
        (KVTiers.committed). A prefill-sized step's throughput feeds the restore-or-recompute
        estimate."""
        self.mover.run(self.tiers.take_ops())
        if tokens >= 64 and seconds > 0:
            cost = self.tiers.cost
            cost.prefill_tokens_per_s = cost.follow(cost.prefill_tokens_per_s, tokens / seconds)

    def gauges(self) -> TierGauges:
        """Size, hits, moves and restore time of the tiers, for /metrics."""
        t, st = self.tiers, self.tiers.stats
        disk = t.disk
        return TierGauges(
            ram_blocks=len(t.ram),
            ram_slots=t.ram.num_slots,
            disk_blocks=None if disk is None else len(disk),
            disk_slots=None if disk is None else disk.cap_files,
            hits=dict(st.hits),
            bytes_moved=dict(st.bytes_moved),
            blocks_moved=dict(st.blocks_moved),
            dropped=st.dropped,
            restores=st.restores,
            restore_s=st.restore_s,
        )

    def offload_all(self, bm: BlockManager) -> int:
        """Push every parked device block down a tier now (benchmarks, tests); how many."""
        n = bm.evict_parked()
        self.after_schedule()
        return n

    def persist(self, bm: BlockManager) -> int:
        """Save every named block to disk (at shutdown, for the next start); how many."""
        n = self.mover.persist(bm.named_blocks())
        bm.finish_restores(self.mover.poll())
        return n


def build_tiers(
    config: EngineConfig, pool: KVPool, block_bytes: int, device: str, model_path, layers: range
) -> TieredKV | None:
    plan = plan_tiers(config, block_bytes, device)
    if not plan.enabled:
        return None
    tiered = TieredKV(plan, pool, str(model_path), layers)
    log.info(plan.describe())
    return tiered
