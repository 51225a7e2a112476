"""Which packing each GGUF type gets in the CPU's "qdot" mode, and that the planner prices the
same: every block type the kernel reads runs qdot on its own bytes (weight error 0), float types
fp16, a fused q|k|v of mixed types one part per type; models of the codebook types (IQ4_NL,
IQ4_XS, MXFP4) run every matrix on the kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from hetero.config import RuntimeConfig
from hetero.kernels import cpu_qdot
from hetero.kernels.cpu_linear import pack_error
from hetero.kernels.cpu_qdot_ref import quantize_x_reference
from hetero.model.contiguous_kv import ContiguousKV
from hetero.model.forward_batch import ForwardBatch
from hetero.model.llama import load_model
from hetero.planner.cost import DeviceCost
from hetero.planner.device import DeviceProfile, MatmulRate
from hetero.planner.model_desc import describe, packed_mode, rate_key, weight_bytes
from hetero.quant import get_quant, random_blocks
from hetero.synth import write_synthetic
from hetero.synth_shapes import ModelShape

needs_qdot = pytest.mark.skipif(not cpu_qdot.available(), reason="the qdot kernel did not build")
SHAPE = ModelShape(
    arch="llama", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=256,
    vocab_size=384, context_length=256, rope_theta=10000.0, norm_eps=1e-5, tied_embeddings=False,
)  # fmt: skip
BLOCK_TYPES = ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
BLOCK_TYPES += ("IQ4_NL", "IQ4_XS", "MXFP4")


@needs_qdot
@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_every_block_type_runs_on_its_own_bytes(name: str) -> None:
    shape = (128, 1024)
    n_blocks = shape[0] * shape[1] // get_quant(name).block_size
    raw = torch.from_numpy(random_blocks(name, n_blocks, np.random.default_rng(1)))
    assert pack_error(raw.reshape(shape[0], -1), int(T[name]), shape, "qdot") == 0.0
    assert cpu_qdot.cpu_scheme(T[name]) == cpu_qdot.cpu_scheme(name) == "qdot"
    assert cpu_qdot.cpu_scheme("F16") == cpu_qdot.cpu_scheme("BF16") == "fp16"


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("qdot") / "m.gguf", SHAPE, "q4_k_m", False)


def _logits(model) -> torch.Tensor:
    tokens = [5, 17, 99, 3, 250, 42, 7]
    kv = ContiguousKV(model.config, len(tokens), torch.float32, "cpu")
    kv.begin(len(tokens))
    pos = torch.arange(len(tokens))
    return model(torch.tensor(tokens), ForwardBatch(pos, pos, kv))


@needs_qdot
def test_qdot_mode_packs_each_type_run_as_its_rule_says(q4km) -> None:
    _, model = load_model(q4km, RuntimeConfig(device="cpu", weights="qdot"))
    first, last = model.blocks[0].attn.wqkv, model.blocks[1].attn.wqkv
    assert [p.scheme for p in first.packed_parts] == ["qdot"]  # q, k, v all Q4_K
    parts = [(p.scheme, p.weight.ggml_type.name, p.out_features) for p in last.packed_parts]
    assert parts == [("qdot", "Q4_K", 384), ("qdot", "Q6_K", 128)]  # q|k Q4_K, v Q6_K
    assert model.lm_head.packed.weight.ggml_type.name == "Q6_K"  # Q6_K output
    _, ref = load_model(q4km, RuntimeConfig(device="cpu", weights="dense", dtype="fp32"))
    got, want = _logits(model), _logits(ref)
    assert got.shape == want.shape == (7, SHAPE.vocab_size)
    # the exact weights, activations rounded to int8 per 256: a small relative error
    assert (got - want).norm() / want.norm() < 2e-2


class RoundedActivations:
    """A linear's product in torch as the qdot kernel defines it: x rounded to int8 per block
    (the native quantizer's twin), times the exact weights, in float64. Set as a layer's
    `offload` hook, which the layer calls in place of its own kernel."""

    def runs(self, x: torch.Tensor) -> bool:
        return True

    def __call__(self, layer, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for p in layer.packed_parts:
            qb = cpu_qdot.activation_block(p.weight.ggml_type)
            xq, xd, _ = quantize_x_reference(x, qb)
            xr = (xq.double().reshape(len(x), -1, qb) * xd.double()[..., None]).reshape(x.shape)
            outs.append(xr @ cpu_qdot.unpack(p.weight).double().t())
        return torch.cat(outs, dim=-1).float()


@needs_qdot
@pytest.mark.parametrize("name", ("IQ4_NL", "IQ4_XS", "MXFP4"))
def test_a_codebook_model_runs_every_matrix_on_the_kernel(tmp_path, name: str) -> None:
    """`hetero synth`'s pure-TYPE mix (every matrix, embedding and head included, of the type):
    qdot mode packs each linear as qdot blocks of that type; each linear's output is that of
    the exact weights times its input rounded per block (to float rounding), and the logits
    are near the unrounded fp32 model's.

    Each linear is checked on the input the model gave it: compared whole, two models' 1e-7
    differences can flip one activation code's rounding in a later layer (seen on one CPU: the
    logits then 1.3e-3 apart), which says nothing about the kernel."""
    path = write_synthetic(tmp_path / "m.gguf", SHAPE, f"pure-{name.lower()}", False)
    _, model = load_model(path, RuntimeConfig(device="cpu", weights="qdot"))
    linears = [m for m in model.modules() if hasattr(m, "packed_parts")]
    parts = [p for m in linears for p in m.packed_parts]
    assert len(parts) == 2 * 4 + 1  # per block q|k|v, o, gate|up, down; the output head
    assert {(p.scheme, p.weight.ggml_type.name) for p in parts} == {("qdot", name)}
    errors = []

    def check(layer, inputs, out):
        want = RoundedActivations()(layer, inputs[0])
        errors.append(float((out.float() - want).norm() / want.norm()))

    hooks = [m.register_forward_hook(check) for m in linears]
    got = _logits(model)
    for h in hooks:
        h.remove()
    assert len(errors) == len(linears)
    assert max(errors) < 1e-5  # measured 7e-8: the same sums in another order
    _, dense = load_model(path, RuntimeConfig(device="cpu", weights="dense", dtype="fp32"))
    exact = _logits(dense)
    assert torch.isfinite(exact).all() and exact.std() > 0
    # measured 5.7e-3 (IQ4_NL), 1.6e-2 (IQ4_XS: x per 256, as q4_k_m's 1.3e-2), 1.1e-2 (MXFP4)
    assert (got - exact).norm() / exact.norm() < 2e-2


def test_the_planner_prices_qdot_mode_as_the_loader_packs():
    desc = describe("synth:llama3-8b:q4_k_m")
    head = desc.output
    assert head.ggml_type == "Q6_K"
    assert weight_bytes(head, "qdot", on_cpu=True) == 210 / 256 * head.params  # its Q6_K blocks
    q = next(t for t in desc.layers[0] if t.name.endswith("attn_q.weight"))
    assert weight_bytes(q, "qdot", on_cpu=True) == 144 / 256 * q.params  # its Q4_K blocks
    qdot, q6k = MatmulRate("qdot", 50.0, 1.0), MatmulRate("qdot", 100.0, 1.0)
    cpu = DeviceProfile(
        id="cpu", kind="cpu", name="test", memory_total=64 << 30, memory_free=64 << 30,
        mem_bw_gbs=100.0, bf16_tflops=1.0, matmul={"qdot": qdot, "qdot:Q6_K": q6k}, attn_gbs=10.0,
    )  # fmt: skip
    cost = DeviceCost(desc, cpu, "qdot", "fp16")
    # a type the profile timed at its own rate, another at the "qdot" (Q4_1) one
    assert cost.linear_seconds(head, 1) == pytest.approx(210 / 256 * head.params / 100e9)
    assert cost.linear_seconds(q, 1) == pytest.approx(144 / 256 * q.params / 50e9)


def test_the_planner_prices_codebook_tensors_as_qdot_reads_them():
    """An IQ4_XS file's matrices: qdot mode reads their own blocks (136 bytes a 256), timed at
    the profile's IQ4_XS rate where it has one; the grid IQ types are priced as fp16."""
    desc = describe("synth:llama3-8b:iq4_xs")
    q = next(t for t in desc.layers[0] if t.name.endswith("attn_q.weight"))
    assert q.ggml_type == "IQ4_XS"
    assert weight_bytes(q, "qdot", on_cpu=True) == 136 / 256 * q.params
    assert rate_key("qdot", "IQ4_XS") == ("qdot", "IQ4_XS")
    assert packed_mode("qdot", "MXFP4") == "qdot" and packed_mode("qdot", "IQ2_XS") == "fp16"


def test_cpu_bandwidth_is_streamed_past_the_last_level_cache():
    from hetero.profiler.measure import cpu_cache_bytes, cpu_stream_bytes

    cache = cpu_cache_bytes()
    if Path("/sys/devices/system/cpu/cpu0/cache/index0/size").exists():
        assert cache >= 1 << 20  # read from sysfs: every current CPU's last level holds a MB
    assert cpu_stream_bytes(96 << 20) == max(96 << 20, 4 * cache)
