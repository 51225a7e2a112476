"""Where named KV blocks live below the device pool: a host-RAM tier and a disk tier.

Pure Python over integer ids and block names (prefix_cache.block_hash); the bytes move in
kv_mover.py, which executes the ops queued here in order, after schedule() and before the step's
forward pass:

    device pool --(Offload: evicted parked block)--> RAM slot --(Demote: RAM evicts it)--> disk
         ^                                              |                                    |
         +-------------- Restore (async) ---------------+                                    |
         +---------- Load (payload read ahead on a thread and verified: kv_prefetch) ---------+

A block keeps its stored form in every tier (fp8 codes + float32 scales, or fp16/bf16/fp32), so
a restore is a copy, never a re-quantization. Tiers are inclusive: a block restored from RAM keeps
its RAM copy (evicting it from the device again then moves nothing). RAM eviction is LRU; since
the block manager evicts a request's tail blocks first (prefix leaves), leaves also reach RAM and
leave it first, and a shared prefix stays in the fastest tier that holds it.

A RAM slot read by a restore in flight is pinned: it cannot be evicted and reused until the
restore finishes (kv_mover reports it), so an async copy never reads a slot being overwritten.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hetero.kv_tiers.prefetch import DiskPrefetcher

if TYPE_CHECKING:
    from hetero.kv_tiers.store import DiskStore


@dataclass(frozen=True, slots=True)
class Offload:
    """Copy device block `block` into RAM slot `slot` (block is about to be reused)."""

    block: int
    slot: int


@dataclass(frozen=True, slots=True)
class Demote:
    """Write RAM slot `slot` (named `name`) to disk; the slot is then reused."""

    slot: int
    name: bytes


@dataclass(frozen=True, slots=True)
class Save:
    """Write device block `block` (named `name`) straight to disk (no RAM slot for it)."""

    block: int
    name: bytes


@dataclass(frozen=True, slots=True)
class Restore:
    """Copy RAM slot `slot` into device block `block`, for restore ticket `ticket`."""

    slot: int
    block: int
    ticket: int


@dataclass(frozen=True, slots=True)
class Load:
    """Copy a verified disk payload into device block `block`, for restore ticket `ticket`."""

    payload: bytes | bytearray | memoryview
    block: int
    ticket: int


TierOp = Offload | Demote | Save | Restore | Load


@dataclass
class TierStats:
    """Counters for /metrics: hits are blocks served per tier, bytes moved per direction."""

    hits: dict[str, int] = field(default_factory=lambda: {"device": 0, "ram": 0, "disk": 0})
    blocks_moved: dict[str, int] = field(default_factory=dict)  # "device->ram" ... -> blocks
    bytes_moved: dict[str, int] = field(default_factory=dict)
    dropped: int = 0  # evicted blocks no lower tier could take
    restores: int = 0  # restore tickets finished
    restore_s: float = 0.0  # their summed duration (queue to done)

    def moved(self, direction: str, blocks: int, nbytes: int) -> None:
        self.blocks_moved[direction] = self.blocks_moved.get(direction, 0) + blocks
        self.bytes_moved[direction] = self.bytes_moved.get(direction, 0) + nbytes


@dataclass
class CostModel:
    """Restore or recompute a prefix found in a lower tier: whichever is estimated faster.

    Rates start from conservative guesses and follow what the engine measures (restores in
    kv_mover, prefill throughput in the engine), as exponential moving averages.
    """

    ram_bytes_per_s: float = 5e9
    disk_bytes_per_s: float = 1e9
    prefill_tokens_per_s: float = 1e3
    fixed_s: float = 1e-4  # launch and bookkeeping of one restore

    def restore_s(self, ram_bytes: int, disk_bytes: int) -> float:
        return self.fixed_s + ram_bytes / self.ram_bytes_per_s + disk_bytes / self.disk_bytes_per_s

    def recompute_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    @staticmethod
    def follow(old: float, new: float, weight: float = 0.3) -> float:
        return new if old <= 0 else (1 - weight) * old + weight * new


class RamIndex:
    """Fixed slots of the host-RAM tier: name <-> slot, LRU order, pins of restores in flight."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._name_of: dict[int, bytes] = {}
        self._free: deque[int] = deque(range(num_slots))
        self._pins: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._slot_of)

    def grow(self, num_slots: int) -> None:
        """Open slots up to `num_slots` (the host buffer came late, or smaller: host_memory)."""
        self._free.extend(range(self.num_slots, num_slots))
        self.num_slots = max(self.num_slots, num_slots)

    def lookup(self, name: bytes) -> int | None:
        return self._slot_of.get(name)

    def touch(self, name: bytes) -> None:
        self._slot_of.move_to_end(name)

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        n = self._pins[slot] - 1
        if n:
            self._pins[slot] = n
        else:
            del self._pins[slot]

    def victim(self) -> tuple[bytes, int] | None:
        """The least recently used unpinned entry, or None when every entry is pinned."""
        return next(((h, s) for h, s in self._slot_of.items() if s not in self._pins), None)

    def take_free(self) -> int | None:
        return self._free.popleft() if self._free else None

    def remove(self, name: bytes) -> int:
        slot = self._slot_of.pop(name)
        del self._name_of[slot]
        return slot

    def put(self, name: bytes, slot: int) -> None:
        self._slot_of[name] = slot
        self._name_of[slot] = name

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._slot_of.items())

    def check(self) -> None:
        if len(self._slot_of) + len(self._free) != self.num_slots:
            raise AssertionError("RAM tier: named + free slots != total")
        if set(self._free) & set(self._name_of) or len(set(self._free)) != len(self._free):
            raise AssertionError("RAM tier: a slot is both free and named (or free twice)")
        if any(s not in self._name_of for s in self._pins):
            raise AssertionError("RAM tier: a pinned slot holds no block")


class KVTiers:
    """The lower tiers' index and the queue of data moves for the KV mover.

    ram_slots: RAM tier capacity in blocks (0: no RAM tier). disk: the disk store (None: none).
    block_bytes: bytes one block occupies (for stats and the cost model).
    """

    def __init__(self, ram_slots: int, disk: DiskStore | None, block_bytes: int) -> None:
        self.ram = RamIndex(ram_slots)
        self.disk = disk
        self.prefetch = None if disk is None else DiskPrefetcher(disk)
        self.block_bytes = block_bytes
        self.stats = TierStats()
        self.cost = CostModel()
        self._ops: list[TierOp] = []
        self._tickets = itertools.count(1)
        self._pinned: dict[int, list[int]] = {}  # ticket -> RAM slots it pinned

    # -- lookups (no side effects) ---------------------------------------------------------------

    def where(self, name: bytes) -> str | None:
        """ "ram" or "disk" when a lower tier holds the block named `name`, else None."""
        if self.ram.lookup(name) is not None:
            return "ram"
        if self.disk is not None and self.disk.contains(name):
            return "disk"
        return None

    def worth_restoring(self, ram_blocks: int, disk_blocks: int, block_size: int) -> bool:
        """True when restoring these blocks is estimated faster than recomputing their tokens."""
        b = self.block_bytes
        restore = self.cost.restore_s(ram_blocks * b, disk_blocks * b)
        return restore < self.cost.recompute_s((ram_blocks + disk_blocks) * block_size)

    # -- moves queued by the block manager ------------------------------------------------------

    def evicted(self, block: int, name: bytes) -> None:
        """Device block `block` holding `name` is being reused: keep its data a tier down."""
        slot = self.ram.lookup(name)
        if slot is not None:  # inclusive: RAM already holds these bytes
            self.ram.touch(name)
            return
        slot = self._ram_slot()
        if slot is not None:
            self.ram.put(name, slot)
            self._ops.append(Offload(block, slot))
        elif self.disk is not None and not self.disk.contains(name):
            self._ops.append(Save(block, name))
        elif self.disk is None:
            self.stats.dropped += 1

    def committed(self, block: int, name: bytes) -> None:
        """Device block `block` now holds `name`'s KV: written through to disk at once when the
        disk tier lost its copy (a bad file dropped, a gap in a saved chain), so that the next
        request with this prefix, or the next engine, finds it again."""
        if self.disk is not None and self.disk.wants(name):
            self._ops.append(Save(block, name))

    def _ram_slot(self) -> int | None:
        """A RAM slot for a new block: a free one, else the LRU unpinned one (demoted to disk)."""
        if self.ram.num_slots == 0:
            return None
        slot = self.ram.take_free()
        if slot is not None:
            return slot
        victim = self.ram.victim()
        if victim is None:  # every slot is being read by a restore
            return None
        name, slot = victim
        self.ram.remove(name)
        if self.disk is not None and not self.disk.contains(name):
            self._ops.append(Demote(slot, name))
        elif self.disk is None:
            self.stats.dropped += 1
        return slot

    def claim(self, names: list[bytes]) -> list[tuple[str, int | memoryview]]:
        """Make the lower-tier hits `names` (in chain order) safe to restore.

        RAM hits are pinned (no eviction until restored); disk hits were read and verified ahead
        (fetching), or are now.
        Returns (tier, RAM slot or disk payload) for the leading names that are still good: a
        corrupt or vanished file ends the run there (the rest is recomputed).
        """
        out: list[tuple[str, int | memoryview]] = []
        for name in names:
            slot = self.ram.lookup(name)
            if slot is not None:
                self.ram.pin(slot)
                self.ram.touch(name)
                out.append(("ram", slot))
                continue
            payload = None if self.prefetch is None else self.prefetch.take(name)
            if payload is None and self.disk is not None:  # not read ahead: read it now
                payload = self.disk.read(name)
            if payload is None:
                break
            out.append(("disk", payload))
        return out

    def unclaim(self, claimed: list[tuple[str, int | memoryview]]) -> None:
        """Give back claims a hit did not take (it shrank: kv_tiers/blocks.py): RAM slots are
        unpinned; a disk payload is dropped (read again if asked again)."""
        for tier, src in claimed:
            if tier == "ram":
                assert isinstance(src, int)
                self.ram.unpin(src)

    def restore(self, claimed: list[tuple[str, int | memoryview]], blocks: list[int]) -> int:
        """Queue the copies of claimed data into device `blocks`; returns the restore ticket."""
        ticket = next(self._tickets)
        pinned = []
        for (tier, src), block in zip(claimed, blocks, strict=True):
            self.stats.hits[tier] += 1
            if tier == "ram":
                assert isinstance(src, int)
                pinned.append(src)
                self._ops.append(Restore(src, block, ticket))
            else:
                assert not isinstance(src, int)
                self._ops.append(Load(src, block, ticket))
        self._pinned[ticket] = pinned
        return ticket

    def restored(self, ticket: int) -> None:
        """The mover finished ticket's copies: its RAM slots may be evicted again."""
        for slot in self._pinned.pop(ticket):
            self.ram.unpin(slot)

    def take_ops(self) -> list[TierOp]:
        ops, self._ops = self._ops, []
        return ops

    def drop_ram(self) -> int:
        """Forget every unpinned RAM entry (for benchmarks that must start cold)."""
        n = 0
        for name, slot in self.ram.items():
            if slot not in self.ram._pins:
                self.ram.remove(name)
                self.ram.release(slot)
                n += 1
        return n

    def check(self) -> None:
        self.ram.check()
        pinned = [s for slots in self._pinned.values() for s in slots]
        counts = {s: pinned.count(s) for s in pinned}
        if counts != self.ram._pins:
            raise AssertionError("RAM tier: pins differ from the restores in flight")
