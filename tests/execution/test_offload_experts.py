"""Experts kept in RAM run a big step on another device, streamed (execution/offload_experts.py).

On the CPU the "device" is the CPU itself and the copies are plain ones, so everything but the
GPU kernel runs here: the qdot layout undone into GGUF blocks (bit for bit, padded experts
included), the staging buffers' order (prefetch, calls out of order), and the layer's result
against the registry's reference on the file's blocks (the path the GPU kernel is tested
against). The GPU stage of benchmarks/gpu_session.sh (moecheck) runs it with the Triton kernel.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from hetero.config import RuntimeConfig
from hetero.execution.offload_experts import SLOTS_PER_EXPERT, StreamedExperts, streams_experts
from hetero.kernels import cpu_qdot
from hetero.kernels.cpu_qdot_moe import pack_experts
from hetero.model.llama import load_model
from hetero.model.moe import Experts
from hetero.quant import get_quant
from quant.kquantize import quantize_q4_k, quantize_q6_k
from tests.support.moe_models import load_weights_from, tiny_gpt_oss, tiny_qwen3moe, write_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not cpu_qdot.available(), reason="the qdot kernel did not build")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("offload_experts")
    out = {}
    for arch, make in (("qwen3moe", tiny_qwen3moe), ("gpt-oss", tiny_gpt_oss)):
        model = make(seed=2)
        out[arch] = write_gguf(model, folder / f"{arch}.gguf", T.Q4_K)
        load_weights_from(model, out[arch])
    return out


@pytest.mark.parametrize(("qtype", "quantize"), [(T.Q4_K, quantize_q4_k), (T.Q6_K, quantize_q6_k)])
def test_packed_experts_come_back_as_their_gguf_blocks(qtype, quantize):
    """n = 40 rows an expert: the qdot layout pads each expert to 48; undone, the blocks are the
    file's, byte for byte."""
    e, n, k = 3, 40, 512
    w = np.random.default_rng(0).standard_normal((e * n, k)).astype(np.float32)
    raw = torch.from_numpy(quantize(w).copy()).reshape(e, n, -1)
    assert raw.shape[2] == k // 256 * get_quant(qtype).type_size
    p = pack_experts(raw, qtype, (e, n, k))
    assert p.packed.shape[1] * cpu_qdot.GROUP == 48
    assert torch.equal(StreamedExperts._blocks(p, p.packed.clone()), raw)


def _setup(path: str, min_tokens: int):
    """The model on the CPU with its experts on qdot, streamed from min_tokens on, and each
    layer's experts again on the registry's reference (the file's blocks, exact float32)."""
    gm, model = load_model(path, RuntimeConfig(device="cpu", weights="auto"))
    ffns = [b.ffn for b in model.blocks]
    assert all(f.experts.qdot is not None for f in ffns)
    streamed = StreamedExperts([f.experts for f in ffns], ffns[0].router.k, CPU, min_tokens)
    exact_rt = RuntimeConfig(device="cpu", weights="quant", allow_reference=True)
    exact = [Experts(gm, i, exact_rt, f.experts.activation) for i, f in enumerate(ffns)]
    return model, ffns, streamed, exact


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_streamed_experts_equal_the_reference_on_the_files_blocks(files, arch):
    """Layer by layer, in the forward's order and then backwards (every call out of the
    prefetch order): the streamed layer is the reference's; steps below min_tokens, or giving
    the experts fewer than SLOTS_PER_EXPERT rows each, stay on the layer's native call."""
    model, ffns, streamed, exact = _setup(files[arch], min_tokens=8)
    k, e = ffns[0].router.k, streamed.n_experts
    big = -(-SLOTS_PER_EXPERT * e // k)  # the fewest tokens streamed
    assert streams_experts(big, e, k, 8) and not streams_experts(big - 1, e, k, 8)
    assert not streams_experts(big, e, k, big + 1) and not streams_experts(big, e, k, 0)
    g = torch.Generator().manual_seed(3)
    order = list(range(len(ffns)))
    for layers in (order, order[::-1], order):
        for i in layers:
            h = torch.randn(big, model.config.d_model, generator=g)
            ids, w = ffns[i].router(h)
            before = streamed.calls
            got = ffns[i](h)  # the block's feed-forward: router, then the streamed experts
            assert streamed.calls == before + 1
            want = exact[i](h, ids, w)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    for t in (7, big - 1):  # a decode step; a prompt step too small for the experts' copy
        small = torch.randn(t, model.config.d_model, generator=g)
        before = streamed.calls
        native = ffns[0](small)
        assert streamed.calls == before  # the CPU's one native call
        want = exact[0](small, *ffns[0].router(small))
        assert float((native - want).norm() / want.norm()) < 4e-2  # q8 activations' rounding


def test_install_takes_only_experts_in_ram_beside_the_device(files):
    _, model = load_model(files["qwen3moe"], RuntimeConfig(device="cpu", weights="auto"))
    assert StreamedExperts.install([model], 0, "cpu") is None  # no min_tokens: off
    assert StreamedExperts.install([model], 32, None) is None
    s = StreamedExperts.install([model], 32, "cpu")
    assert s is not None and len(s.layers) == len(model.blocks)
    assert s.describe().startswith("prompt steps of >= 32 tokens run the experts of 2 layers")
    later = StreamedExperts.install([model], 40, "cpu")  # min_tokens past 8 rows an expert
    assert later.describe().startswith("prompt steps of >= 40 tokens")
