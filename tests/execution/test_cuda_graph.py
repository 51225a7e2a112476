"""Decode CUDA graphs (hetero.execution.cuda_graph): bucketing, padding, and eager agreement.

Without CUDA the static-buffer path runs eagerly (no capture): the same buffers, padding rows
(slot -1, length 0) and bucket choice a captured graph replays, against the engine's ordinary
per-step path, on a tiny random llama. The `gpu` test captures and replays for real.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hetero.config import RuntimeConfig
from hetero.execution.cuda_graph import (
    MAX_SPEC_ROWS,
    DecodeGraphs,
    batch_buckets,
    bucket_for,
    graph_rows,
)
from hetero.kernels.registry import forcing
from hetero.llm import LLM
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic
from tests.support import exact_weights

CUDA = torch.cuda.is_available()


def test_buckets_cover_every_batch_size() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    for top in (1, 5, 48, 256):
        buckets = batch_buckets(top)
        for n in range(1, top + 1):
            b = bucket_for(n, buckets)
            assert b is not None and b >= n
            assert all(x < n for x in buckets if x < b)  # the smallest that holds n
        assert bucket_for(top + 1, buckets) is None
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)


def test_graph_rows_leave_room_for_guesses() -> None:
    assert graph_rows(256, 2048) == graph_rows(256, 2048, 8) == 256  # already room
    assert graph_rows(4, 2048) == 4
    assert graph_rows(4, 2048, 8) == 36  # 4 requests x (1 + 8) rows
    assert graph_rows(16, 2048, 8) == MAX_SPEC_ROWS
    assert graph_rows(4, 20, 8) == 20  # never more rows than the step's token budget


def poison(pool) -> None:
    """NaN in every slot of a fresh pool: what an unwritten slot may hold (the pool is allocated
    empty, and reused memory can hold any bytes). A padded decode view reads slots past each
    sequence's length; they must not reach the output. A window model's null block (past the
    usable ones, kv_pool.py) is zeros by construction and never written: it stays so."""
    usable = pool.num_blocks * pool.block_size
    for t in (pool.k, pool.v, pool.k_scale, pool.v_scale):
        if t is not None:
            t[:, :usable].fill_(float("nan"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("graphs")
    path = write_synthetic(folder / "tiny.gguf", "tiny-llama", "q8_0", progress=False)
    dev = "cuda" if CUDA else "cpu"
    weights = "auto" if CUDA else exact_weights.WEIGHTS
    return load_model(
        path, RuntimeConfig(device=dev, dtype="fp32" if not CUDA else "auto", weights=weights)
    )


PROMPTS = [[5 + i for i in range(n)] for n in (5, 17, 30, 9, 2)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
# 5 requests finishing at different steps: decode batches of 5, 4, 3, 2 and 1 sequences
PARAMS = [replace(GREEDY, max_tokens=n) for n in (4, 12, 8, 10, 16)]


def _generate(
    tiny, graphs: bool, capture: bool, kv_dtype: str, spec: str = "off", rows: int = 4,
    prompts=PROMPTS, params=PARAMS, max_rows: int = 0, step_tokens: int = 2048, row_tile: int = 32,
    stores_keys: bool | None = None,
):  # fmt: skip
    llm = LLM(
        loaded=tiny, kv_dtype=kv_dtype, num_kv_blocks=48, block_size=16, max_model_len=128,
        max_num_seqs=5, enforce_eager=True, device=tiny[1].runtime.device, speculative=spec,
        num_speculative_tokens=6, max_num_batched_tokens=step_tokens,
    )  # fmt: skip
    ex = llm.engine.executor
    runner = ex.runner
    poison(ex.pool)
    if graphs:  # max batch 4: steps of 3 pad to 4, steps of 5 are too many (eager)
        ex.set_graphs(DecodeGraphs(tiny[1], ex.pool, rows, 128, max_rows, row_tile))
        if stores_keys is not None:  # (what a GPU's kernels say, on the CPU's static path)
            runner.graphs.attention_stores_keys = stores_keys
        if capture:
            runner.graphs.capture()
    outs = llm.generate(prompts, params)
    # the engine's count of steps through the buffers (/metrics) is the buffers' own
    assert llm.engine.stats.graphed == (runner.graphs.steps if graphs else 0)
    return outs, runner.graphs, llm.engine.spec


def _compare(tiny, capture: bool, kv_dtype: str) -> None:
    # On a CPU the static path runs the references (the CPU kernels read host lists); on CUDA
    # both paths run the kernels the device selects.
    refs = {} if CUDA else {"kv_write": "torch", "paged_attention": "torch"}
    with forcing(refs):
        eager, _, _ = _generate(tiny, False, False, kv_dtype)
        static, graphs, _ = _generate(tiny, True, capture, kv_dtype)
    assert graphs.steps > 0
    _same(eager, static, kv_dtype)


def _same(want, got, kv_dtype: str) -> None:
    """Same greedy tokens, and logprobs of them within the KV dtype's rounding."""
    for a, b in zip(want, got, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        la = torch.tensor([lp.logprob for lp in ca.logprobs])
        lb = torch.tensor([lp.logprob for lp in cb.logprobs])
        assert torch.allclose(la, lb, atol=1e-4 if kv_dtype == "fp32" else 2e-2)


def test_static_buffer_path_equals_eager(tiny) -> None:
    """Greedy tokens and logprobs of 5 requests (decode batches of 5, then fewer as they
    finish) through the static buffers equal the eager engine's."""
    _compare(tiny, capture=False, kv_dtype="fp32")


def _compare_mixed(tiny, capture: bool, kv_dtype: str) -> None:
    """Prompt chunks of 12-token steps (a step budget of 12 tokens cuts every prompt, and later
    prompts start beside running decodes): through buckets of up to 32 rows, against eager.
    The buckets past 8 rows take prompt rows in tiles of 4 (on a GPU, the tile kernel)."""
    refs = {} if CUDA else {"kv_write": "torch", "paged_attention": "torch"}
    with forcing(refs):
        eager, _, _ = _generate(tiny, False, False, kv_dtype, step_tokens=12)
        static, graphs, _ = _generate(
            tiny, True, capture, kv_dtype, rows=8, max_rows=32, step_tokens=12, row_tile=4
        )
    assert graphs.prompt_steps > 0 and graphs.steps > graphs.prompt_steps
    assert graphs.tiled_rows > 0
    _same(eager, static, kv_dtype)


def test_prompt_chunks_through_the_static_buffers_equal_eager(tiny) -> None:
    _compare_mixed(tiny, capture=False, kv_dtype="fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp16"])
def test_gpu_captured_prompt_chunks_equal_eager(tiny, kv_dtype: str) -> None:
    _compare_mixed(tiny, capture=True, kv_dtype=kv_dtype)


def test_prompt_rows_past_the_context_budget_run_eagerly(tiny, monkeypatch) -> None:
    """A step whose prompt rows would read more than PROMPT_ROW_CONTEXT row-positions (each row
    reads its whole context) runs eagerly: the 30-token prompt alone reads 465."""
    from hetero.execution import cuda_graph

    monkeypatch.setattr(cuda_graph, "PROMPT_ROW_CONTEXT", 400)
    with forcing({} if CUDA else {"kv_write": "torch", "paged_attention": "torch"}):
        eager, _, _ = _generate(tiny, False, False, "fp32", prompts=[PROMPTS[2]], params=[GREEDY])
        static, graphs, _ = _generate(
            tiny, True, False, "fp32", rows=8, max_rows=64, prompts=[PROMPTS[2]], params=[GREEDY]
        )
    assert graphs.prompt_steps == 0 and graphs.steps == GREEDY.max_tokens - 1
    _same(eager, static, "fp32")


@pytest.mark.parametrize("m,p,tile", [(512, 0, 32), (100, 3000, 32), (7, 40, 4), (3, 0, 8)])
def test_row_context_in_tiles_bounds_what_the_tiles_read(m: int, p: int, tile: int) -> None:
    """chunk_row_context against the reads of a layout the graphs make: a decode row, then the
    chunk (so its first tile - 1 rows share a tile with the decode and read alone: the most
    that can), split by split_row_tiles; each tile reads up to its longest row's context."""
    from hetero.execution.cuda_graph import chunk_row_context
    from hetero.execution.paged_meta import split_row_tiles

    lens = torch.tensor([p + 5] + [p + i + 1 for i in range(m)], dtype=torch.int32)
    ids = torch.tensor([-1] + [0] * m)
    alone, tiled = split_row_tiles(lens, ids, tile)
    reads = int(alone[1:].sum()) + sum(int(t.max()) for t in tiled.split(tile))
    assert chunk_row_context(m, p) == int(lens[1:].sum())  # row by row: every row its own
    assert chunk_row_context(m, p, tile) == reads
    if m >= 4 * tile:
        assert reads < chunk_row_context(m, p) / 3


def test_fits_within_the_buckets_and_needs_tensor_kernels(tiny) -> None:
    llm = LLM(loaded=tiny, kv_dtype="fp32", num_kv_blocks=16, max_model_len=64, enforce_eager=True)
    if not CUDA:  # the CPU kernels read host lists: refused, not silently wrong
        with pytest.raises(ValueError, match="host lists"):
            DecodeGraphs(tiny[1], llm.engine.executor.pool, 2, 64)
    with forcing({} if CUDA else {"kv_write": "torch", "paged_attention": "torch"}):
        decode_only = DecodeGraphs(tiny[1], llm.engine.executor.pool, 2, 64)
        mixed = DecodeGraphs(tiny[1], llm.engine.executor.pool, 2, 64, max_rows=4)
    assert mixed.buckets == [1, 2, 4]
    eng = llm.engine
    eng.add_request("a", [1, 2, 3], GREEDY)
    out = eng.scheduler.schedule()
    assert not decode_only.fits(out)  # 3 prompt rows: more than its 2
    assert mixed.fits(out)  # one producing row of 3, in the 4-row bucket
    eng.scheduler.abort("a")
    eng.add_request("b", list(range(1, 60)), GREEDY)
    assert not mixed.fits(eng.scheduler.schedule())  # 59 rows
    eng.scheduler.abort("b")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp16"])
def test_gpu_captured_graphs_equal_eager(tiny, kv_dtype: str) -> None:
    _compare(tiny, capture=True, kv_dtype=kv_dtype)


@pytest.fixture(scope="module")
def tiny32(tiny):
    """tiny with float32 activations on CUDA too: verify rows run other matmul shapes (T = 1 + k
    per request, padded to the bucket) than plain decode, so bf16 rounding could flip a greedy
    near-tie; in float32 the outputs must be equal."""
    if not CUDA:
        return tiny
    return load_model(tiny[0].path, RuntimeConfig(device="cuda", dtype="fp32"))


# prompts that repeat a run: n-gram lookup guesses from the first step of the answer
REPEATS = [[(7 * j + 3 * i) % 200 + 5 for j in range(6 + i)] * 3 for i in range(4)]
LONG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)


def _compare_spec(tiny, capture: bool, kv_dtype: str, prompts, rows: int, stores_keys=None):
    refs = {} if CUDA else {"kv_write": "torch", "paged_attention": "torch"}
    params = [LONG] * len(prompts)
    with forcing(refs):
        plain, _, _ = _generate(tiny, False, False, kv_dtype, prompts=prompts, params=params)
        got, graphs, spec = _generate(
            tiny, True, capture, kv_dtype, "ngram", rows, prompts=prompts, params=params,
            stores_keys=stores_keys,
        )  # fmt: skip
    assert spec.proposed > 0 and spec.accepted > 0
    assert graphs.rows_run > graphs.steps, "verify steps ran through the static buffers"
    if graphs.attention_stores_keys:  # verify steps: the graphs that store keys first
        assert graphs.shared_steps > 0
        assert not capture or all((b, True) in graphs.graphs for b in graphs.buckets[1:])
    else:
        assert graphs.shared_steps == 0
    _same(plain, got, kv_dtype)
    return graphs


@pytest.mark.parametrize("n", [1, 4])
def test_static_buffer_path_with_guesses_equals_plain_decoding(tiny32, n: int) -> None:
    """Verify steps (each decode 1 + k rows, k <= 6) through the static buffers: greedy tokens
    and logprobs equal plain decoding's, alone and 4 at once (the engine trims guesses to the
    16 rows of the largest graph; prefill steps run eagerly). On CUDA in float32 activations
    (tiny32): bf16 rounding, which differs between one row and 1 + k, flips greedy near-ties."""
    _compare_spec(tiny32, False, "fp32", REPEATS[:n], 16)


def test_rows_that_share_a_sequence_take_graphs_that_store_keys_first(tiny32) -> None:
    """Where a decode step's attention launch stores each row's key itself (a GPU's
    rope_attention kernel: its programs are unordered), a verify step's rows, one sequence's,
    would read keys not yet stored: such steps take their bucket's other graph (`shared`
    metadata: the keys stored by a launch before the attention's), decode steps of distinct
    sequences the fused one, a bucket of one row has one graph. On the CPU's static path (the
    references attend): the graphs each step took, and outputs equal plain decoding."""
    graphs = _compare_spec(tiny32, False, "fp32", REPEATS[:2], 16, stores_keys=True)
    assert graphs._kinds(1) == (False,) and graphs._kinds(16) == (False, True)
    assert graphs.steps > graphs.shared_steps  # (the plain decode steps after guesses stop)


def test_prompt_rows_share_a_sequence_too(tiny) -> None:
    """A prompt chunk's rows in a bucket where they attend one by one are one sequence's as
    well (steps of 6 tokens: every chunk in a bucket of at most 8 rows); in the row tiles'
    buckets the attention never stores keys: one graph each."""
    with forcing({} if CUDA else {"kv_write": "torch", "paged_attention": "torch"}):
        eager, _, _ = _generate(tiny, False, False, "fp32", step_tokens=6)
        static, graphs, _ = _generate(
            tiny, True, False, "fp32", rows=8, max_rows=32, step_tokens=6, row_tile=4,
            stores_keys=True,
        )  # fmt: skip
    assert graphs._kinds(8) == (False, True) and graphs._kinds(16) == (False,)
    assert 0 < graphs.shared_steps < graphs.steps
    _same(eager, static, "fp32")


def test_guess_rows_of_one_request_attend_causally(tiny) -> None:
    """One verify step by hand: its rows' logits equal those of the eager step (the prefill
    kernel's causal attention over the 1 + k new tokens), padding rows dropped."""
    refs = {} if CUDA else {"kv_write": "torch", "paged_attention": "torch"}
    with forcing(refs):
        llm = LLM(
            loaded=tiny, kv_dtype="fp32", num_kv_blocks=48, block_size=16, max_model_len=128,
            enforce_eager=True, device=tiny[1].runtime.device, speculative="off",
            overlap_schedule="off",  # (steps by hand: each done when step() returns)
        )  # fmt: skip
        eng = llm.engine
        poison(eng.executor.pool)
        graphs = DecodeGraphs(tiny[1], eng.executor.pool, 8, 128)
        eng.add_request("a", list(range(5, 35)), GREEDY)
        eng.step()  # the prompt
        guess = {"a": [40, 41, 42, 43, 44]}  # 6 rows: pads to the bucket of 8
        out = eng.scheduler.schedule(guess)
        assert out.scheduled[0].spec_ids == (40, 41, 42, 43, 44) and graphs.fits(out)
        static = graphs.run(out.scheduled)
        eager, _ = eng.executor.runner.run(out)
    assert static.shape == eager.shape == (6, tiny[1].config.vocab_size)
    assert torch.allclose(static, eager, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16"])
def test_gpu_captured_graphs_with_guesses_equal_plain(tiny32, kv_dtype: str) -> None:
    """(Failed before the graphs of rows that share a sequence: the attention's launch stored
    each guess row's key while other rows of the step read it, sometimes before.)"""
    _compare_spec(tiny32, True, kv_dtype, REPEATS, 16)


TWO_GPUS = CUDA and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
def test_a_second_gpu_captures_its_own_work() -> None:
    """torch's default capture stream is made once, on the device current at the first capture:
    a later capture for cuda:1 on it records nothing (the profile then read cuda:1 at 50 TB/s)."""
    from hetero.profiler.measure import replayed

    for dev in (torch.device("cuda:0"), torch.device("cuda:1")):
        x = torch.randn(4096, device=dev)
        y = torch.zeros_like(x)
        run = replayed(lambda x=x, y=y: y.copy_(x * 2), dev)
        y.zero_()
        run()
        torch.cuda.synchronize(dev)
        assert torch.equal(y, x * 2), f"the replay on {dev} did not run the captured copy"


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
def test_an_engine_on_the_second_gpu_replays_real_graphs(tmp_path) -> None:
    """An engine on cuda:1 in a process whose current device is cuda:0 (graphs captured on cuda:0
    first): the same greedy tokens as on cuda:0, through its own decode graphs."""
    path = write_synthetic(tmp_path / "tiny.gguf", "tiny-llama", "q8_0", progress=False)
    outs = []
    for dev in ("cuda:0", "cuda:1"):
        torch.cuda.set_device(0)
        llm = LLM(str(path), device=dev, dtype="float32", kv_dtype="fp16", num_kv_blocks=64,
                  max_model_len=128, max_num_seqs=8, speculative="off")  # fmt: skip
        got = llm.generate(PROMPTS, PARAMS)
        assert llm.engine.executor.runner.graphs.steps > 0
        outs.append(got)
    _same(outs[0], outs[1], "fp16")


def test_programmatic_launch_only_on_cuda_sm90(monkeypatch) -> None:
    from hetero.kernels import pdl

    small, big = torch.zeros(1, 8), torch.zeros(pdl.PDL_MAX_ROWS + 1, 8)
    for flag in ("", "1"):
        monkeypatch.setenv("HETERO_PDL", flag)
        assert not pdl.pdl_ok("cpu") and pdl.pdl_launch(small) == {}
    if CUDA:
        small, big = small.cuda(), big.cuda()
        on = torch.cuda.get_device_capability() >= (9, 0)
        launch = {"PDL": True, "launch_pdl": True} if on else {}
        monkeypatch.setenv("HETERO_PDL", "")  # the default: small steps only
        assert pdl.pdl_launch(small) == launch and pdl.pdl_launch(big) == {}
        assert pdl.pdl_ok("cuda", pdl.PDL_MAX_ROWS) == on
        monkeypatch.setenv("HETERO_PDL", "1")  # every size
        assert pdl.pdl_launch(small) == launch == pdl.pdl_launch(big)
        monkeypatch.setenv("HETERO_PDL", "0")  # none
        assert not pdl.pdl_ok("cuda") and pdl.pdl_launch(small) == {}


@pytest.mark.gpu
def test_gpu_graphs_with_programmatic_launch_equal_plain_launches(tiny, monkeypatch) -> None:
    """The small kernels launched programmatically (sm_90+: each waits for the one before it,
    kernels/pdl.py) give the bits of plain launches: replayed graphs of 5 requests' decode
    batches, tokens and logprobs equal."""
    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("HETERO_PDL", flag)
        got, graphs, _ = _generate(tiny, True, True, "fp8")
        assert graphs.steps > 0
        outs.append([(o.outputs[0].token_ids, [p.logprob for p in o.outputs[0].logprobs])
                     for o in got])  # fmt: skip
    assert outs[0] == outs[1]
