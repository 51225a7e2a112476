"""The KV mover: executes the tier ops that kv_tiers queued, between the device pool, host RAM
and disk, and reports finished restores.

Host layout: slot-major, so one block is contiguous bytes (one copy per run of slots, one file
per block on disk), unlike the device pool's layer-major layout:

    device k  [L, num_blocks * B, KV, D]   viewed as [L, num_blocks, B, KV, D]
    host   k  [R, L, B, KV, D]             (R RAM slots; pinned when the device is CUDA)
    scales    the same without D (fp8 only), float32

Every tier moves raw bytes (integer views of the pool's tensors, the widest that divides a row):
fp8 codes and their scales are copied as they are, never converted; torch's fp8 dtypes need no
copy kernels of their own; and a CPU copies 8 bytes per element, not 1 (8x faster strided copies).

On CUDA, offloads (device -> RAM) run on the compute stream, before the step that overwrites the
evicted blocks; restores run on a separate transfer stream that first waits for the compute
stream (a restore may read a slot just offloaded, or fill a block just evicted), in chunks of
CHUNK blocks staged through device memory, then scattered into the pool; an event per step's
restores tells poll() when the request may run. On a CPU, copies are plain and finish at once.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import nullcontext

import torch

from hetero.execution.kv_pool import KVPool
from hetero.kv_tiers import host_memory
from hetero.kv_tiers.policy import Demote, KVTiers, Load, Offload, Restore, Save, TierOp
from hetero.kv_tiers.store import DiskStore

log = logging.getLogger("hetero.kv_tiers")

CHUNK = 64  # blocks per staged copy: ~70 MB for an 8B model in fp8, enough to reach full PCIe rate


def runs(idx: list[int]) -> Iterator[tuple[int, int, int]]:
    """(i0, i1, first) for maximal runs where idx[i0:i1] == first, first+1, ... (at most CHUNK)."""
    i0 = 0
    for i in range(1, len(idx) + 1):
        if i == len(idx) or idx[i] != idx[i - 1] + 1 or i - i0 == CHUNK:
            yield i0, i, idx[i0]
            i0 = i


def _raw(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as the widest integer dtype whose size divides its last dimension's bytes."""
    row = t.shape[-1] * t.element_size()
    wide = next(
        d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if row % d.itemsize == 0
    )
    return t.view(torch.uint8).view(wide)


def _consecutive(idx: list[int]) -> bool:
    return idx == list(range(idx[0], idx[0] + len(idx)))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without blocking the host on CUDA.

    A plain .to(cuda) from pageable memory synchronizes the current stream, which on the
    transfer stream would make the host wait for every restore queued before: stage through
    pinned memory (torch's pinned allocator keeps the buffer until the copy is done).
    """
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def gather(view: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """view[:, blocks] as [n, L, B, ...] (a slice when the blocks are consecutive: no kernel)."""
    if _consecutive(blocks):
        return view[:, blocks[0] : blocks[0] + len(blocks)].transpose(0, 1)
    idx = to_device(torch.tensor(blocks), view.device)
    return view.index_select(1, idx).transpose(0, 1)


def scatter(view: torch.Tensor, blocks: list[int], src: torch.Tensor) -> None:
    """view[:, blocks] = src.transpose(0, 1), src [n, L, B, ...] on view's device."""
    if _consecutive(blocks):
        view[:, blocks[0] : blocks[0] + len(blocks)].copy_(src.transpose(0, 1))
    else:
        view.index_copy_(1, to_device(torch.tensor(blocks), view.device), src.transpose(0, 1))


class HostKVPool:
    """The RAM tier's bytes: `num_slots` blocks in the pool's dtypes, block-contiguous."""

    def __init__(self, pool: KVPool, num_slots: int, pin: bool) -> None:
        self.block_size = pool.block_size
        self.device_views = []  # [L, num_blocks, B, ...] views of the pool's tensors
        for t in (pool.k, pool.v, pool.k_scale, pool.v_scale):
            if t is not None:
                raw = _raw(t)  # [L, slots, KV, D * itemsize / w] (scales: [L, slots, KV * 4 / w])
                L, rest = raw.shape[0], raw.shape[2:]
                # all the pool's blocks (a window model's null block too: never moved)
                self.device_views.append(raw.view(L, -1, pool.block_size, *rest))
        # bytes of one block in each tensor, in payload order (also without RAM slots: disk)
        self.parts = [v[:, 0].numel() * v.element_size() for v in self.device_views]
        self.num_slots = num_slots  # asked; what the buffer holds once `ready` (host_memory)
        self.pinned = pin
        self._tensors: list[torch.Tensor] | None = None
        self._buf: torch.Tensor | None = None
        # Pinning takes about a second per few GiB: done on a thread, so the engine starts at
        # once and the RAM tier opens when it is done (TieredKV.before_schedule). Pageable
        # memory is only reserved here (no page is touched): at once.
        self._alloc = threading.Thread(target=self._allocate, daemon=True)
        if pin:
            self._alloc.start()
        else:
            self._allocate()

    def _allocate(self) -> None:
        # One allocation carved into the four tensors: torch's pinned allocator rounds each
        # request up to a power of two, which four separate tensors would pay four times.
        got = host_memory.allocate(self.block_bytes, self.num_slots, self.pinned)
        self._buf, self.num_slots, self.pinned = got.buf, got.slots, got.pinned

    @property
    def ready(self) -> bool:
        """The buffer is allocated (num_slots is final)."""
        return not self._alloc.is_alive()

    @property
    def tensors(self) -> list[torch.Tensor]:
        """[R, L, B, ...] per pool tensor, views of the one host buffer (R = num_slots)."""
        if self._tensors is None:
            if self._alloc.is_alive():
                self._alloc.join()
            out, off, r = [], 0, self.num_slots
            for v, n in zip(self.device_views, self.parts):
                if self._buf is None:  # no RAM tier: no slot is ever addressed
                    out.append(torch.empty(0, v.shape[0], *v.shape[2:], dtype=v.dtype))
                    continue
                part = self._buf[off : off + r * n].view(v.dtype)
                out.append(part.view(r, v.shape[0], *v.shape[2:]))
                off += r * n
            self._tensors = out
        return self._tensors

    @property
    def block_bytes(self) -> int:
        return sum(self.parts)

    def payload(self, slot: int) -> bytes:
        """One RAM slot as the disk tier stores it: each tensor's bytes, concatenated."""
        return b"".join(t[slot].numpy().tobytes() for t in self.tensors)

    def unpack(self, payload: bytes | bytearray) -> list[torch.Tensor]:
        """A payload -> one CPU tensor [L, B, ...] per pool tensor (views of the buffer)."""
        out, off = [], 0
        for v, n in zip(self.device_views, self.parts):
            w = v.element_size()
            raw = torch.frombuffer(payload, dtype=v.dtype, count=n // w, offset=off)
            out.append(raw.view(v.shape[0], *v.shape[2:]))
            off += n
        return out


class KVMover:
    def __init__(
        self, pool: KVPool, host: HostKVPool, disk: DiskStore | None, tiers: KVTiers
    ) -> None:
        self.host, self.disk, self.tiers = host, disk, tiers
        self.device = pool.k.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._offload_event = None  # last offload's D2H on the compute stream (CUDA)
        self._pending: list[tuple[list[int], object, object, int]] = []  # tickets, start, end, B
        self._done: list[int] = []

    # -- executing ops ---------------------------------------------------------------------------

    def run(self, ops: list[TierOp]) -> None:
        """Execute ops in order (grouped by kind where consecutive), before the step's forward."""
        tickets, t0, nbytes = [], time.perf_counter(), 0
        start = self._begin_restores() if any(isinstance(o, Restore | Load) for o in ops) else None
        for kind, group in itertools.groupby(ops, key=type):
            group = list(group)
            if kind is Offload:
                self._offload(group)
            elif kind is Demote:
                self._demote(group)
            elif kind is Save:
                self._save([(o.block, o.name) for o in group])
            else:
                nbytes += self._restore(group) if kind is Restore else self._load(group)
                tickets += [t for t in dict.fromkeys(o.ticket for o in group) if t not in tickets]
        if not tickets:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
            self._pending.append((tickets, start, end, nbytes))
        else:
            self._finish(tickets, time.perf_counter() - t0, nbytes)

    def _begin_restores(self):
        if not self.cuda:
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        return start

    def _offload(self, ops: list[Offload]) -> None:
        ops = sorted(ops, key=lambda o: o.slot)  # runs of slots: one copy each
        blocks, slots = [o.block for o in ops], [o.slot for o in ops]
        for i0, i1, s0 in runs(slots):
            for v, h in zip(self.host.device_views, self.host.tensors):
                # [n, L, B, ...] gathered on the device, into n consecutive RAM slots
                h[s0 : s0 + i1 - i0].copy_(gather(v, blocks[i0:i1]), non_blocking=True)
        if self.cuda:
            self._offload_event = torch.cuda.Event()
            self._offload_event.record(torch.cuda.current_stream(self.device))
        self.tiers.stats.moved("device->ram", len(ops), len(ops) * self.host.block_bytes)

    def _host_ready(self) -> None:
        """Wait for offloads in flight before the CPU reads RAM slots."""
        if self._offload_event is not None:
            self._offload_event.synchronize()
            self._offload_event = None

    def _demote(self, ops: list[Demote]) -> None:
        self._host_ready()
        assert self.disk is not None
        ok = sum(self.disk.write(o.name, self.host.payload(o.slot)) for o in ops)
        self.tiers.stats.dropped += len(ops) - ok
        self.tiers.stats.moved("ram->disk", ok, ok * self.host.block_bytes)

    def _save(self, items: list[tuple[int, bytes]]) -> int:
        """Device blocks straight to disk (synchronous: the block may be reused right after)."""
        assert self.disk is not None
        ok = 0
        for block, name in items:
            parts = [v[:, block].contiguous().cpu() for v in self.host.device_views]
            ok += self.disk.write(name, b"".join(p.numpy().tobytes() for p in parts))
        self.tiers.stats.dropped += len(items) - ok
        self.tiers.stats.moved("device->disk", ok, ok * self.host.block_bytes)
        return ok

    def _restore(self, ops: list[Restore]) -> int:
        # by slot: a chain evicted leaf first lies in descending slots; sorted, it is one run
        ops = sorted(ops, key=lambda o: o.slot)
        slots, blocks = [o.slot for o in ops], [o.block for o in ops]
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            for i0, i1, s0 in runs(slots):
                for v, h in zip(self.host.device_views, self.host.tensors):
                    staged = h[s0 : s0 + i1 - i0].to(self.device, non_blocking=True)
                    scatter(v, blocks[i0:i1], staged)  # [n, L, B, ...] into [L, n, B, ...]
        n = len(ops) * self.host.block_bytes
        self.tiers.stats.moved("ram->device", len(ops), n)
        return n

    def _load(self, ops: list[Load]) -> int:
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            for o in ops:
                for v, part in zip(self.host.device_views, self.host.unpack(o.payload)):
                    v[:, o.block].copy_(to_device(part, self.device))
        n = len(ops) * self.host.block_bytes
        self.tiers.stats.moved("disk->device", len(ops), n)
        return n

    # -- completion ------------------------------------------------------------------------------

    def _finish(self, tickets: list[int], seconds: float, nbytes: int) -> None:
        st, cost = self.tiers.stats, self.tiers.cost
        st.restores += len(tickets)
        st.restore_s += seconds
        if seconds > 0 and nbytes:
            cost.ram_bytes_per_s = cost.follow(cost.ram_bytes_per_s, nbytes / seconds)
        self._done += tickets

    def poll(self) -> list[int]:
        """Restore tickets finished since the last poll."""
        still = []
        for tickets, start, end, nbytes in self._pending:
            if end.query():
                self._finish(tickets, start.elapsed_time(end) / 1e3, nbytes)
            else:
                still.append((tickets, start, end, nbytes))
        self._pending = still
        done, self._done = self._done, []
        return done

    def wait(self) -> list[int]:
        """Block until every restore in flight is done; returns the finished tickets."""
        for _, _, end, _ in self._pending:
            end.synchronize()
        return self.poll()

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._done)

    # -- persistence -----------------------------------------------------------------------------

    def persist(self, device_named: list[tuple[bytes, int]]) -> int:
        """Write the named blocks not yet on disk, at most what the disk tier holds; how many.

        Least valuable first, so the disk's LRU order keeps the best when the cap cuts: RAM
        blocks (least recently used first), then the device's (older names first).
        """
        if self.disk is None:
            return 0
        self.wait()
        self._host_ready()
        todo = [("ram", h, s) for h, s in self.tiers.ram.items() if not self.disk.contains(h)]
        todo += [("device", h, b) for h, b in device_named if not self.disk.contains(h)]
        todo = todo[max(0, len(todo) - self.disk.cap_files) :]
        if len(todo) > 1000:
            log.info("KV disk tier: saving %d blocks to %s", len(todo), self.disk.dir)
        ram = [(h, s) for tier, h, s in todo if tier == "ram"]
        ok = sum(self.disk.write(h, self.host.payload(s)) for h, s in ram)
        self.tiers.stats.moved("ram->disk", ok, ok * self.host.block_bytes)
        return ok + self._save([(b, h) for tier, h, b in todo if tier == "device"])
