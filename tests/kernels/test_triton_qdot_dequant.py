"""The qdot packing dequantized by the Triton kernel (hetero.kernels.triton_qdot_dequant) against
the packing's own exact unpack (the reference dequantization of the GGUF blocks it holds).

Every type the kernel decodes, N not a multiple of the 16-row groups, two blocks along K, row
slabs that start inside the matrix; float32 bit for bit, half precision as torch rounds it. Without
CUDA the kernel runs under Triton's interpreter (tests/support/triton_interp.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero.kernels import cpu_qdot
from hetero.kernels import triton_qdot_dequant as tqd
from hetero.quant import get_quant, random_blocks
from tests.support.triton_interp import (  # noqa: F401  (kernels_runnable: an autouse fixture)
    CUDA,
    DEVICE,
    kernels_runnable,
    rerun_test,
)

triton = pytest.importorskip("triton")
TYPES = [t.name for t in tqd.SUPPORTED]

test_in_a_fresh_interpreter_process = rerun_test(__file__)


def packed_weight(name: str, n: int, blocks: int, seed: int) -> cpu_qdot.QdotWeight:
    qt = get_quant(name)
    k = blocks * qt.block_size
    raw = random_blocks(name, n * blocks, np.random.default_rng(seed))
    return cpu_qdot.pack(torch.from_numpy(raw.reshape(n, -1)), qt, n, k)


@pytest.mark.parametrize("name", TYPES)
def test_rows_are_the_exact_weights(name):
    n = 37  # three row groups, the last one padded
    w = packed_weight(name, n, 2, seed=len(name))
    want = cpu_qdot.unpack(w)
    packed = w.packed.to(DEVICE)
    got = tqd.dequant_rows(packed, w.ggml_type, n, w.k, 0, n, torch.float32)
    assert torch.equal(got.cpu(), want)  # bit for bit, NaN-free (random_blocks' values)
    # rounded to half precision as torch rounds (to nearest even); the interpreter truncates
    # float32 -> bfloat16, so it checks float16 only, the device both
    for dtype in (torch.float16, torch.bfloat16) if CUDA else (torch.float16,):
        slab = tqd.dequant_rows(packed, w.ggml_type, n, w.k, 16, 35, dtype)
        assert torch.equal(slab.cpu(), want[16:35].to(dtype))


def test_bad_calls_are_refused():
    w = packed_weight("Q4_K", 16, 1, seed=1)
    with pytest.raises(ValueError, match="multiple of 16"):
        tqd.dequant_rows(w.packed, w.ggml_type, 16, w.k, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="no qdot"):
        tqd.dequant_rows(w.packed, w.ggml_type, 32, w.k, 0, 16, torch.float32)
    with pytest.raises(ValueError, match="IQ4_XS"):
        tqd.dequant_rows(w.packed, 23, 16, w.k, 0, 16, torch.float32)
    assert not tqd.supports(23) and tqd.supports(12)


def test_a_streamed_prompt_matmul_reads_the_staged_packing(tmp_path, monkeypatch):
    """execution/offload.py with the kernel on: every linear of a Q4_K_M model (Q4_K and Q6_K
    parts of joined matrices), whole and in slabs of rows, is x @ W^T of the exact weights."""
    from hetero.config import RuntimeConfig
    from hetero.execution import offload
    from hetero.gguf_loader import load_gguf
    from hetero.model.layers import QuantLinear
    from hetero.model.llama import LlamaModel
    from hetero.synth import write_synthetic

    gm = load_gguf(write_synthetic(tmp_path / "t.gguf", "tiny-llama", "q4_k_m", False))
    dense = LlamaModel(gm, RuntimeConfig(device="cpu", weights="dense"))
    model = LlamaModel(gm, RuntimeConfig(device="cpu", weights="qdot"))
    qdot = [m for b in model.blocks[:2] for m in b.modules() if isinstance(m, QuantLinear)]
    exact = [m for b in dense.blocks[:2] for m in b.modules() if isinstance(m, QuantLinear)]
    launches = []
    rows = offload.tqd.dequant_rows
    monkeypatch.setattr(offload.tqd, "dequant_rows", lambda *a: launches.append(a) or rows(*a))
    torch.manual_seed(0)
    device = torch.device(DEVICE)  # the CPU under the interpreter, else the GPU in bf16

    def check(got, x, w):
        if device.type == "cpu":
            assert torch.allclose(got, x @ w.t(), rtol=1e-5, atol=1e-5)
            return
        # x and W's rows rounded to bf16, float32 sums, the product rounded to bf16
        want = x.bfloat16().float() @ w.bfloat16().float().t()
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())

    for slab in (offload.SLAB_ELEMENTS, 16 * 64):  # whole parts, then 16-row slabs
        monkeypatch.setattr(offload, "SLAB_ELEMENTS", slab)
        streamer = offload.StreamedMatmuls(qdot, device, 1, rows_kernel=True)
        with streamer.active():
            for lin, ref in zip(qdot, exact):
                x = torch.randn(3, lin.in_features)
                check(streamer(lin, x), x, ref.weight)
        assert streamer.calls == len(qdot)
    with streamer.active():  # out of the forward's order: items fetched on the spot, evicted
        lin, ref = qdot[-1], exact[-1]
        x = torch.randn(2, lin.in_features)
        check(streamer(lin, x), x, ref.weight)
    # every part read by the kernel: once whole, then slab by slab from a ring of buffers
    parts, last = len(streamer.order), len(streamer._slabs[streamer._key(qdot[-1], 0)])
    assert parts >= len(qdot) and len(launches) == len(streamer.items) + parts + last
    assert len(streamer.items) > 2 * parts and streamer.staging.slots > 2
