"""The MoE layer in one native call (kernels/cpu_moe_layer.py) against its torch reference around
the same grouped matmuls (moe_layer_ref): bit for bit given the experts' choice, and within the
router's float32 rounding when the call routes too; decode steps and prompts (whose routing,
activation and sum run as pool jobs), both gatings, both activations, biases, mixed types (gate
and up of one type share one pool job with down; of two types they run in turn)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from hetero.kernels import cpu_qdot
from hetero.kernels.cpu_moe_layer import MoeLayer, RouterWeights, moe_layer, moe_layer_ref
from hetero.kernels.cpu_qdot_moe import pack_experts
from hetero.quant import get_quant, random_blocks

pytestmark = pytest.mark.skipif(not cpu_qdot.available(), reason="no C compiler builds the kernel")

# gpt-oss's activation in C (expf) against torch's sigmoid: an ulp in an activation can carry a
# down-projection input across an int8 rounding step (or move its block's scale), which moves
# that row's output by a step times the weights; measured up to 6.6e-5 of the output's norm
# over 600 draws (MXFP4 with biases)
SWIGLU_REL = 2e-4
E, C, F = 8, 256, 512  # widths the K-quants divide (the grouped tests pad rows)


def packed(ggml_type: str, e: int, n: int, k: int, seed: int):
    qt = get_quant(ggml_type)
    raw = random_blocks(ggml_type, e * n * k // qt.block_size, np.random.default_rng(seed))
    return pack_experts(torch.from_numpy(raw).reshape(e, n, -1), ggml_type, (e, n, k))


def layer(
    types=("Q4_K", "Q4_K", "Q6_K"), act="silu", bias=False, gating="softmax", k=2, norm=True, e=E
) -> MoeLayer:
    g = torch.Generator().manual_seed(0)
    shapes = zip(types, (F, F, C), (C, C, F))
    gate, up, down = (packed(t, e, n, kk, seed=i) for i, (t, n, kk) in enumerate(shapes))
    biases = tuple(torch.randn(e, n, generator=g) if bias else None for n in (F, F, C))
    rb = torch.randn(e, generator=g) if bias else None
    router = RouterWeights(torch.randn(e, C, generator=g) / 16, rb, gating, k, norm)
    return MoeLayer(gate, up, down, biases, act, router)


def tokens(t: int) -> torch.Tensor:
    return torch.randn(t, C, generator=torch.Generator().manual_seed(t))


def choice(t: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(t)])
    return ids, torch.rand(t, k)


CASES = [
    dict(),
    dict(types=("Q4_0", "Q4_0", "Q8_0"), bias=True),
    dict(types=("Q4_K", "Q5_K", "Q4_K")),  # gate and up of two types: two grouped jobs
    dict(types=("IQ4_NL", "IQ4_NL", "IQ4_XS"), k=3),
    dict(types=("MXFP4", "MXFP4", "MXFP4"), act="swiglu_oai", bias=True, gating="softmax_topk"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c.get("types", ["Q4_K"])))
@pytest.mark.parametrize(("t", "threads"), [(1, 1), (1, 2), (5, 2), (64, 3)])
def test_given_the_choice_it_is_the_reference_bit_for_bit(case, t, threads):
    lay = layer(**case)
    ids, w = choice(t, lay.router.k)
    got, gi, gw = moe_layer(lay, tokens(t), ids, w, threads=threads)
    want, _, _ = moe_layer_ref(lay, tokens(t), ids, w, threads=threads)
    assert torch.equal(gi, ids) and torch.equal(gw, w)
    if case.get("act") == "swiglu_oai":
        assert (got - want).norm() <= SWIGLU_REL * want.norm()
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c.get("types", ["Q4_K"])))
@pytest.mark.parametrize("t", [1, 3, 64])
def test_routing_in_the_call_makes_the_routers_choice(case, t):
    lay = layer(**case)
    got, ids, w = moe_layer(lay, tokens(t), threads=2)
    want, want_ids, want_w = moe_layer_ref(lay, tokens(t), threads=2)
    assert torch.equal(ids, want_ids)  # random logits: no near-ties at float32 rounding
    assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-7)
    assert (got - want).norm() <= (SWIGLU_REL if "act" in case else 1e-5) * want.norm()
    if case.get("gating", "softmax") == "softmax":
        assert torch.allclose(w.sum(1), torch.ones(t))  # renormalized


@pytest.mark.parametrize("t", [1, 7])
def test_routing_over_many_experts_scores_them_in_parts(t):
    """40 experts: three routing items a token (16, 16, 8), a prompt's as a pool job."""
    lay = layer(e=40, k=6, bias=True)
    got, ids, w = moe_layer(lay, tokens(t), threads=2)
    want, want_ids, want_w = moe_layer_ref(lay, tokens(t), threads=2)
    assert torch.equal(ids, want_ids) and torch.allclose(w, want_w, rtol=1e-5, atol=1e-7)
    assert (got - want).norm() <= 1e-5 * want.norm()
    assert int(ids.max()) >= 16  # experts of the later parts chosen too


def test_without_renormalizing_the_weights_are_the_softmax_probabilities():
    lay = layer(norm=False)
    _, ids, w = moe_layer(lay, tokens(4))
    p = torch.nn.functional.linear(tokens(4), lay.router.weight).softmax(-1)
    assert torch.allclose(w, p.gather(1, ids), rtol=1e-5) and (w.sum(1) < 1).all()


def test_bad_choices_are_refused():
    lay = layer()
    with pytest.raises(ValueError, match="0..7"):
        moe_layer(lay, tokens(2), torch.tensor([[0, 8], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="must be"):
        moe_layer(lay, tokens(2), torch.tensor([[0, 1], [1, 2]]), torch.ones(2, 3))
    with pytest.raises(ValueError, match="float32"):
        moe_layer(lay, tokens(2).double())
    no_router = MoeLayer(lay.gate, lay.up, lay.down, lay.biases, "silu")
    with pytest.raises(ValueError, match="router"):
        moe_layer(no_router, tokens(2))


@pytest.mark.parametrize("case", CASES[::2], ids=lambda c: "-".join(c.get("types", ["Q4_K"])))
@pytest.mark.parametrize("t", [1, 4])
def test_the_host_function_is_the_routed_call(case, t):
    """moe_layer_hop, the layer as a CUDA host node calls it (kernels/host_hop.py), called here
    directly with the arguments hop() makes: the routed call's output, counted, rc 0."""
    lay, x = layer(**case), tokens(t)
    out = torch.full_like(x, float("nan"))
    args = lay.hop(x.data_ptr(), out.data_ptr(), t, threads=2)
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lay.hop_fn())
    for calls in (1, 2):  # a graph replays the same arguments
        fn(ctypes.addressof(args))
        assert (args.rc, args.calls) == (0, calls)
        assert torch.equal(out, moe_layer(lay, x, threads=2)[0])


def test_a_failing_host_function_reports_through_its_arguments():
    lay = layer()
    x, out = tokens(2), torch.empty(2, C)
    args = lay.hop(x.data_ptr(), out.data_ptr(), 2, threads=1)
    args.k = E + 1  # more experts a token than the layer has
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lay.hop_fn())(ctypes.addressof(args))
    assert args.rc == -3
    with pytest.raises(ValueError, match="expert ids"):
        lay.raise_for(args.rc)
    no_router = MoeLayer(lay.gate, lay.up, lay.down, lay.biases, "silu")
    with pytest.raises(ValueError, match="router"):
        no_router.hop(x.data_ptr(), out.data_ptr(), 2)
