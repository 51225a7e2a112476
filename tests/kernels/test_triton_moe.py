"""The grouped MoE matmul (kernels/triton_moe.py) against the torch reference (kernels/moe.py).

Random expert weights in every packable GGUF type (MXFP4 included), random routings (some
experts chosen by many slots, some by none), x one row a token (gate/up) or one row a slot
(down). Without CUDA the kernel runs under Triton's interpreter on small shapes.
"""

from __future__ import annotations

import pytest
import torch

from hetero.kernels import implementations
from hetero.kernels import triton_moe as tm
from hetero.kernels import triton_moe_sort as ts
from hetero.kernels.moe import moe_matmul_ref, slot_rows
from hetero.kernels.registry import prepare_weight
from hetero.kernels.repack import SPECS
from hetero.quant import dequantize, get_quant
from tests.support.expert_blocks import random_experts
from tests.support.triton_interp import (  # noqa: F401  (kernels_runnable: an autouse fixture)
    CUDA,
    DEVICE,
    kernels_runnable,
    rerun_test,
)

triton = pytest.importorskip("triton")

test_in_a_fresh_interpreter_process = rerun_test(__file__)

TYPES = [t.name for t in SPECS]


def routing(t: int, top: int, e: int, seed: int) -> torch.Tensor:
    """topk_ids [T, top]: distinct experts a token, expert 0 favoured, the last never chosen."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e - 1, generator=g)
    scores[:, 0] += 0.5
    return scores.topk(top, dim=-1).indices.to(DEVICE)


def test_sort_by_expert_puts_each_slot_once_in_a_block_of_its_expert():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [5, 2]], device=DEVICE)
    sorted_ids, expert_ids = ts.sort_by_expert(ids, 6, 4)
    s, flat = ids.numel(), ids.flatten().tolist()
    blocks = sorted_ids.view(-1, 4).tolist()
    seen = []
    for block, e in zip(blocks, expert_ids.tolist()):
        real = [i for i in block if i < s]
        if e < 0:
            assert not real
            continue
        assert real and all(flat[i] == e for i in real)
        assert real == sorted(real) and block[: len(real)] == real  # padding only at the end
        seen += real
    assert sorted(seen) == list(range(s))
    assert expert_ids.tolist()[:4] == [0, 1, 2, 5]


@pytest.mark.parametrize(
    "t,top,e,bt",
    [
        (4, 2, 6, 4),
        (3, 2, 5, 16),
        (32, 8, 128, 8),
        (40, 8, 128, 16),
        (100, 4, 16, 64),
        (150, 2, 3, 8),
    ],
)
def test_the_sort_kernel_gives_the_references_layout(t: int, top: int, e: int, bt: int):
    """moe_align_kernel (one launch) against the torch ops it replaced, entry for entry: more
    slots than a program places, experts with none, experts over several blocks."""
    ids = routing(t, top, e, seed=t)
    got, want = ts.sort_by_expert(ids, e, bt), ts.sort_by_expert_ref(ids, e, bt)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_one_sort_serves_a_layers_calls_within_its_scope():
    from hetero.kernels.moe import routing_scope

    ids = routing(6, 2, 5, seed=1)
    with routing_scope():
        first = ts.sort_by_expert(ids, 5, 16)
        assert all(a is b for a, b in zip(ts.sort_by_expert(ids, 5, 16), first))
        other = ts.sort_by_expert(ids.clone(), 5, 16)  # another tensor: sorted again
        assert other[0] is not first[0] and torch.equal(other[0], first[0])
        assert ts.sort_by_expert(ids, 5, 8)[0] is not first[0]  # another block size
    assert ts.sort_by_expert(ids, 5, 16)[0] is not first[0]  # outside the scope: nothing kept


# (E, T, k): the GEMV path (<= GEMV_MAX_SLOTS slots), then the sorted tensor-core path with 4.2,
# 1.5 and 14.4 slots an expert
PATHS = [(5, 1, 2), (5, 4, 4), (5, 7, 3), (12, 9, 2), (5, 24, 3)]


def test_the_cases_take_each_path():
    slots = [t * top for _, t, top in PATHS]
    assert max(slots[:2]) <= tm.GEMV_MAX_SLOTS < min(slots[2:])


@pytest.mark.parametrize("ggml_type", TYPES)
def test_grouped_matmul_equals_reference(ggml_type: str):
    n = 40  # 40 rows: a masked tile of 64 (and of 32 twice)
    k = 512 if get_quant(ggml_type).block_size == 256 else 352  # 11 blocks of 32: a ragged step
    qt = int(get_quant(ggml_type).ggml_type)
    for e, t, top in PATHS:
        raw = random_experts(ggml_type, e, n, k, seed=len(ggml_type) + e, device=DEVICE)
        packed = tm.prepare_moe(raw, qt, (e, n, k))
        ids = routing(t, top, e, seed=t)
        g = torch.Generator().manual_seed(t)
        for rows in (t, t * top):  # gate/up read a token's row, down a slot's
            x = torch.randn(rows, k, generator=g).to(DEVICE)
            want = moe_matmul_ref(x, raw, qt, (e, n, k), ids)
            got = tm.moe_matmul_triton(x, packed, qt, (e, n, k), ids)
            w = dequantize(raw.reshape(e * n, -1), qt, (e * n, k)).abs().view(e, n, k)
            bound = (x.abs()[slot_rows(x, ids)][:, None, :] * w[ids.flatten()]).sum(-1)
            assert got.shape == want.shape == (t * top, n)
            assert torch.allclose(got, want, atol=1e-6, rtol=0) or bool(
                ((got - want).abs() <= 4e-6 * bound + 1e-6).all()
            ), f"{ggml_type} T={t} k={top}: max error {(got - want).abs().max().item():.2e}"


def test_every_registered_implementation_equals_the_reference():
    e, n, k = 4, 24, 256
    raw = random_experts("Q4_K", e, n, k, seed=7, device=DEVICE)
    qt = int(get_quant("Q4_K").ggml_type)
    ids = routing(3, 2, e, seed=3)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    want = moe_matmul_ref(x, raw, qt, (e, n, k), ids)
    impls = implementations("moe_matmul")
    assert {i.name for i in impls} >= {"torch", "triton"}
    for impl in impls:
        w = prepare_weight(impl, raw, qt, (e, n, k))
        got = impl.fn(x, w, qt, (e, n, k), ids)
        assert (got - want).abs().max().item() < 1e-4, impl.name


@pytest.mark.skipif(not CUDA, reason="needs CUDA (bf16 tensor cores)")
@pytest.mark.gpu
def test_bf16_on_the_device_and_dense_experts_fall_back():
    e, n, k = 8, 96, 512
    raw = random_experts("Q4_K", e, n, k, seed=1, device=DEVICE)
    qt = int(get_quant("Q4_K").ggml_type)
    ids = routing(33, 4, e, seed=5)
    x = torch.randn(33, k, device=DEVICE, dtype=torch.bfloat16)
    want = moe_matmul_ref(x.float(), raw, qt, (e, n, k), ids)
    got = tm.moe_matmul_triton(x, tm.prepare_moe(raw, qt, (e, n, k)), qt, (e, n, k), ids)
    assert ((got.float() - want).abs() / (want.abs() + 1)).max().item() < 3e-2
    dense = dequantize(raw.reshape(e * n, -1), qt, (e * n, k)).view(e, n, k)
    assert torch.equal(tm.moe_matmul_triton(x.float(), dense, qt, (e, n, k), ids), want)


def test_gpt_oss_as_released_through_the_kernel(tmp_path):
    """A whole forward of a tiny gpt-oss with MXFP4 experts (`hetero synth`), the experts
    through the kernel (prepared at load, as on a GPU) against the reference path."""
    from hetero.config import RuntimeConfig
    from hetero.kernels.registry import forcing
    from hetero.model.contiguous_kv import ContiguousKV
    from hetero.model.forward_batch import ForwardBatch
    from hetero.model.llama import load_model
    from hetero.synth import write_synthetic

    path = write_synthetic(tmp_path / "g.gguf", "tiny-gpt-oss", "mxfp4_moe", progress=False)
    ids = torch.tensor([3, 901, 17, 2048, 77, 5])

    def logits() -> torch.Tensor:
        rt = RuntimeConfig(device=str(DEVICE), weights="quant", dtype="fp32", allow_reference=True)
        _, model = load_model(path, rt)
        kv = ContiguousKV(model.config, len(ids), torch.float32, str(DEVICE))
        kv.begin(len(ids))
        rows = torch.arange(len(ids))
        return model(ids.to(DEVICE), ForwardBatch(rows.to(DEVICE), rows.to(DEVICE), kv))

    want = logits()
    with forcing({"moe_matmul": "triton"}):
        got = logits()
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "gating,norm", [("softmax", True), ("softmax", False), ("softmax_topk", False)]
)
def test_every_router_implementation_picks_the_references_experts(gating: str, norm: bool):
    """moe_route: the same k experts, largest first, and their weights, as the reference; E not
    a power of two (masked lanes). One token has two tied top logits, which torch orders as it
    likes: there the kernel's rule (the lower id first) is checked, and the pair as a set."""
    g = torch.Generator().manual_seed(11)
    for t, e, k in ((1, 128, 8), (5, 12, 3)):
        logits = torch.randn(t, e, generator=g).to(DEVICE)
        logits[-1, 2] = logits[-1, 7] = logits[-1].max() + 1  # a tie for the top
        want_ids, want_w = implementations("moe_route")[-1].fn(logits, k, gating, norm)
        for impl in implementations("moe_route"):
            ids, w = impl.fn(logits, k, gating, norm)
            assert ids[:-1].tolist() == want_ids[:-1].tolist(), impl.name
            assert ids[-1, 2:].tolist() == want_ids[-1, 2:].tolist(), impl.name
            assert set(ids[-1, :2].tolist()) == {2, 7}, impl.name
            if not impl.is_reference:
                assert ids[-1, :2].tolist() == [2, 7], impl.name
            assert (w - want_w).abs().max().item() < 1e-6, impl.name  # tied: equal weights


def test_every_router_logits_implementation_equals_the_reference():
    """moe_router: float32 logits of h in its own dtype, E not a multiple of the experts a
    program (12 of 8s), C past one step of 512 with a masked tail (700), with and without a
    bias; past ROUTER_MAX_T tokens the Triton op hands over to the reference."""
    from hetero.kernels import triton_moe_route

    g = torch.Generator().manual_seed(13)
    e, c = 12, 700
    weight = torch.randn(e, c, generator=g).to(DEVICE)
    bias = torch.randn(e, generator=g).to(DEVICE)
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if CUDA else ())
    impls = implementations("moe_router")
    assert {i.name for i in impls} >= {"torch", "triton"}
    for t in (1, 3, triton_moe_route.ROUTER_MAX_T + 1):
        for dtype in dtypes:
            h = torch.randn(t, c, generator=g).to(DEVICE, dtype)
            for b in (None, bias):
                want = implementations("moe_router")[-1].fn(h, weight, b)
                assert want.dtype == torch.float32 and want.shape == (t, e)
                for impl in impls:
                    got = impl.fn(h, weight, b)
                    assert got.dtype == torch.float32, impl.name
                    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (impl.name, t, dtype)


def test_every_combine_implementation_sums_the_slots_by_their_weights():
    g = torch.Generator().manual_seed(12)
    t, k, c = 3, 4, 1100  # columns past one tile of 1024
    w = torch.rand(t, k, generator=g).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        o = torch.randn(t * k, c, generator=g).to(DEVICE, dtype)
        want = (o.float().view(t, k, c) * w[..., None]).sum(1)
        for impl in implementations("moe_combine"):
            got = impl.fn(o, w)
            assert got.dtype == dtype and got.shape == (t, c), impl.name
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert (got.float() - want).abs().max().item() < tol * (1 + want.abs().max().item())


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K", "MXFP4"])
def test_the_gemvs_rows_a_program_leave_every_sum_as_it_was(ggml_type: str, monkeypatch):
    """GEMV_BLOCK_N (what benchmarks/gpu_moe.py sweeps) only regroups rows into programs: each
    row's sum runs the same steps, so the outputs are equal bit for bit."""
    e, n, k = 6, 96, 512
    raw = random_experts(ggml_type, e, n, k, seed=3, device=DEVICE)
    qt = int(get_quant(ggml_type).ggml_type)
    packed = tm.prepare_moe(raw, qt, (e, n, k))
    ids = routing(2, 2, e, seed=4)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want = tm.moe_matmul_triton(x, packed, qt, (e, n, k), ids)
    for bn in (16, 32):
        monkeypatch.setattr(tm, "GEMV_BLOCK_N", bn)
        assert torch.equal(tm.moe_matmul_triton(x, packed, qt, (e, n, k), ids), want), bn


# each low-bit width, with and without a high plane and mins, and the codebook types
INT_TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q2_K", "Q5_0", "MXFP4", "IQ4_XS", "IQ4_NL"]


@pytest.mark.parametrize("ggml_type", INT_TYPES)
def test_integer_gemv_of_16_bit_slots_equals_reference(ggml_type: str, monkeypatch):
    """bf16 decode slots take the integer Stream-K GEMV (triton_moe_streamk): every slot's
    expert rows against the reference, within bf16's rounding of x, of the bias and of the
    output; gate/up (a token's row for its k slots, a bias) and down (a row a slot, no bias)
    alternate between the types."""
    qt = get_quant(ggml_type)
    e, n = 5, 40
    k = 512 if qt.block_size == 256 else 352  # 352: 11 blocks of 32, a ragged unit
    raw = random_experts(ggml_type, e, n, k, seed=len(ggml_type), device=DEVICE)
    x16 = torch.bfloat16
    packed = tm.prepare_moe(raw, int(qt.ggml_type), (e, n, k))
    assert tm._int_gemv_ok(packed.packed, x16) == bool(SPECS[qt.ggml_type].codebook)
    monkeypatch.setattr(tm, "GEMV_INT_LINEAR", True)  # (linear codes: slower on the H200)
    packed = tm.prepare_moe(raw, int(qt.ggml_type), (e, n, k))  # (a high plane as bytes)
    assert tm._int_gemv_ok(packed.packed, x16)
    ids = torch.tensor([[0, 3], [4, 1]], device=DEVICE)
    rows = 2 if INT_TYPES.index(ggml_type) % 2 else 4
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x = x.to(torch.bfloat16)
    bias = None  # gpt-oss's expert biases, added in the kernel: on every other type
    if INT_TYPES.index(ggml_type) % 2:
        bias = torch.randn(e, n, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = tm.moe_matmul_triton(
        x, packed, int(qt.ggml_type), (e, n, k), ids, None if bias is None else bias.bfloat16()
    )
    want = moe_matmul_ref(x.float(), raw, int(qt.ggml_type), (e, n, k), ids, bias)
    w = dequantize(raw.reshape(e * n, -1), int(qt.ggml_type), (e * n, k)).abs().view(e, n, k)
    scale = (x.float().abs()[slot_rows(x, ids)][:, None, :] * w[ids.flatten()]).sum(-1)
    eps = 2.0**-7
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (4, n)
    bad = (got.float() - want).abs() > 4 * eps * scale + 2 * eps * want.abs() + 1e-6
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off"
    if CUDA:  # the fix-up's counters reset themselves: the same bits again
        again = tm.moe_matmul_triton(
            x, packed, int(qt.ggml_type), (e, n, k), ids, None if bias is None else bias.bfloat16()
        )
        assert torch.equal(again, got)


def test_down_input_quantized_with_its_activation():
    """quantize_input: the activation and the quantization in one launch give the integer GEMV
    the bits that the activation's own kernel and xquant give (codebook experts, bf16 slots);
    None where another kernel reads the slots; a layout it did not make is refused."""
    from hetero.kernels import implementations

    qt = get_quant("MXFP4")
    e, n, k = 5, 40, 352
    raw = random_experts("MXFP4", e, n, k, seed=9, device=DEVICE)
    packed = tm.prepare_moe(raw, int(qt.ggml_type), (e, n, k))
    ids = torch.tensor([[0, 3], [4, 1]], device=DEVICE)
    g = torch.Generator().manual_seed(3)
    gate, up = (4 * torch.randn(4, k, generator=g)).to(DEVICE, torch.bfloat16).chunk(2, dim=0)
    gate, up = torch.cat([gate, up]), torch.cat([up, gate])  # [4, k] each: a row a slot
    swiglu = next(i for i in implementations("swiglu_oai") if i.name == "triton").fn
    xq = tm.quantize_input(packed, gate, up, "swiglu_oai")
    assert isinstance(xq, tm.QuantizedRows) and xq.shape == (4, k)
    shape = (e, n, k)
    got = tm.moe_matmul_triton(xq, packed, int(qt.ggml_type), shape, ids)
    assert torch.equal(
        got, tm.moe_matmul_triton(swiglu(gate, up), packed, int(qt.ggml_type), shape, ids)
    )
    q4 = tm.prepare_moe(random_experts("Q4_K", e, n, 512, seed=2, device=DEVICE), 12, (e, n, 512))
    assert tm.quantize_input(q4, gate, up, "silu") is None  # (K-quants: the float GEMV)
    assert tm.quantize_input(packed, gate.float(), up.float(), "silu") is None
    with pytest.raises(ValueError, match="layout"):
        bad = tm.QuantizedRows(xq.words, xq.floats, tm.XLayout(4, 16), xq.dtype)
        tm.moe_matmul_triton(bad, packed, int(qt.ggml_type), shape, ids)


@pytest.mark.parametrize("ggml_type", ["Q6_K", "MXFP4"])
def test_gemvs_over_slots_sorted_by_expert_give_each_slot_its_own_rows(ggml_type, monkeypatch):
    """GEMV_SORTED_SLOTS: more slots than GEMV_MAX_SLOTS through the GEMVs in expert order (x's
    rows gathered, y's scattered back) give every slot what the GEMVs give it in slot order:
    the float GEMV bit for bit (float32 slots), the integer Stream-K GEMV of bf16 slots of a
    codebook type within bf16's rounding (its split-K sums may group differently); gate/up
    (a token's row for its k slots, a bias) and down (a row a slot)."""
    qt = get_quant(ggml_type)
    e, n, t, top = 6, 40, 9, 3  # 27 slots
    k = 512 if qt.block_size == 256 else 352
    raw = random_experts(ggml_type, e, n, k, seed=len(ggml_type) + 3, device=DEVICE)
    packed = tm.prepare_moe(raw, int(qt.ggml_type), (e, n, k))
    ids = routing(t, top, e, seed=11)
    g = torch.Generator().manual_seed(6)
    bias = torch.randn(e, n, generator=g).to(DEVICE)
    dtype = torch.bfloat16 if SPECS[qt.ggml_type].codebook else torch.float32
    assert t * top > tm.GEMV_MAX_SLOTS
    for rows in (t, t * top):
        x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
        b = bias.to(dtype) if rows == t else None
        monkeypatch.setattr(tm, "GEMV_MAX_SLOTS", 64)
        want = tm.moe_matmul_triton(x, packed, int(qt.ggml_type), (e, n, k), ids, b)
        monkeypatch.setattr(tm, "GEMV_MAX_SLOTS", 16)
        monkeypatch.setattr(tm, "GEMV_SORTED_SLOTS", 64)
        got = tm.moe_matmul_triton(x, packed, int(qt.ggml_type), (e, n, k), ids, b)
        assert got.shape == want.shape == (t * top, n) and got.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            tol = 2.0**-7 * (want.float().abs() + got.float().abs()) + 1e-3
            assert ((got.float() - want.float()).abs() <= tol).all()
