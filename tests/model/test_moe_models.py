"""The mixture-of-experts families (qwen3moe, gpt-oss) against HF transformers in fp32.

Tiny random `Qwen3MoeForCausalLM` and `GptOssForCausalLM` (tests/support/moe_models.py), GGUF
the way llama.cpp's converter writes them, then run through the engine: paged fp32 KV, several
requests batched continuously, prompts prefilled in chunks, later prompts hitting the earlier
ones' cached prefix, greedy decoding. Every logits row the engine produced (a prompt's last
position, each decode step, each verified guess) is compared with transformers' logits at that
position of the same tokens: within 1e-3. gpt-oss's window (6 tokens here) is far shorter than
the prompts, so window layers, full layers and the sinks all shape the logits.

The files: F32 (the engine with dense and with GGUF-block experts), Q4_K matrices, and gpt-oss as
released (MXFP4 experts, Q8_0 attention); the HF model then takes the file's dequantized
weights, so both sides compute with the same numbers, and the experts run through the
registry's moe_matmul on their blocks.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from hetero.config import RuntimeConfig
from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.gguf_loader import GGUFError, load_gguf
from hetero.launch import LaunchConfig, build_engine
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams
from tests.support.moe_models import (
    VOCAB,
    load_weights_from,
    shape_of,
    tiny_gpt_oss,
    tiny_qwen3moe,
    write_gguf,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

TOL = 1e-3
MAKERS = {"qwen3moe": tiny_qwen3moe, "gpt-oss": tiny_gpt_oss}


def runtime(weights: str) -> RuntimeConfig:
    """On the CPU; "quant" there is the torch reference (the path the kernels are tested
    against), which the engine runs only when allowed."""
    return RuntimeConfig(device="cpu", weights=weights, allow_reference=True)


CASES = [
    ("qwen3moe", T.F32, "dense"),
    ("qwen3moe", T.F32, "quant"),
    ("qwen3moe", T.Q4_K, "quant"),
    ("gpt-oss", T.F32, "dense"),
    ("gpt-oss", T.Q4_K, "quant"),
    ("gpt-oss", T.MXFP4, "quant"),  # as released: MXFP4 experts, Q8_0 attention
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(arch, GGUF type) -> (HF model holding the file's weights, path)."""
    folder = tmp_path_factory.mktemp("moe")
    out = {}
    for arch, qtype in sorted({(a, q) for a, q, _ in CASES}):
        model = MAKERS[arch](seed=1)
        path = write_gguf(model, folder / f"{arch}-{qtype.name}.gguf", qtype)
        if qtype != T.F32:
            load_weights_from(model, path)
        out[arch, qtype] = (model, path)
    return out


def prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    """Prompts of 9..40 tokens, every other one starting with a shared 24-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(24)]
    out = []
    for i in range(n):
        body = [rng.randrange(VOCAB) for _ in range(rng.randint(9, 16))]
        out.append(shared + body if i % 2 else body)
    return out


class RowRecorder:
    """Wraps the executor's runner: each logits row it returns, with the tokens it continues."""

    def __init__(self, runner):
        self.rows: list[tuple[list[int], torch.Tensor]] = []
        self._run = runner.run
        runner.run = self

    def __call__(self, out, hidden=None):
        logits, producing = self._run(out, hidden)
        i = 0
        src = out.token_source  # an overlapped step's placeholders -1 - j read src[j]
        for s in producing:
            known = s.req.tokens(0, s.start_pos + s.num_new_tokens - len(s.spec_ids))
            known = [int(src[-1 - t]) if t < 0 else t for t in known]
            for j in range(1 + len(s.spec_ids)):
                self.rows.append((list(known) + list(s.spec_ids[:j]), logits[i].clone()))
                i += 1
        return logits, producing


def engine_rows(path, weights: str, rounds: int = 1, loaded=None, **options):
    """Run the prompts to 6 greedy tokens each, `rounds` times (after each round, with a RAM
    tier, every parked block is pushed down to RAM); (final sequences, rows, engine).
    loaded: the (GGUF, model) to run, where not load_model(path, runtime(weights))."""
    sched = SchedulerConfig(max_num_batched_tokens=options.pop("budget", 20), max_num_seqs=3)
    cfg = EngineConfig(block_size=4, kv_dtype="fp32", scheduler=sched, **options)
    loaded = loaded or load_model(path, runtime(weights))
    engine = build_engine(None, LaunchConfig(cfg), loaded=loaded)
    rec = RowRecorder(engine.executor.runner)
    finals = {}
    for r in range(rounds):
        for i, p in enumerate(prompts()):
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            engine.add_request(f"{r}.{i}", p, params)
            finals[f"{r}.{i}"] = list(p)
        while engine.has_unfinished():
            for o in engine.step():
                finals[o.request_id] += o.new_token_ids
        engine.block_manager.check()
        if engine.kv_tiers is not None:
            engine.kv_tiers.offload_all(engine.block_manager)
    return list(finals.values()), rec, engine


def max_row_error(hf, finals: list[list[int]], rec: RowRecorder) -> tuple[float, int]:
    """Largest |logit difference| over the rows whose tokens are a final sequence's prefix
    (a rejected guess's row is not), and how many rows were compared."""
    ref = {}
    for seq in finals:
        with torch.no_grad():
            ref[tuple(seq)] = hf(torch.tensor([seq])).logits[0]
    worst, n = 0.0, 0
    for prefix, row in rec.rows:
        seq = next((s for s in finals if s[: len(prefix)] == prefix), None)
        if seq is None:
            continue
        worst = max(worst, (row - ref[tuple(seq)][len(prefix) - 1]).abs().max().item())
        n += 1
    return worst, n


@pytest.mark.parametrize(("arch", "qtype", "weights"), CASES)
def test_engine_logits_match_transformers(files, arch, qtype, weights):
    hf, path = files[arch, qtype]
    finals, rec, _ = engine_rows(path, weights, speculative="off")
    worst, n = max_row_error(hf, finals, rec)
    assert n == 4 * 6  # every produced token's row: 4 prompts, 6 tokens each
    assert worst < TOL, f"{arch} {qtype.name} {weights}: max |logit error| {worst:.2e}"


@pytest.mark.parametrize("arch", MAKERS)
def test_speculation_and_ram_tier(files, arch):
    """The prompts twice. The second time their prefixes come back from the RAM tier (every
    parked block was pushed there) and the n-gram cache has seen their continuations, so
    guesses are verified in one pass: the same greedy tokens, transformers' logits."""
    hf, path = files[arch, T.F32]
    plain, _, _ = engine_rows(path, "dense", rounds=2, speculative="off")
    finals, rec, engine = engine_rows(
        path, "dense", rounds=2, speculative="ngram", kv_ram_gb=0.01, budget=64
    )
    assert finals == plain
    assert engine.kv_tiers.tiers.stats.hits["ram"] > 0
    assert engine.spec.accepted > 0, "no guess was verified"
    worst, n = max_row_error(hf, finals, rec)
    assert n == 2 * 4 * 6  # accepted guesses' rows stand for the tokens they produced
    assert worst < TOL, f"{arch}: max |logit error| {worst:.2e}"


def test_window_and_sinks_shape_the_logits(files):
    """The gpt-oss comparison is sensitive to both features: without the window, or without
    the sinks, the logits move by far more than the tolerance."""
    from hetero.model.contiguous_kv import ContiguousKV
    from hetero.model.forward_batch import ForwardBatch

    hf, path = files["gpt-oss", T.F32]
    ids = prompts()[1]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    _, model = load_model(path, runtime("dense"))

    def error() -> float:
        kv = ContiguousKV(model.config, len(ids), torch.float32)
        kv.begin(len(ids))
        rows = torch.arange(len(ids))
        return (model(torch.tensor(ids), ForwardBatch(rows, rows, kv)) - ref).abs().max().item()

    assert error() < TOL
    attns = [b.attn for b in model.blocks]
    windows, sinks = [a.window for a in attns], [a.sinks for a in attns]
    assert windows == [6, 0, 6]
    for a in attns:
        a.window = 0
    assert error() > 100 * TOL
    for a, w, s in zip(attns, windows, sinks):
        a.window, a.sinks = w, torch.full_like(s, -1e30)
    assert error() > 100 * TOL


def test_metadata_as_the_converter_writes_it(files):
    q = load_gguf(files["qwen3moe", T.F32][1]).config
    assert (q.arch, q.n_experts, q.n_experts_used, q.d_ff_expert) == ("qwen3moe", 8, 2, 512)
    assert q.expert_weights_norm and q.qk_norm and q.sliding_window == 0
    g = load_gguf(files["gpt-oss", T.F32][1]).config
    assert (g.arch, g.n_experts, g.n_experts_used, g.d_ff_expert) == ("gpt-oss", 8, 2, 512)
    assert g.sliding_window == 6 and g.swa_layers == (True, False, True)
    assert g.rope_scaling.kind == "yarn" and g.rope_scaling.factor == 32.0
    assert not g.rope_scaling.truncate and g.attn_bias and not g.expert_weights_norm


def test_expert_count_that_does_not_match_the_tensors_is_refused(tmp_path):
    model = tiny_qwen3moe(seed=2, num_hidden_layers=1)
    bad = dataclasses.replace(shape_of(model), n_experts=16)
    path = write_gguf(model, tmp_path / "bad.gguf", shape=bad)
    with pytest.raises(GGUFError, match=r"expert_count = 16") as e:
        load_gguf(path)
    assert "ffn_gate_inp" in str(e.value) and "[8, 256]" in str(e.value)


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    w = GGUFWriter(tmp_path / "m.gguf", "deepseek2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError) as e:
        load_gguf(tmp_path / "m.gguf")
    msg = str(e.value)
    assert "'deepseek2' is not supported" in msg
    assert all(a in msg for a in ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss"))


def test_cpu_moe_options_are_checked_against_the_model(files, tmp_path):
    from click.testing import CliRunner

    from hetero.cli import main
    from hetero.model.moe import experts_runtime
    from hetero.synth import write_synthetic

    path = files["qwen3moe", T.F32][1]
    with pytest.raises(ValueError, match="--n-cpu-moe 3: the model has only 2 layers"):
        load_model(path, RuntimeConfig(device="cpu", n_cpu_moe=3))
    with pytest.raises(ValueError, match="not both"):
        RuntimeConfig(cpu_moe=True, n_cpu_moe=1)
    dense = write_synthetic(tmp_path / "dense.gguf", "tiny-qwen3", "q8_0", progress=False)
    with pytest.raises(ValueError, match="has no experts"):
        load_model(dense, RuntimeConfig(device="cpu", cpu_moe=True))
    out = CliRunner().invoke(main, ["generate", str(path), "-p", "hi", "--n-cpu-moe", "5"])
    assert out.exit_code != 0 and "only 2 layers" in out.output
    cfg = load_gguf(path).config
    on_gpu = RuntimeConfig(device="cuda", n_cpu_moe=1)
    assert experts_runtime(cfg, on_gpu, 0) == RuntimeConfig(
        device="cpu", dtype="fp32", weights="auto"
    )  # the CPU's default: qdot, the experts' GGUF blocks on the native kernels
    named = RuntimeConfig(device="cuda", n_cpu_moe=1, weights="cuda=quant,cpu=fp16")
    assert experts_runtime(cfg, named, 0).weights == "fp16"
    assert experts_runtime(cfg, on_gpu, 1) is None  # past the first n_cpu_moe layers
    on_cpu = RuntimeConfig(device="cpu", cpu_moe=True)
    assert experts_runtime(cfg, on_cpu, 1) is None  # on a CPU already


@pytest.mark.parametrize("arch", MAKERS)
def test_cuda_graph_static_buffers_equal_eager(files, arch):
    """The decode graphs' static-buffer path (run eagerly here: padding rows of length 0, the
    reference attention reading slots from the block tables, the window from each row's
    length) gives the eager engine's tokens and logprobs (the check of
    tests/execution/test_cuda_graph.py)."""
    from hetero.kernels.registry import forcing
    from tests.execution.test_cuda_graph import _generate, _same

    loaded = load_model(files[arch, T.F32][1], runtime("dense"))
    with forcing({"kv_write": "torch", "paged_attention": "torch"}):
        eager, _, _ = _generate(loaded, False, False, "fp32")
        static, graphs, _ = _generate(loaded, True, False, "fp32")
    assert graphs.steps > 0
    _same(eager, static, "fp32")


def test_pipeline_stages_run_the_family(files):
    """gpt-oss as two stage processes (the first holding a window layer, the second a full and
    a window layer): each stage builds the file's family, and every greedy token is
    transformers' top token (or within TOL of it, a near-tie)."""
    from hetero.llm import LLM

    hf, path = files["gpt-oss", T.F32]
    llm = LLM(
        str(path), split="cpu=0-0,cpu=1-2", kv_dtype="fp32", weights="dense", block_size=4,
        num_kv_blocks=64, stage_timeout=120.0,
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = llm.generate(prompts(), params)
    finally:
        llm.engine.close()
    for prompt, out in zip(prompts(), outs, strict=True):
        got = out.outputs[0].token_ids
        assert len(got) == 6
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(got)[:, None]).squeeze(1)
        assert (logits.max(1).values - chosen).max().item() < TOL
