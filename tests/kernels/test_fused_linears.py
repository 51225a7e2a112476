"""Sibling linears fused at load (q|k|v, gate|up): adjacent tensors of one GGUF type become one
matmul, a type change starts a new part. On a Q4_K_M model whose last layer has a Q6_K attn_v,
the fused model's logits equal the unfused one's: through the torch reference, and through the
Triton kernels (under the interpreter on a CPU, compiled on a GPU: the same load code)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from hetero.config import RuntimeConfig
from hetero.kernels import ops
from hetero.kernels.registry import forcing
from hetero.model.contiguous_kv import ContiguousKV
from hetero.model.forward_batch import ForwardBatch
from hetero.model.llama import load_model
from hetero.synth import write_synthetic
from hetero.synth_shapes import ModelShape
from tests.support.triton_interp import DEVICE, kernels_runnable, rerun_test  # noqa: F401  (autouse fixture)

test_in_a_fresh_interpreter_process = rerun_test(__file__)

SHAPE = ModelShape(
    arch="llama", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=256,
    vocab_size=384, context_length=256, rope_theta=10000.0, norm_eps=1e-5, tied_embeddings=False,
)  # fmt: skip
TOKENS = [5, 17, 99, 3, 250, 42, 7]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("fuse") / "m.gguf", SHAPE, "q4_k_m", False)


def _logits(path, fuse: bool, kernels: str) -> tuple[object, torch.Tensor]:
    """Logits [T, V] of TOKENS (one prefill step) with the given qlinear implementation."""
    with forcing({"qlinear": kernels}):
        rt = RuntimeConfig(
            device=str(DEVICE),
            weights="quant",
            dtype="fp32",
            fuse_linears=fuse,
            allow_reference=True,
        )
        _, model = load_model(path, rt)
        kv = ContiguousKV(model.config, len(TOKENS), torch.float32, str(DEVICE))
        kv.begin(len(TOKENS))
        ids = torch.tensor(TOKENS, device=DEVICE)
        positions = torch.arange(len(TOKENS), device=DEVICE)
        return model, model(ids, ForwardBatch(positions, positions, kv))


def test_parts_follow_the_gguf_types(model_file) -> None:
    model, _ = _logits(model_file, True, "torch")
    first, last = model.blocks[0].attn.wqkv, model.blocks[1].attn.wqkv
    assert first.parts is None  # q, k, v all Q4_K: one matmul
    assert [(t, s) for _, t, s in last.parts] == [(T.Q4_K, (384, 256)), (T.Q6_K, (128, 256))]
    assert all(b.ffn.gate_up.parts is None for b in model.blocks)  # gate | up: one matmul
    unfused, _ = _logits(model_file, False, "torch")
    assert len(unfused.blocks[0].attn.wqkv.parts) == 3
    assert len(unfused.blocks[0].ffn.gate_up.parts) == 2


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_fused_logits_equal_unfused(model_file, kernels: str) -> None:
    assert "qlinear" in ops()
    _, fused = _logits(model_file, True, kernels)
    _, unfused = _logits(model_file, False, kernels)
    assert fused.shape == (len(TOKENS), SHAPE.vocab_size)
    if kernels == "torch":  # each output is the same row of W times x, summed alike
        assert torch.equal(fused, unfused)
    else:  # split-K follows the row count: the same sums in another order
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-4)
