"""The integer tensor-core matmul (kernels/mmq.py): the activations' 8-bit blocks against their
torch reference, and the grouped MoE matmul's sorted blocks through it against the exact
reference, within the bound that the activations' rounding sets. Without CUDA the kernels run
under Triton's interpreter on small shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero.kernels import mmq
from hetero.kernels import triton_moe as tm
from hetero.kernels.moe import moe_matmul_ref, slot_rows
from hetero.quant import dequantize, get_quant, random_blocks
from tests.support.triton_interp import (  # noqa: F401  (kernels_runnable: an autouse fixture)
    DEVICE,
    kernels_runnable,
    rerun_test,
)

triton = pytest.importorskip("triton")

test_in_a_fresh_interpreter_process = rerun_test(__file__)


def test_q8_rows_equal_their_reference():
    """Codes within one of the reference's (a quotient's last bit may round a half the other
    way), scales and sums equal; a block of zeros gives zeros, and s q is within s / 2 of x."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 320, generator=g) * torch.logspace(-3, 2, 320)).to(DEVICE, torch.bfloat16)
    x[1, 32:64] = 0
    q, s, sums = mmq.q8_rows(x)
    rq, rs, rsums = mmq.q8_rows_ref(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and s.shape == sums.shape == (3, 10)
    assert (q.int() - rq.int()).abs().max().item() <= 1
    assert torch.equal(s, rs)
    assert torch.allclose(sums, rsums, rtol=1e-6, atol=1e-30)
    assert not q[1, 32:64].any() and s[1, 1].item() == 0
    err = (q.float() * s.repeat_interleave(32, dim=1) - x.float()).abs()
    assert (err <= s.repeat_interleave(32, dim=1) * 0.5 * (1 + 2**-10)).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        mmq.q8_rows(x[:, :40])


def experts(ggml_type: str, e: int, n: int, k: int, seed: int) -> torch.Tensor:
    qt = get_quant(ggml_type)
    blocks = random_blocks(ggml_type, e * n * k // qt.block_size, np.random.default_rng(seed))
    return torch.from_numpy(blocks).reshape(e, n, -1).to(DEVICE)


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_moe_blocks_on_int8_tensor_cores_within_the_activations_rounding(ggml_type, monkeypatch):
    """bf16 slots in sorted blocks (more than a GEMV's slots) with MMQ on: each slot's rows
    equal the reference on the exact x within the 8-bit activations' rounding (sum |w| s / 2
    over each row) plus bf16's output rounding; gate/up (a token's row for its k slots) and
    down (a row a slot) both; the other K-quants keep the float blocks."""
    monkeypatch.setattr(tm, "MMQ", True)
    qt = get_quant(ggml_type)
    e, n, k, t, top = 6, 40, 512, 9, 3  # 27 slots, 4.5 an expert: sorted blocks of 16
    raw = experts(ggml_type, e, n, k, seed=len(ggml_type))
    packed = tm.prepare_moe(raw, int(qt.ggml_type), (e, n, k))
    assert mmq.mmq_ok(packed.packed, torch.bfloat16)
    assert not mmq.mmq_ok(packed.packed, torch.float32)
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(t, e, generator=g)
    ids = scores.topk(top, dim=-1).indices.to(DEVICE)
    assert ids.numel() > tm.GEMV_MAX_SLOTS
    w = dequantize(raw.reshape(e * n, -1), int(qt.ggml_type), (e * n, k)).view(e, n, k)
    for rows in (t, t * top):
        x = torch.randn(rows, k, generator=g).to(DEVICE, torch.bfloat16)
        got = tm.moe_matmul_triton(x, packed, int(qt.ggml_type), (e, n, k), ids)
        want = moe_matmul_ref(x.float(), raw, int(qt.ggml_type), (e, n, k), ids)
        _, s, _ = mmq.q8_rows_ref(x)
        half = (s.repeat_interleave(32, dim=1) / 2)[slot_rows(x, ids)]  # [S, K]
        bound = (w[ids.flatten()].abs() * half[:, None, :]).sum(-1)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape == (t * top, n)
        err = (got.float() - want).abs()
        bad = err > bound * (1 + 1e-3) + 2.0**-8 * want.abs() + 1e-5
        assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off, max {err.max().item():.3g}"
        assert err.max().item() > 0  # (the 8-bit activations do round)


def test_mmq_leaves_other_types_to_the_float_blocks():
    for name in ("Q4_0", "Q8_0", "Q2_K", "Q3_K", "IQ4_XS", "MXFP4"):
        qt = get_quant(name)
        k = 256
        raw = experts(name, 2, 8, k, seed=1)
        packed = tm.prepare_moe(raw, int(qt.ggml_type), (2, 8, k))
        assert not mmq.mmq_ok(packed.packed, torch.bfloat16), name


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K"])
def test_dense_weight_as_one_expert(ggml_type):
    """mmq_linear: T rows in blocks of 16 (a ragged last block) against the exact product,
    within the activations' rounding, every row written."""
    from hetero.kernels.repack import repack

    qt = get_quant(ggml_type)
    n, k, t = 72, 512, 21
    raw = experts(ggml_type, 1, n, k, seed=3).reshape(n, -1)
    pw = repack(raw, int(qt.ggml_type), (n, k))
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    got = mmq.mmq_linear(x, pw, bt=16)
    w = dequantize(raw, int(qt.ggml_type), (n, k))
    want = x.float() @ w.T
    _, s, _ = mmq.q8_rows_ref(x)
    bound = (s.repeat_interleave(32, dim=1) / 2) @ w.abs().T
    err = (got.float() - want).abs()
    assert got.shape == (t, n) and torch.isfinite(got).all()
    assert (err <= bound * (1 + 1e-3) + 2.0**-8 * want.abs() + 1e-5).all(), err.max().item()
