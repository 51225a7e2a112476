"""End to end under the interpreter: the engine with every Triton kernel selected (quantized
matmul on load-time prepared weights, fused KV write, paged attention, norms, rotary, SiLU-mul)
gives the reference path's greedy tokens on a tiny random llama (GQA, K-quant mix).

Without CUDA the kernels are forced through `registry.forcing` and run under Triton's
interpreter; a model of 2 layers and width 256 keeps a step to a few seconds.
"""

from __future__ import annotations

import pytest
import torch

from hetero.config import RuntimeConfig
from hetero.kernels import ops
from hetero.kernels.registry import forcing
from hetero.kernels.repack import PackedWeight
from hetero.llm import LLM
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic
from hetero.synth_shapes import ModelShape
from tests.support.triton_interp import CUDA, DEVICE, kernels_runnable, rerun_test  # noqa: F401 (autouse)

triton = pytest.importorskip("triton")
test_in_a_fresh_interpreter_process = rerun_test(__file__)

SHAPE = ModelShape(
    arch="llama", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=256,
    vocab_size=384, context_length=256, rope_theta=10000.0, norm_eps=1e-5, tied_embeddings=False,
)  # fmt: skip
TRITON = {op: "triton" for op in ops() if op not in ("embed", "attention")}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
PROMPTS = [[3 + (7 * i) % 300 for i in range(n)] for n in (11, 3)]  # 11 + 4 crosses a block of 8


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tri") / "tiny.gguf"
    return write_synthetic(path, SHAPE, "q4_k_m", progress=False)


@pytest.fixture(scope="module")
def tied_file(tmp_path_factory):
    """SmolLM2's layout: Q4_1 blocks, the output head tied to the token embedding."""
    shape = ModelShape(**{**SHAPE.__dict__, "tied_embeddings": True})
    return write_synthetic(tmp_path_factory.mktemp("tied") / "tied.gguf", shape, "q4_1", False)


def _generate(path, kv_dtype: str):
    loaded = load_model(
        path, RuntimeConfig(device=str(DEVICE), weights="quant", dtype="fp32", allow_reference=True)
    )
    llm = LLM(loaded=loaded, kv_dtype=kv_dtype, num_kv_blocks=16, block_size=8,
              max_model_len=64, enforce_eager=True, device=str(DEVICE))  # fmt: skip
    outs = llm.generate(PROMPTS, GREEDY)
    return loaded[1], [(o.outputs[0].token_ids, [p.logprob for p in o.outputs[0].logprobs])
                       for o in outs]  # fmt: skip


@pytest.mark.parametrize("kv_dtype", ["fp8"] + (["fp16"] if CUDA else []))
def test_engine_with_triton_kernels_equals_reference(model_file, kv_dtype: str) -> None:
    """fp8 KV under the interpreter (the kernels' fp16 path is checked in test_triton_paged)."""
    with forcing({op: "torch" for op in TRITON}):
        _, want = _generate(model_file, kv_dtype)
    with forcing(TRITON):
        model, got = _generate(model_file, kv_dtype)
    # the weights were prepared once at load: packed planes, not GGUF bytes
    assert isinstance(model.blocks[0].ffn.down.qweight, PackedWeight)
    for (tg, lg), (tw, lw) in zip(got, want):
        assert tg == tw
        assert torch.allclose(torch.tensor(lg), torch.tensor(lw), atol=2e-3)


def test_qwen3_qk_norm_with_triton_kernels_equals_reference(tmp_path) -> None:
    """Qwen3's per-head q/k norm: the fused norm-and-rotate launch gives the reference path's
    tokens and logprobs (the norms, then the rotation, op by op)."""
    shape = ModelShape(**{**SHAPE.__dict__, "arch": "qwen3", "qk_norm": True})
    path = write_synthetic(tmp_path / "qwen3.gguf", shape, "q8_0", progress=False)
    with forcing({op: "torch" for op in TRITON}):
        model, want = _generate(path, "fp8")
        assert model.blocks[0].attn._qk_norm_rope is None
    with forcing(TRITON):
        model, got = _generate(path, "fp8")
        assert model.blocks[0].attn._qk_norm_rope is not None
    for (tg, lg), (tw, lw) in zip(got, want):
        assert tg == tw
        assert torch.allclose(torch.tensor(lg), torch.tensor(lw), atol=2e-3)


def test_tied_head_with_triton_kernels_equals_reference(tied_file) -> None:
    """The tied head's prepared copy of the embedding table (packed planes, while the embedding
    keeps its GGUF rows) gives the reference's tokens and logprobs in float32."""
    with forcing({op: "torch" for op in TRITON}):
        _, want = _generate(tied_file, "fp8")
    with forcing(TRITON):
        model, got = _generate(tied_file, "fp8")
    assert isinstance(model.lm_head.qweight, PackedWeight)
    assert not isinstance(model.embed.qweight, PackedWeight)
    for (tg, lg), (tw, lw) in zip(got, want):
        assert tg == tw
        assert torch.allclose(torch.tensor(lg), torch.tensor(lw), atol=2e-3)


@pytest.mark.parametrize("splits", [1, 3])
def test_verify_step_through_decode_buffers_with_triton_attention(model_file, monkeypatch, splits):
    """A speculative verify step as decode rows (cuda_graph.py): the fused KV write stores all
    6 rows before the decode kernel (split-K too) lets row i attend over the prefix and rows
    0 .. i; its logits equal the reference's eager step (causal attention over the new tokens)."""
    from hetero.execution.cuda_graph import DecodeGraphs
    from hetero.kernels import triton_paged

    monkeypatch.setattr(triton_paged, "decode_splits", lambda *a: splits)
    loaded = load_model(
        model_file,
        RuntimeConfig(device=str(DEVICE), weights="quant", dtype="fp32", allow_reference=True),
    )
    logits = []
    for kernels in ({"kv_write": "torch", "paged_attention": "torch"}, TRITON):
        with forcing(kernels):
            llm = LLM(loaded=loaded, kv_dtype="fp16", num_kv_blocks=16, block_size=8,
                      max_model_len=64, enforce_eager=True, device=str(DEVICE),
                      speculative="off", overlap_schedule="off")  # fmt: skip
            eng = llm.engine
            long = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            eng.add_request("a", PROMPTS[0] * 2, long)  # 22 tokens: the guesses cross a block
            eng.step()
            out = eng.scheduler.schedule({"a": [5, 6, 7, 8, 9]})
            graphs = DecodeGraphs(loaded[1], eng.executor.pool, 8, 64)
            assert graphs.fits(out)
            if kernels is TRITON:
                step = graphs.run(out.scheduled)
            else:
                step = eng.executor.runner.run(out)[0]
            logits.append(step.float().cpu())
    assert logits[1].shape == (6, SHAPE.vocab_size)
    assert torch.allclose(logits[1], logits[0], atol=1e-4)


ATTENTION = ("kv_write", "paged_attention", "paged_attention_sinks")


def test_window_group_with_triton_attention_equals_reference(tmp_path) -> None:
    """gpt-oss's window layer over its own block table, its blocks released as the window of 8
    moves on (blocks of 4): the Triton prefill kernel's first key tile reaches the null block
    there (zeros, masked), the decode kernel starts at the window. Eager steps and the decode
    buffers' steps (prompt rows in tiles) give the reference kernels' tokens and logprobs."""
    from hetero.execution.cuda_graph import DecodeGraphs

    path = write_synthetic(tmp_path / "gpt-oss.gguf", "tiny-gpt-oss", "q8_0", progress=False)
    loaded = load_model(path, RuntimeConfig(device=str(DEVICE), weights="dense", dtype="fp32"))
    prompts = [[3 + (5 * i) % 900 for i in range(n)] for n in (21, 6)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1)
    runs = []
    for kernels, graphs in (("torch", False), ("triton", False), ("triton", True)):
        with forcing({op: kernels for op in ATTENTION}):
            llm = LLM(loaded=loaded, kv_dtype="fp32", num_kv_blocks=32, block_size=4,
                      max_model_len=64, enforce_eager=True, device=str(DEVICE),
                      speculative="off", max_num_batched_tokens=8, max_num_seqs=2)  # fmt: skip
            ex = llm.engine.executor
            assert ex.info.kv_windows == (0, 8)
            if graphs:
                ex.set_graphs(DecodeGraphs(loaded[1], ex.pool, 4, 64, max_rows=8, row_tile=4))
            outs = llm.generate(prompts, params)
            assert llm.engine.block_manager.num_cached_blocks > 0  # window blocks released
            if graphs:
                assert ex.runner.graphs.tiled_rows > 0
        runs.append([(o.outputs[0].token_ids, [p.logprob for p in o.outputs[0].logprobs])
                     for o in outs])  # fmt: skip
    for got in runs[1:]:
        for (tg, lg), (tw, lw) in zip(got, runs[0]):
            assert tg == tw
            assert torch.allclose(torch.tensor(lg), torch.tensor(lw), atol=1e-4)


def test_norms_quantized_for_the_stream_k_linears(model_file) -> None:
    """One token a step on the Stream-K decode kernel (16-bit activations: integer dot
    products): the norms before q|k|v and gate|up hand those linears their input already
    quantized, made in the norm's own launch. Tokens and logprobs equal those of the same model
    with that hook taken away (the norm, then the GEMV's own quantization): the same bits."""
    from hetero.kernels.xquant import QuantizedRows
    from hetero.model.layers import PartInputs, QuantLinear

    dtype = "fp16" if not CUDA else "bf16"
    rt = RuntimeConfig(device=str(DEVICE), weights="quant", dtype=dtype, allow_reference=True)
    prompts = [PROMPTS[0]]  # one sequence: every decode step is one token
    outs = []
    with forcing({**TRITON, "qlinear": "triton_streamk"}):
        for fused in (True, False):
            loaded = load_model(model_file, rt)
            model = loaded[1]
            lins = [m for m in model.modules() if isinstance(m, QuantLinear)]
            if not fused:
                for lin in lins:
                    lin._quantize_norm = None
            block = model.blocks[0]
            x = torch.randn(1, SHAPE.d_model, device=DEVICE).to(rt.torch_dtype())
            got = block.ffn_norm.add(x, x.clone(), into=block.ffn.gate_up)
            assert isinstance(got[1], QuantizedRows) == fused
            # the last layer's q|k (Q4_K) beside its v (Q6_K): an input in each part's layout
            last = model.blocks[-1]
            assert last.attn.wqkv.parts is not None
            got = last.attn_norm.add(x, x.clone(), into=last.attn.wqkv)
            assert isinstance(got[1], PartInputs) == fused
            assert not fused or [r.layout.group for r in got[1]] == [32, 16]
            llm = LLM(loaded=loaded, kv_dtype="fp8", num_kv_blocks=16, block_size=8,
                      max_model_len=64, enforce_eager=True, device=str(DEVICE))  # fmt: skip
            o = llm.generate(prompts, GREEDY)[0].outputs[0]
            outs.append((o.token_ids, [p.logprob for p in o.logprobs]))
    assert outs[0] == outs[1]


def test_attention_output_quantized_for_the_stream_k_linear(model_file, monkeypatch) -> None:
    """One token a step: the decode attention's launch hands the output projection its input
    already quantized (QuantizedRows: the rotation, the KV write and the attention fused).
    Tokens and logprobs equal those with that hook taken away (the attention's output, then
    the GEMV's own quantization): the same bits."""
    from hetero.execution.runner import PagedAttention
    from hetero.kernels.xquant import QuantizedRows
    from hetero.model.layers import QuantLinear

    dtype = "fp16" if not CUDA else "bf16"
    rt = RuntimeConfig(device=str(DEVICE), weights="quant", dtype=dtype, allow_reference=True)
    kinds = []
    attend = PagedAttention.rope_attend

    def spy(self, *args, **kwargs):
        out = attend(self, *args, **kwargs)
        kinds.append(type(out).__name__)
        return out

    monkeypatch.setattr(PagedAttention, "rope_attend", spy)
    outs = []
    with forcing({**TRITON, "qlinear": "triton_streamk"}):
        for fused in (True, False):
            kinds.clear()
            loaded = load_model(model_file, rt)
            if not fused:
                for lin in loaded[1].modules():
                    if isinstance(lin, QuantLinear):
                        lin._input_layout = None
            llm = LLM(loaded=loaded, kv_dtype="fp8", num_kv_blocks=16, block_size=8,
                      max_model_len=64, enforce_eager=True, device=str(DEVICE))  # fmt: skip
            o = llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0]
            outs.append((o.token_ids, [p.logprob for p in o.logprobs]))
            # the prompt's step attends plainly; each decode step's layers hand QuantizedRows
            decode = SHAPE.n_layers * (GREEDY.max_tokens - 1)
            want = QuantizedRows.__name__ if fused else "Tensor"
            assert kinds[-decode:] == [want] * decode and "Tensor" in kinds[:-decode]
    assert outs[0] == outs[1]
