"""The grouped expert matmul on the qdot kernels (kernels/cpu_qdot_moe.py) against the dense qdot
kernel on each expert's own GGUF slice (bit for bit: the same sums in the same order), against
the exact weights within the activations' rounding, and reading only the chosen experts."""

from __future__ import annotations

import pytest
import torch

from hetero.kernels import cpu_qdot, native
from hetero.kernels.cpu_qdot_moe import grouped_matmul, pack_experts, route, runs_natively
from hetero.kernels.cpu_qdot_ref import quantize_x_reference
from hetero.quant import dequantize, get_quant
from tests.support.expert_blocks import random_experts

pytestmark = pytest.mark.skipif(not cpu_qdot.available(), reason="no C compiler builds the kernel")

TYPES = ("Q4_0", "Q8_0", "Q2_K", "Q4_K", "Q6_K") + (("MXFP4",) if runs_natively("MXFP4") else ())


def per_expert(x, raw, ggml_type, ids, gather: bool) -> torch.Tensor:
    """[S, N] in slot order: each slot's row through qdot_linear on its expert's slice."""
    qt, (_, n, _) = get_quant(ggml_type), raw.shape
    k = x.shape[1]
    flat = ids.reshape(-1).tolist()
    rows = [s // ids.shape[1] if gather else s for s in range(len(flat))]
    return torch.cat(
        [
            cpu_qdot.qdot_linear(x[r : r + 1], cpu_qdot.pack(raw[e].contiguous(), qt, n, k))
            for r, e in zip(rows, flat)
        ]
    )


def unsort(y: torch.Tensor, r) -> torch.Tensor:
    out = torch.empty_like(y)
    out[r.order] = y
    return out


def test_routing_groups_slots_by_expert_stably():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [1, 3]])
    r = route(ids, 5)
    assert r.expert_of.tolist() == [0, 1, 1, 1, 2, 3, 3, 3]
    assert r.order.tolist() == [3, 1, 2, 6, 5, 0, 4, 7]  # each expert's slots in slot order
    assert r.rows.tolist() == [s // 2 for s in r.order.tolist()]
    assert r.experts.tolist() == [0, 1, 2, 3] and r.offsets.tolist() == [0, 1, 4, 5, 8]
    with pytest.raises(ValueError, match="0..4"):
        route(torch.tensor([[5, 0]]), 5)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_each_slot_is_the_dense_kernel_on_its_expert(ggml_type: str):
    e, k = 8, 512
    for n, t, top, threads in ((21, 1, 2, 1), (48, 5, 3, 2), (40, 17, 4, 3)):  # N % 16 != 0
        raw = random_experts(ggml_type, e, n, k, seed=n)
        gate, up = (
            pack_experts(raw, ggml_type, (e, n, k)),
            pack_experts(raw.flip(0), ggml_type, (e, n, k)),
        )
        ids = torch.stack([torch.randperm(e)[:top] for _ in range(t)])
        r = route(ids, e)
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        g, u = grouped_matmul(x, [gate, up], r, gather=True, threads=threads)
        assert torch.equal(unsort(g, r), per_expert(x, raw, ggml_type, ids, True))
        assert torch.equal(unsort(u, r), per_expert(x, raw.flip(0), ggml_type, ids, True))
        a = torch.randn(t * top, k)  # one row a slot (the down projection's input), sorted
        (d,) = grouped_matmul(a[r.order], [gate], r, gather=False, threads=threads)
        assert torch.equal(unsort(d, r), per_expert(a, raw, ggml_type, ids, False))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_against_exact_weights_within_activation_rounding(ggml_type: str):
    """|y - x @ W_e^T| <= sum_j |w_j| * xd_j / 2 per slot, W_e the GGUF's exact weights."""
    e, n, k, t = 6, 32, 512, 9
    raw = random_experts(ggml_type, e, n, k, seed=4)
    exact = dequantize(raw, get_quant(ggml_type).ggml_type, (e, n, k))
    ids = torch.stack([torch.randperm(e)[:2] for _ in range(t)])
    r = route(ids, e)
    x = torch.randn(t, k)
    (y,) = grouped_matmul(x, [pack_experts(raw, ggml_type, (e, n, k))], r, gather=True)
    w = exact[r.expert_of]  # [S, n, k]
    qb = 256 if get_quant(ggml_type).block_size == 256 else 32
    step = quantize_x_reference(x, qb)[1].repeat_interleave(qb, dim=1)[r.rows]  # [S, k]
    want = torch.einsum("sk,snk->sn", x[r.rows], w)
    bound = 0.5 * torch.einsum("sk,snk->sn", step, w.abs())
    bound += 1e-5 * torch.einsum("sk,snk->sn", x[r.rows].abs(), w.abs())
    assert ((y - want).abs() <= bound).all()


def test_only_the_chosen_experts_are_read():
    """Every byte of the experts no token chose set to 0xff (scales NaN): the outputs do not
    change, so the call never read them."""
    e, n, k = 8, 32, 256
    raw = random_experts("Q4_K", e, n, k, seed=7)
    packed = pack_experts(raw, "Q4_K", (e, n, k))
    ids = torch.tensor([[2, 5], [5, 6]])
    r = route(ids, e)
    x = torch.randn(2, k)
    (before,) = grouped_matmul(x, [packed], r, gather=True)
    for unused in set(range(e)) - {2, 5, 6}:
        packed.packed[unused].fill_(0xFF)
    (after,) = grouped_matmul(x, [packed], r, gather=True)
    assert torch.isfinite(after).all() and torch.equal(before, after)


def test_weights_of_a_grouped_call_must_agree():
    a = pack_experts(random_experts("Q4_K", 4, 16, 256, 0), "Q4_K", (4, 16, 256))
    b = pack_experts(random_experts("Q6_K", 4, 16, 256, 0), "Q6_K", (4, 16, 256))
    with pytest.raises(ValueError, match="share"):
        grouped_matmul(torch.randn(1, 256), [a, b], route(torch.tensor([[0, 1]]), 4), True)


@pytest.mark.skipif("amxemu" not in native.emulations(), reason="no AVX-512 here")
@pytest.mark.parametrize("ggml_type", ("Q4_K", "Q6_K"))
def test_an_expert_with_many_slots_takes_the_amx_tiles_bit_for_bit(ggml_type, monkeypatch):
    """An expert given 32 or more slots (a prompt) multiplies them on AMX tiles, reading the
    activations where they lie (the grouped call packs none): AMX's code, run in C here, equals
    the AVX-512 build's floats exactly, the experts with few slots beside it included."""
    e, n, k = 4, 48, 512
    raw = random_experts(ggml_type, e, n, k, seed=11)
    w = pack_experts(raw, ggml_type, (e, n, k))
    ids = torch.zeros(70, 2, dtype=torch.long)
    ids[:, 1] = torch.arange(70) % 3 + 1  # expert 0: 70 slots; 1-3: 23-24 each
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))
    out = {}
    for isa in ("avx512", "amxemu"):
        monkeypatch.setenv("HETERO_CPU_ISA", isa)
        out[isa] = grouped_matmul(x, [w], route(ids, e), gather=True, threads=2)[0]
    assert torch.equal(out["amxemu"], out["avx512"])
