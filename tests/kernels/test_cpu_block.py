"""The dense block as one native call (kernels/cpu_block.py) against the op-by-op path it
replaces: the same logits to the bit, over prompts and decode steps of several sequences, on
models from `hetero synth` with mixed K-quant linears (q|k beside a Q6_K v: two parts), q|k|v
biases (qwen2), per-head q/k norms (qwen3), float32 and float16 KV caches; and the op-by-op path
where the call does not apply."""

from __future__ import annotations

import pytest
import torch

from hetero.config import RuntimeConfig
from hetero.execution.kv_pool import KVPool
from hetero.execution.runner import PagedAttention, PagedMeta
from hetero.kernels import native
from hetero.model.forward_batch import ForwardBatch
from hetero.model.llama import load_model
from hetero.synth import write_synthetic

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")

BS = 16


def _steps(model, kv_dtype: str, lens: list[int], decodes: int, seed: int = 0) -> torch.Tensor:
    """Prompts of `lens` tokens in one step, then `decodes` steps of one token each: every
    step's logits [rows, V], concatenated. Sequence i holds blocks i*64 ... in order."""
    cfg = model.config
    pool = KVPool(cfg, cfg.n_layers, 64 * len(lens), BS, kv_dtype)
    gen = torch.Generator().manual_seed(seed)
    pos = [0] * len(lens)
    out = []
    for step in range(1 + decodes):
        news = lens if step == 0 else [1] * len(lens)
        tokens = torch.randint(0, cfg.vocab_size, (sum(news),), generator=gen)
        meta, slots, positions, rows, row = PagedMeta([], [], []), [], [], [], 0
        for i, n in enumerate(news):
            ctx = torch.arange(pos[i] + n) + i * 64 * BS
            meta.q_starts.append(row)
            meta.q_lens.append(n)
            meta.ctx_slots.append(ctx)
            slots.append(ctx[pos[i] :])
            positions.append(torch.arange(pos[i], pos[i] + n))
            row += n
            rows.append(row - 1)
            pos[i] += n
        attn = PagedAttention(pool, 0, torch.cat(slots), meta, cfg.head_dim**-0.5)
        batch = ForwardBatch(torch.cat(positions), torch.tensor(rows), attn)
        out.append(model(tokens, batch))
    return torch.cat(out)


def _op_by_op(model) -> None:
    for block in model.blocks:
        block._native = False


@pytest.mark.parametrize(
    "shape,quant,kv",
    [("tiny-llama", "q4_k_m", "fp16"), ("tiny-llama", "q4_k_m", "fp32"),
     ("tiny-qwen2", "q4_k_m", "fp16"), ("tiny-qwen3", "q4_k_m", "fp16")],
)  # fmt: skip
def test_native_block_equals_op_by_op(tmp_path, shape, quant, kv):
    path = write_synthetic(tmp_path / "m.gguf", shape, quant, seed=3, progress=False)
    rt = RuntimeConfig(device="cpu", weights="qdot", threads=2)
    _, fast = load_model(path, rt)
    got = _steps(fast, kv, [37, 5, 1], decodes=4)
    assert all(b._native for b in fast.blocks), "every block should run as one native call"
    parts = [len(b.attn.wqkv.packed_parts) for b in fast.blocks]
    if quant == "q4_k_m" and shape == "tiny-llama":
        assert max(parts) > 1, "Q4_K_M's q|k beside a Q6_K v: a linear of two parts"
    if shape == "tiny-qwen2":
        assert fast.blocks[0].attn.wqkv.bias is not None
    _, slow = load_model(path, rt)
    _op_by_op(slow)
    want = _steps(slow, kv, [37, 5, 1], decodes=4)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)


def test_blocks_it_does_not_take_run_op_by_op(tmp_path):
    """Experts (qwen3moe), an fp8 cache, fp16-packed weights: the op-by-op path, same logits."""
    path = write_synthetic(tmp_path / "moe.gguf", "tiny-qwen3moe", "q8_0", seed=1, progress=False)
    _, moe = load_model(path, RuntimeConfig(device="cpu", weights="qdot", threads=2))
    _steps(moe, "fp16", [9], decodes=1)
    assert not any(b._native for b in moe.blocks)

    path = write_synthetic(tmp_path / "l.gguf", "tiny-llama", "q8_0", seed=1, progress=False)
    _, fp16 = load_model(path, RuntimeConfig(device="cpu", weights="fp16", threads=2))
    _steps(fp16, "fp16", [9], decodes=1)
    assert not any(b._native for b in fp16.blocks)

    rt = RuntimeConfig(device="cpu", weights="qdot", threads=2)
    _, a = load_model(path, rt)
    got = _steps(a, "fp8", [20, 3], decodes=2)  # native_layer() declines: op by op
    _, b = load_model(path, rt)
    _op_by_op(b)
    assert torch.equal(got, _steps(b, "fp8", [20, 3], decodes=2))
