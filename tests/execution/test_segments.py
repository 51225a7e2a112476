"""The local executor over segments: layer ranges on devices of one process, in order.

On a GPU machine the segments are the GPU's layers and the CPU's; here both are on the CPU,
which runs the same code: hidden states passed from one segment to the next, one block table over
every segment's pool, and (the prompt path of a model bigger than its card) the CPU segment's
matmuls run on "another device" from its streamed, re-derived GGUF blocks.
"""

from __future__ import annotations

import pytest
import torch

from hetero.config import RuntimeConfig
from hetero.engine.config import EngineConfig
from hetero.engine.engine import Engine
from hetero.execution.local import LocalExecutor
from hetero.gguf_loader import load_gguf
from hetero.model.llama import LlamaModel
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic
from hetero.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
PROMPTS = [[1] + list(range(40 + 7 * i, 40 + 7 * i + 11 + 9 * i)) for i in range(3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("seg") / "t.gguf", "tiny-llama", "q4_k_m", False)
    return load_gguf(path)


def engine(gm, cuts: list[int], weights: str, **executor) -> Engine:
    """The model cut at `cuts` (layer indices) into segments on the CPU."""
    rt = RuntimeConfig(device="cpu", weights=weights)
    bounds = [0, *cuts, gm.config.n_layers]
    models = [LlamaModel(gm, rt, range(a, b)) for a, b in zip(bounds, bounds[1:])]
    cfg = EngineConfig(kv_dtype="fp32", num_kv_blocks=64, block_size=8, speculative="off")
    ex = LocalExecutor(models, cfg, 128, str(gm.path), gguf=gm, **executor)
    return Engine(cfg, ex, gm.config, Tokenizer.from_gguf(gm.reader))


def run(eng: Engine) -> list[tuple[list[int], list[float]]]:
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY)
    got: dict[str, tuple[list[int], list[float]]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            ids, lps = got.setdefault(o.request_id, ([], []))
            ids += o.new_token_ids
            lps += [lp.logprob for lp in o.logprobs or []]
    return [got[f"r{i}"] for i in range(len(PROMPTS))]


def test_segments_serve_what_one_segment_serves(tiny):
    one = engine(tiny, [], "fp16")
    two = engine(tiny, [2], "fp16")
    three = engine(tiny, [1, 3], "fp16")
    assert len(three.executor.segments) == 3
    want = run(one)
    assert run(two) == want and run(three) == want  # the same ops, only passed along
    assert two.block_manager.num_free_blocks == two.block_manager.num_blocks
    assert "cpu layers 0-1" in two.describe_kv() and "cpu layers 2-3" in two.describe_kv()
    with pytest.raises(ValueError, match="whole model"):
        two.embed([[1, 2, 3]])


def prefill_logits(eng: Engine, prompt: list[int]) -> torch.Tensor:
    """The last prompt position's logits (one prefill step, sampled greedily: its logprobs)."""
    eng.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    outs = []  # (an overlapped step's token comes a call later)
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == "p" and o.new_token_ids]
    (out,) = outs
    return torch.tensor([lp for _, lp in out.logprobs[0].top])


def test_a_streamed_matmul_is_the_exact_product(tiny):
    """Each CPU linear's packed bytes, staged on the target, turned back into GGUF blocks and
    prepared for its qlinear (here the exact torch reference) give x @ W^T of the exact
    weights, for every linear of a Q4_K_M model (fused runs of two types included)."""
    from hetero.execution.offload import StreamedMatmuls
    from hetero.model.layers import QuantLinear

    rt = RuntimeConfig(device="cpu", weights="qdot")
    dense = LlamaModel(tiny, RuntimeConfig(device="cpu", weights="dense"))
    model = LlamaModel(tiny, rt)
    qdot = [m for b in model.blocks for m in b.modules() if isinstance(m, QuantLinear)]
    exact = [m for b in dense.blocks for m in b.modules() if isinstance(m, QuantLinear)]
    streamer = StreamedMatmuls(qdot, torch.device("cpu"), min_tokens=1)
    assert len(streamer.order) > len(qdot)  # q|k Q4_K beside v Q6_K: two parts
    x = torch.randn(9, qdot[0].in_features)
    for lin, ref in zip(qdot, exact):
        xi = x if lin.in_features == x.shape[1] else torch.randn(9, lin.in_features)
        want = xi @ ref.weight.t()
        assert torch.allclose(streamer(lin, xi), want, rtol=1e-5, atol=1e-5)


def test_prompt_steps_stream_the_cpu_matmuls_and_decode_steps_do_not(tiny):
    prompt = list(range(5, 45))
    exact = prefill_logits(engine(tiny, [2], "dense"), prompt)
    qdot = prefill_logits(engine(tiny, [2], "qdot"), prompt)
    streamed = engine(tiny, [2], "qdot", offload_min_tokens=16, offload_device="cpu")
    off = streamed.executor.offload
    assert off is not None and "streaming" in streamed.describe_kv()
    got = prefill_logits(streamed, prompt)
    assert off.calls == 4 * 4  # both segments on the CPU here: 4 linears a layer, 4 layers
    assert off.feed_forwards == 4  # gate|up, SiLU and down in one visit a layer
    # exact layers: only the head (not streamed: one row a request) rounds its input to int8
    assert (got - exact).abs().max() < (qdot - exact).abs().max()
    streamed.add_request("d", prompt[:3], SamplingParams(temperature=0, max_tokens=4))
    while streamed.has_unfinished():
        streamed.step()
    assert off.calls == 4 * 4  # a 3-token prompt and its decode steps stay on the CPU kernels


@pytest.mark.gpu
def test_a_gpu_and_the_cpu_serve_what_one_device_serves(tiny):
    """-ngl on a real GPU: its first layers there (float32, exact weights, so the comparison is
    tight), the rest on the CPU; and prompt steps streaming the CPU's matmuls to the GPU (bf16
    activations there: within bf16's rounding of the CPU-only answer)."""
    from hetero.factory import LaunchConfig
    from hetero.launch import build_engine

    cfg = EngineConfig(kv_dtype="fp32", num_kv_blocks=64, block_size=8, speculative="off")

    def make(**rt) -> Engine:
        return build_engine(str(tiny.path), LaunchConfig(cfg, RuntimeConfig(**rt)))

    cpu = make(device="cpu", dtype="fp32", weights="dense")
    split = make(device="cuda", dtype="fp32", weights="dense", n_gpu_layers=2, offload_min_tokens=0)
    assert [s.device.type for s in split.executor.segments] == ["cuda", "cpu"]
    want, got = run(cpu), run(split)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(want, got):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3)
    prompt = list(range(5, 45))
    streamed = make(device="cuda", weights="cuda=quant,cpu=qdot", n_gpu_layers=2,
                    offload_min_tokens=16)  # fmt: skip
    exact = prefill_logits(cpu, prompt)
    got = prefill_logits(streamed, prompt)
    assert streamed.executor.offload.calls == 2 * 4  # the CPU's two layers, four matmuls each
    assert torch.allclose(got, exact, atol=0.15)  # bf16 activations on the GPU
