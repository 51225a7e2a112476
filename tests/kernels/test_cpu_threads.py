"""The CPU's defaults: the kernels' thread count from physical cores, and a KV pool sized from
what it must hold rather than from free RAM."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from hetero.execution.kv_pool import CPU_POOL_CONTEXTS, block_bytes, cpu_pool_need, size_pool
from hetero.kernels import cpu_threads
from hetero.planner.model_desc import describe


def test_physical_cores_count_siblings_once():
    cpus = set(os.sched_getaffinity(0))
    cores = cpu_threads.physical_cores(cpus)
    assert 1 <= cores <= len(cpus)
    assert cpu_threads.physical_cores({min(cpus)}) == 1


def test_the_default_leaves_a_core_to_the_server_from_four_cores(monkeypatch):
    for cores, one, two_stages in ((1, 1, 1), (2, 2, 1), (4, 3, 1), (16, 15, 7)):
        monkeypatch.setattr(cpu_threads, "physical_cores", lambda cpus=None, c=cores: c)
        assert cpu_threads.default_threads() == one
        assert cpu_threads.default_threads(stages=2) == two_stages


def test_configure_sets_the_kernels_and_torchs_count(monkeypatch):
    import hetero

    before = torch.get_num_threads()
    try:
        assert cpu_threads.configure(1) == 1 and cpu_threads.get() == torch.get_num_threads() == 1
        assert cpu_threads.configure(0) == cpu_threads.default_threads() == cpu_threads.get()
        line = cpu_threads.describe()
        assert line.startswith(f"CPU: {cpu_threads.get()} threads of ") and "qdot kernels" in line
        monkeypatch.setattr(hetero, "TORCH_OMP_PASSIVE", False)  # torch's team would spin
        assert cpu_threads.configure(2) == 2 == cpu_threads.get() and torch.get_num_threads() == 1
    finally:
        monkeypatch.setattr(cpu_threads, "_threads", None)
        torch.set_num_threads(before)


def test_hetero_asks_torchs_openmp_team_not_to_spin():
    """In a fresh interpreter that imports hetero before torch (as the CLI and the server do)."""
    code = (
        "import os, hetero, torch; print(os.environ['OMP_WAIT_POLICY'], hetero.TORCH_OMP_PASSIVE)"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["PASSIVE", "True"], out.stderr
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # the user's choice stands
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["ACTIVE", "False"], out.stderr


def test_a_cpu_pool_holds_its_contexts_not_a_share_of_ram():
    cfg = describe("synth:llama3-8b:q4_k_m").config
    need = cpu_pool_need(8192, 256, 16)
    assert need[0] == CPU_POOL_CONTEXTS * 8192 // 16 and "4 sequence(s) of 8192" in need[1]
    assert cpu_pool_need(8192, 1, 16)[0] == 512  # one sequence at a time: one context
    pool = size_pool(cfg, cfg.n_layers, 16, "fp16", "cpu", 0.9, None, need)
    per_block = block_bytes(cfg, cfg.n_layers, 16, "fp16")
    if pool.free_bytes * 0.9 >= need[0] * per_block:  # memory allows more: the need decides
        assert pool.num_blocks == need[0] and "sized for" in pool.describe("fp16")
    assert size_pool(cfg, cfg.n_layers, 16, "fp16", "cpu", 0.9, 100, need).num_blocks == 100
