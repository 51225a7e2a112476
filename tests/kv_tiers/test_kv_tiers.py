"""Lower KV tiers under the scheduler: eviction order, exact restores, races, full tiers.

A rig runs the real scheduler, block manager, tier index and mover over a real KVPool (a tiny
model config), and a simulated model: the KV written at position p is a code of the tokens
0..p (what real KV depends on), and the next token is a fixed function of the whole sequence.
Before each step computes, every context slot a request reads is checked to hold the codes of
its own tokens, so a restore into the wrong block, of the wrong slot, or one not finished before
the request runs, fails at once.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero.config import ModelConfig
from hetero.engine.block_manager import BlockManager
from hetero.engine.config import SchedulerConfig
from hetero.engine.kv_groups import KVGroups
from hetero.engine.prefix_cache import block_hash
from hetero.engine.request import Request
from hetero.engine.scheduler import Scheduler
from hetero.execution.kv_pool import KVPool, block_bytes
from hetero.kv_tiers.mover import HostKVPool, KVMover, runs
from hetero.kv_tiers.policy import Demote, KVTiers, Offload, Restore, Save
from hetero.kv_tiers.store import DiskStore

VOCAB = 50
CFG = ModelConfig(
    arch="llama",
    name="rig",
    n_layers=2,
    d_model=8,
    n_heads=2,
    n_kv_heads=2,
    head_dim=4,
    d_ff=16,
    vocab_size=VOCAB,
    context_length=4096,
    norm_eps=1e-5,
    rope_theta=1e4,
    rope_dim=4,
    rope_style="normal",
)


def code(tokens: list[int]) -> int:
    """An order-sensitive code of a token prefix, exact in float32 (< 2**20)."""
    acc = 7
    for t in tokens:
        acc = (acc * 131 + t + 1) % 1_048_573
    return acc


def next_token(seq: list[int]) -> int:
    return (code(seq) * 7 + len(seq)) % VOCAB


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(next_token(prompt + out))
    return out


class Rig:
    def __init__(self, num_blocks, block_size, ram_slots, disk_dir=None, disk_blocks=0, **kw):
        """kw `window`: layer 0 attends to a sliding window of that many tokens (a KV cache
        group of its own, engine/kv_groups.py: one layer slot a block)."""
        self.kv_dtype, device = kw.pop("kv_dtype", "fp32"), kw.pop("device", "cpu")
        window = kw.pop("window", 0)
        cfg = dataclasses.replace(CFG, sliding_window=window, swa_layers=(True, False))
        self.pool = KVPool(cfg, CFG.n_layers, num_blocks, block_size, self.kv_dtype, device)
        nbytes = block_bytes(CFG, self.pool.layout.n_slots, block_size, self.kv_dtype)
        self.host = HostKVPool(self.pool, ram_slots, pin=device.startswith("cuda"))
        disk = None
        if disk_dir is not None:
            disk = DiskStore(disk_dir, b"\x01" * 32, nbytes, disk_blocks * (nbytes + 84))
        self.tiers = KVTiers(ram_slots, disk, nbytes)
        self.tiers.cost.prefill_tokens_per_s = 1.0  # always restore (the rig's "model" is free)
        windows = KVGroups.of(cfg).windows
        self.bm = BlockManager(num_blocks, block_size, tiers=self.tiers, windows=windows)
        self.mover = KVMover(self.pool, self.host, disk, self.tiers)
        cfg = SchedulerConfig(
            max_num_seqs=kw.get("seqs", 4), max_num_batched_tokens=kw.get("tb", 32)
        )
        self.sched = Scheduler(cfg, self.bm)
        self.outputs: dict[str, list[int]] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Request:
        req = Request(rid, prompt, SimpleNamespace(max_tokens=max_tokens))
        self.sched.add(req)
        return req

    def _write(self, slot: int, c: int) -> None:
        if self.kv_dtype == "fp32":
            self.pool.k[:, slot] = c
            self.pool.v[:, slot] = c + 0.5
        else:  # fp8 codes hold little: the float32 scales carry the code, the codes a residue
            self.pool.k[:, slot] = float(c % 8)
            self.pool.v[:, slot] = float(c % 5)
            self.pool.k_scale[:, slot] = c
            self.pool.v_scale[:, slot] = c + 0.5

    def _read(self, slot: int) -> int:
        if self.kv_dtype == "fp32":
            k, v = self.pool.k[:, slot], self.pool.v[:, slot]
            assert torch.all(v == k + 0.5), f"slot {slot}: k and v disagree"
            return int(k.flatten()[0])
        ks = self.pool.k_scale[:, slot]
        c = int(ks.flatten()[0])
        assert torch.all(ks == c) and torch.all(self.pool.v_scale[:, slot] == c + 0.5)
        assert torch.all(self.pool.k[:, slot].float() == float(c % 8))
        assert torch.all(self.pool.v[:, slot].float() == float(c % 5))
        return c

    def step(self):
        self.bm.finish_restores(self.mover.poll())
        out = self.sched.schedule()
        self.mover.run(self.tiers.take_ops())
        self.pool.copy_blocks(out.copies)
        sampled = {}
        for s in out.scheduled:
            req, bs = s.req, self.bm.block_size
            assert not self.bm.is_loading(req)
            seq = req.all_ids
            for w, table in zip(self.bm.windows, req.block_tables):
                # the context this step attends to: all of it, or a window's
                for p in range(max(0, s.start_pos - w + 1) if w else 0, s.start_pos):
                    got = self._read(table[p // bs] * bs + p % bs)
                    assert got == code(seq[: p + 1]), (req.request_id, p)
                for p in range(s.start_pos, s.start_pos + s.num_new_tokens):
                    self._write(table[p // bs] * bs + p % bs, code(seq[: p + 1]))
            if s.produces_token:
                sampled[req.request_id] = next_token(seq)
        for req in self.sched.update(out, sampled):
            self.outputs[req.request_id] = list(req.output_ids)
        if not out.scheduled and self.mover.busy:
            self.bm.finish_restores(self.mover.wait())
        elif not out.scheduled and self.tiers.prefetch is not None:
            self.tiers.prefetch.wait(5.0)
        self.bm.check()
        return out

    def run(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("the rig did not finish")


def chain_names(tokens: list[int], bs: int) -> list[bytes]:
    names, prev = [], None
    for i in range(len(tokens) // bs):
        prev = block_hash(prev, tokens[i * bs : (i + 1) * bs])
        names.append(prev)
    return names


def test_runs_cut_at_gaps_and_chunks():
    assert list(runs([3, 4, 5, 9, 10, 2])) == [(0, 3, 3), (3, 5, 9), (5, 6, 2)]
    assert [r[1] - r[0] for r in runs(list(range(150)))] == [64, 64, 22]


def test_evicted_blocks_reach_ram_leaf_first_then_disk_lru(tmp_path):
    """The device evicts a request's tail first; RAM keeps LRU order and demotes to disk."""
    rig = Rig(num_blocks=4, block_size=4, ram_slots=3, disk_dir=tmp_path, disk_blocks=16)
    a = list(range(1, 14))  # 13 tokens: 3 full blocks named after the first step
    rig.add("a", a, 1)
    rig.run()
    names = chain_names(a, 4)
    assert rig.bm.num_cached_blocks == 3
    rig.bm.evict_parked()
    ops = rig.tiers.take_ops()
    assert [type(o) for o in ops] == [Offload] * 3
    # parked tail first, so evicted tail first: RAM order (LRU first) is leaf .. root
    assert [h for h, _ in rig.tiers.ram.items()] == names[::-1]
    rig.mover.run(ops)
    # a fourth block pushes the least recently used (the leaf) to disk
    b = list(range(20, 25))
    rig.add("b", b, 1)
    rig.run()
    rig.bm.evict_parked()
    ops = rig.tiers.take_ops()
    assert [type(o) for o in ops] == [Demote, Offload]
    assert ops[0].name == names[2] and ops[1].slot == ops[0].slot
    rig.mover.run(ops)
    assert rig.tiers.where(names[2]) == "disk" and rig.tiers.where(names[0]) == "ram"


def test_restore_fills_exactly_the_hit_blocks(tmp_path):
    """A prefix half in RAM, half on disk, comes back into the right blocks, in order."""
    rig = Rig(num_blocks=8, block_size=4, ram_slots=2, disk_dir=tmp_path, disk_blocks=16)
    prompt = [random.Random(1).randrange(VOCAB) for _ in range(17)]
    rig.add("a", prompt, 3)
    rig.run()
    rig.bm.evict_parked()
    rig.mover.run(rig.tiers.take_ops())
    assert sorted(rig.tiers.where(h) for h in chain_names(prompt, 4)) == ["disk"] * 2 + ["ram"] * 2
    req = rig.add("b", prompt + [5, 6], 4)
    out = rig.step()  # its disk blocks are being read ahead: not admitted yet
    assert not out.scheduled and not req.block_table
    while not req.block_table:
        out = rig.step()  # then admitted and restored, but not scheduled in that step
    assert not out.scheduled and req.num_computed_tokens == 16 and rig.bm.is_loading(req) is False
    assert rig.tiers.stats.hits == {"device": 0, "ram": 2, "disk": 2}
    rig.run()
    assert rig.outputs["b"] == reference(prompt + [5, 6], 4)
    assert rig.outputs["a"] == reference(prompt, 3)
    assert req.num_cached_tokens == 16


@pytest.mark.parametrize("with_disk", [False, True])
def test_request_races_the_eviction_of_its_own_source(tmp_path, with_disk):
    """C's admission evicts a device block into the one RAM slot C is restoring from.

    The slot is pinned by C's claim, so the evicted block goes to disk (or is dropped) instead
    of overwriting the slot before the restore reads it; C must see its own prefix's KV.
    """
    disk = tmp_path if with_disk else None
    rig = Rig(num_blocks=4, block_size=4, ram_slots=1, disk_dir=disk, disk_blocks=8)
    a = [3, 1, 4, 1, 5]
    rig.add("a", a, 1)
    rig.run()
    rig.bm.evict_parked()  # a's one named block -> the only RAM slot
    rig.mover.run(rig.tiers.take_ops())
    x = list(range(20, 33))  # 13 tokens: the whole pool, 3 named blocks parked after
    rig.add("x", x, 1)
    rig.run()
    assert rig.bm.num_cached_blocks == 3 and rig.tiers.ram.items()[0][0] == chain_names(a, 4)[0]
    rig.add("c", a[:4] + [9, 9, 9, 9], 2)
    rig.step()
    assert rig.tiers.stats.hits["ram"] == 1
    assert rig.tiers.stats.dropped == (0 if with_disk else 1)
    assert rig.tiers.stats.blocks_moved.get("device->disk", 0) == (1 if with_disk else 0)
    rig.run()
    assert rig.outputs["c"] == reference(a[:4] + [9, 9, 9, 9], 2)


def test_ram_full_of_pinned_slots_saves_to_disk_or_drops(tmp_path):
    """While every RAM slot feeds a restore, an evicted block goes straight to disk."""
    tiers = KVTiers(2, None, 100)
    for i, h in enumerate((b"a" * 32, b"b" * 32)):
        tiers.evicted(i, h)
    claimed = tiers.claim([b"a" * 32, b"b" * 32])
    ticket = tiers.restore(claimed, [5, 6])
    tiers.take_ops()
    tiers.evicted(3, b"c" * 32)
    assert tiers.take_ops() == [] and tiers.stats.dropped == 1
    tiers.restored(ticket)
    tiers.evicted(3, b"c" * 32)
    assert [type(o) for o in tiers.take_ops()] == [Offload]
    tiers.check()
    disk = DiskStore(tmp_path, b"\x02" * 32, 100, 10 * 184)
    tiers = KVTiers(1, disk, 100)
    tiers.evicted(0, b"a" * 32)
    tiers.restore(tiers.claim([b"a" * 32]), [4])
    tiers.evicted(1, b"b" * 32)
    assert tiers.take_ops()[-1] == Save(1, b"b" * 32)


@pytest.mark.parametrize(("kv_dtype", "window"), [("fp32", 0), ("fp8", 0), ("fp32", 3)])
def test_crowd_with_tiny_pool_small_ram_and_disk(tmp_path, kv_dtype, window):
    """Many prefix-sharing requests, a pool that must evict, RAM that must demote; with a
    window layer too, whose group's blocks move between the tiers by their own names."""
    crowd(tmp_path, kv_dtype, "cpu", window)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_crowd_on_cuda_with_async_restores(tmp_path, kv_dtype):
    """The same on a GPU: pinned RAM, restores on their own stream, events polled."""
    crowd(tmp_path, kv_dtype, "cuda")


def test_recompute_is_chosen_when_estimated_faster():
    rig = Rig(num_blocks=8, block_size=4, ram_slots=8)
    a = list(range(1, 18))
    rig.add("a", a, 1)
    rig.run()
    rig.bm.evict_parked()
    rig.mover.run(rig.tiers.take_ops())
    rig.tiers.cost.prefill_tokens_per_s = 1e15  # recomputing is (estimated) free
    req = rig.add("b", a + [2], 3)
    rig.run()
    assert rig.outputs["b"] == reference(a + [2], 3)
    assert req.num_cached_tokens == 0 and rig.tiers.stats.hits["ram"] == 0
    rig.tiers.cost.prefill_tokens_per_s = 1.0
    req = rig.add("c", a + [2], 3)
    rig.run()
    assert rig.outputs["c"] == reference(a + [2], 3) and req.num_cached_tokens == 16


def crowd(tmp_path, kv_dtype: str, device: str, window: int = 0) -> None:
    blocks = 12 + 12 * bool(window)  # a window group's blocks beside the full ones
    rig = Rig(num_blocks=blocks, block_size=4, ram_slots=6, disk_dir=tmp_path, disk_blocks=64,
              kv_dtype=kv_dtype, seqs=3, tb=24, device=device, window=window)  # fmt: skip
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(10)]
    want = {}
    for i in range(24):
        p = (system if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 14))]
        want[f"r{i}"] = reference(p, 5)
        rig.add(f"r{i}", p, 5)
        if i % 3 == 2:
            for _ in range(rng.randint(0, 6)):
                rig.step()
    rig.run()
    assert rig.outputs == want
    assert rig.tiers.stats.hits["ram"] + rig.tiers.stats.hits["disk"] > 0


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 10**6),
    ram=st.integers(0, 6),
    disk=st.booleans(),
    blocks=st.integers(6, 10),
    window=st.sampled_from([0, 0, 2, 3]),
)
def test_random_workloads_leak_nothing(tmp_path_factory, seed, ram, disk, blocks, window):
    d = tmp_path_factory.mktemp("disk") if disk else None
    blocks += 6 * bool(window)  # room for a window group's blocks beside the full ones
    rig = Rig(num_blocks=blocks, block_size=2, ram_slots=ram, disk_dir=d, disk_blocks=8,
              seqs=3, tb=8, window=window)  # fmt: skip
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(3)]
    want = {}
    for i in range(10):
        p = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
        want[f"r{i}"] = reference(p, 3)
        rig.add(f"r{i}", p, 3)
        if rng.random() < 0.3:
            rig.sched.abort(f"r{rng.randrange(i + 1)}")
        for _ in range(rng.randint(0, 3)):
            rig.step()
    rig.run()
    for rid, out in rig.outputs.items():
        assert out == want[rid], rid
    assert rig.bm.num_free_blocks == blocks and rig.bm.num_loading_blocks == 0
    assert not rig.tiers.ram._pins


@pytest.mark.gpu
def test_cuda_restore_does_not_block_the_host():
    """Queueing ~0.5 GB of restores returns long before the copies finish (Llama-8B blocks)."""
    import dataclasses
    import time

    cfg = dataclasses.replace(CFG, n_layers=32, n_kv_heads=8, head_dim=128)
    pool = KVPool(cfg, 32, 512, 16, "fp8", "cuda")
    host = HostKVPool(pool, 512, pin=True)
    tiers = KVTiers(512, None, host.block_bytes)
    mover = KVMover(pool, host, None, tiers)
    ops = [Restore(s, 511 - s, 1) for s in range(512)]
    tiers._pinned[1] = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mover.run(ops)
    queued = time.perf_counter() - t0
    assert mover.wait() == [1]
    assert queued < tiers.stats.restore_s / 2, (queued, tiers.stats.restore_s)


def test_tier_plan_defaults_and_config_errors(tmp_path):
    from hetero.engine.config import EngineConfig
    from hetero.kv_tiers.tiering import GiB, plan_tiers

    assert not plan_tiers(EngineConfig(), 4096, "cpu").enabled  # a CPU's pool is in RAM already
    plan = plan_tiers(EngineConfig(kv_ram_gb=0.5), 4096, "cpu")
    assert plan.ram_slots == GiB // 2 // 4096 and plan.disk_dir is None and not plan.pinned
    plan = plan_tiers(EngineConfig(kv_disk_dir=str(tmp_path), kv_disk_gb=1.0), 4096, "cpu")
    assert plan.enabled and plan.ram_slots == 0 and plan.disk_cap == GiB
    off = EngineConfig(kv_ram_gb=1.0, kv_disk_dir=str(tmp_path), enable_prefix_caching=False)
    assert not plan_tiers(off, 4096, "cpu").enabled  # unnamed blocks cannot be found again
    with pytest.raises(ValueError, match="kv_ram_gb"):
        EngineConfig(kv_ram_gb=-1.0)
    with pytest.raises(ValueError, match="kv_disk_dir"):
        EngineConfig(kv_disk_gb=1.0)
