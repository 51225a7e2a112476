"""Experts on the CPU's qdot kernels (model/moe_qdot.py): the expert layer against the same
layer in torch with the exact weights and the activations rounded as the kernels round them
(q8 per block before each matmul: the only rounding the kernels add), and the tiny qwen3moe
with its experts as --cpu-moe runs them (RAM, the CPU's default weights mode: qdot) against
HF transformers, greedy tokens included.

The rest of the model runs the exact reference there (as a GPU's layers would), so the
comparison measures the experts' path: on these tiny random MoE models the dense layers' own
int8 activations flip routing near-ties (a row off by 0.56 of its norm with every matrix on
qdot, experts on the reference or not), which says nothing about the expert kernels. MXFP4
experts take the qdot kernels where the kernel table has the type, the reference where not.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

from hetero.config import RuntimeConfig
from hetero.kernels import cpu_qdot
from hetero.kernels.cpu_qdot_moe import runs_natively
from hetero.kernels.cpu_qdot_ref import quantize_x_reference
from hetero.model.llama import load_model
from hetero.model.moe import Experts, experts_runtime
from hetero.quant import dequantize, get_quant
from tests.model.test_moe_models import MAKERS, engine_rows, runtime
from tests.support.moe_models import load_weights_from, write_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not cpu_qdot.available(), reason="the qdot kernel did not build")

FILES = [("qwen3moe", T.Q4_K), ("gpt-oss", T.Q4_K), ("gpt-oss", T.MXFP4)]
# ||row - transformers' row|| / ||transformers' row||, every row the engine produced, experts
# on qdot: measured 1.4-2.5e-2 (qwen3moe Q4_K, seed 1; the dense qdot model test's 2e-2 is a
# bound on all rows together, of a llama without routing)
ROW_REL = 4e-2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(arch, type) -> (HF model holding the file's dequantized weights, path)."""
    folder = tmp_path_factory.mktemp("moe_qdot")
    out = {}
    for arch, qtype in FILES:
        model = MAKERS[arch](seed=1)
        path = write_gguf(model, folder / f"{arch}-{qtype.name}.gguf", qtype)
        load_weights_from(model, path)
        out[arch, qtype] = (model, path)
    return out


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def rounded(x: torch.Tensor, ggml_type) -> torch.Tensor:
    """x as the kernels see it: int8 codes times their block's scale (q8_0 / q8_K)."""
    qb = 256 if get_quant(ggml_type).block_size == 256 else 32
    xq, xd, _ = quantize_x_reference(x.float().contiguous(), qb)
    return xq.float() * xd.repeat_interleave(qb, dim=1)


def rounded_layer(gm, i: int, layer: Experts, h, ids, w) -> torch.Tensor:
    """The expert layer in torch: exact weights, activations rounded before each matmul."""
    p = f"blk.{i}.ffn_"

    def matmul(x, part: str, e: int) -> torch.Tensor:
        t, b = gm.tensor(f"{p}{part}_exps.weight"), gm.get(f"{p}{part}_exps.bias")
        y = rounded(x, t.ggml_type) @ dequantize(t.torch()[e], t.ggml_type, t.shape[1:]).t()
        return y if b is None else y + dequantize(b.torch(), b.ggml_type, b.shape)[e]

    out = torch.zeros_like(h)
    for t, j in ((t, j) for t in range(ids.shape[0]) for j in range(ids.shape[1])):
        e, x = int(ids[t, j]), h[t : t + 1]
        a = layer._act(matmul(x, "gate", e), matmul(x, "up", e))
        out[t] += w[t, j] * matmul(a, "down", e)[0]
    return out


@pytest.mark.parametrize(("arch", "qtype"), FILES)
def test_expert_layer_is_the_exact_layer_on_rounded_activations(files, arch, qtype):
    path = files[arch, qtype][1]
    gm, model = load_model(path, RuntimeConfig(device="cpu", weights="auto"))
    native = runs_natively(qtype)
    for i, block in enumerate(model.blocks):
        layer = block.ffn.experts
        assert (layer.qdot is not None) == native
        for t in (1, 2, 13):  # a decode step, two streams, a prompt chunk
            h = torch.randn(t, model.config.d_model, generator=torch.Generator().manual_seed(t))
            ids, w = block.ffn.router(h)
            got = layer(h, ids, w)
            assert got.shape == (t, model.config.d_model)
            if native:  # float32 sums in another order: the only difference
                want = rounded_layer(gm, i, layer, h, ids, w)
                assert rel(got, want) < 1e-5, f"{arch} {qtype.name} T={t}"


@pytest.mark.parametrize(("arch", "qtype"), FILES[:2])
def test_router_and_experts_on_the_cpu_run_as_one_call(files, arch, qtype):
    """Router and experts on this CPU: the block's feed-forward routes inside the native call,
    as the router module routes (float32 dot products in another order: within 1e-5)."""
    gm, model = load_model(files[arch, qtype][1], RuntimeConfig(device="cpu", weights="auto"))
    for block in model.blocks:
        ffn = block.ffn
        assert ffn._routed is not None
        for t in (1, 13):
            h = torch.randn(t, model.config.d_model, generator=torch.Generator().manual_seed(t))
            want = ffn.experts(h, *ffn.router(h))
            assert rel(ffn(h), want) < 1e-5, f"{arch} T={t}"


def test_cpu_moe_experts_match_transformers(files):
    """Every logits row the engine produced (prompts, decode steps) within ROW_REL of
    transformers' at that position, and every greedy token transformers' top token or one
    within twice that row's largest logit error of it (a near-tie the rounding may flip)."""
    hf, path = files["qwen3moe", T.Q4_K]
    gm, model = load_model(path, runtime("quant"))  # the rest exact, as a GPU's layers
    on_gpu = RuntimeConfig(device="cuda", cpu_moe=True)
    for i, block in enumerate(model.blocks):
        rt = experts_runtime(gm.config, on_gpu, i)  # what --cpu-moe gives the experts
        block.ffn.experts = Experts(gm, i, rt, block.ffn.experts.activation)
        assert block.ffn.experts.qdot is not None
    finals, rec, _ = engine_rows(path, "quant", loaded=(gm, model), speculative="off")
    ref = {}
    for seq in finals:
        with torch.no_grad():
            ref[tuple(seq)] = hf(torch.tensor([seq])).logits[0]
    n, worst = 0, 0.0
    for prefix, row in rec.rows:
        seq = next(s for s in finals if s[: len(prefix)] == prefix)
        want = ref[tuple(seq)][len(prefix) - 1]
        worst = max(worst, rel(row, want))
        if len(prefix) < len(seq):  # the token greedy decoding chose here
            assert want.max() - want[seq[len(prefix)]] <= 2 * (row - want).abs().max()
        n += 1
    assert n == 4 * 6
    assert 0 < worst < ROW_REL, f"max row error {worst:.2e} of the logits' norm"
