"""KV pools laid out by KV cache group (engine/kv_groups.py): a dense model's pool is what it
always was; gpt-oss's window and full layers share the layer slots (half the bytes a block),
one zeroed null block follows the usable ones, and the pool's size and the local executor's
pools and block count follow from that."""

from __future__ import annotations

import pytest
import torch

from hetero.config import RuntimeConfig
from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.execution import kv_pool
from hetero.execution.kv_pool import KVPool, PoolLayout, block_bytes, cpu_pool_need, size_pool
from hetero.execution.local import LocalExecutor
from hetero.gguf_loader import load_gguf
from hetero.model.llama import LlamaModel
from hetero.synth import write_synthetic


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pools")
    return {
        name: load_gguf(write_synthetic(folder / f"{name}.gguf", name, "q8_0", False))
        for name in ("tiny-llama", "tiny-gpt-oss")
    }


def test_a_dense_pool_is_laid_out_as_before(configs) -> None:
    cfg = configs["tiny-llama"].config
    pool = KVPool(cfg, cfg.n_layers, 10, 16, "fp16")
    assert pool.k.shape == (cfg.n_layers, 10 * 16, cfg.n_kv_heads, cfg.head_dim)
    assert pool.layout == PoolLayout(tuple(range(cfg.n_layers)), (0,) * cfg.n_layers,
                                     cfg.n_layers, 1, False)  # fmt: skip
    assert all(pool.layer(i)[0].data_ptr() == pool.k[i].data_ptr() for i in range(cfg.n_layers))


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_a_window_pool_shares_slots_and_zeroes_its_null_block(configs, kv_dtype) -> None:
    cfg = configs["tiny-gpt-oss"].config  # 2 layers: 0 slides (window 8), 1 is full
    pool = KVPool(cfg, range(2), 10, 4, kv_dtype)
    assert pool.layout == PoolLayout((0, 0), (1, 0), 1, 2, True)
    assert pool.k.shape[:2] == (1, 11 * 4)  # one slot; 10 blocks and the null block
    for t in (pool.k, pool.v, pool.k_scale, pool.v_scale):
        if t is not None:
            assert torch.all(t[:, 40:].float() == 0)
    assert pool.layer(0)[0].data_ptr() == pool.layer(1)[0].data_ptr()
    assert KVPool(cfg, range(1, 2), 10, 4).layout == PoolLayout((0,), (0,), 1, 2, True)


def test_pool_size_counts_the_slots_and_the_null_block(configs, monkeypatch) -> None:
    cfg = configs["tiny-gpt-oss"].config
    per_block = block_bytes(cfg, 1, 16, "fp16")
    monkeypatch.setattr(kv_pool, "free_memory", lambda device: 100 * per_block)
    size = size_pool(cfg, 1, 16, "fp16", "cpu", 1.0, null_block=True)
    assert (size.num_blocks, size.block_bytes) == (99, per_block)
    assert size_pool(cfg, 2, 16, "fp16", "cpu", 1.0).num_blocks == 50  # the old layout's count
    # a CPU pool sized for its contexts: full blocks, and a window group's few
    assert cpu_pool_need(4096, 1, 16)[0] == 256
    assert cpu_pool_need(4096, 1, 16, (0, 8), 512)[0] == 256 + 1 + 32 + 1


def test_the_local_executor_lays_out_each_segment(configs) -> None:
    gm = configs["tiny-gpt-oss"]
    rt = RuntimeConfig(device="cpu", weights="dense")
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32)
    cfg = EngineConfig(kv_dtype="fp32", num_kv_blocks=24, block_size=4, scheduler=sched)
    whole = LocalExecutor(LlamaModel(gm, rt), cfg, 64)
    assert whole.info.kv_windows == (0, 8) and whole.info.num_blocks == 24
    assert whole.pool.k.shape[:2] == (1, 25 * 4)
    split = LocalExecutor([LlamaModel(gm, rt, range(1)), LlamaModel(gm, rt, range(1, 2))], cfg, 64)
    assert [s.pool.layout.groups for s in split.segments] == [(1,), (0,)]
    assert all(s.pool.k.shape[:2] == (1, 25 * 4) for s in split.segments)
