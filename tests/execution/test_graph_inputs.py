"""The decode graphs' static inputs (execution/graph_inputs.py): one arena filled from a host
mirror must hold, in every row a bucket reads, what the straightforward fill (torch tensors per
buffer, `reference_fill` below: the fill the graphs used before) gives, padding rows included.

Checked on every step of real engine runs through the static buffers (decodes, prompt chunks
in row tiles, speculative rows, gpt-oss's two KV cache groups with the window's blocks
released) and on random steps made by hand, whose tables grow, shrink and move between rows.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from hetero.config import RuntimeConfig
from hetero.engine.request import Request
from hetero.engine.scheduler import ScheduledRequest
from hetero.execution.cuda_graph import DecodeGraphs, bucket_for
from hetero.execution.kv_pool import KVPool
from hetero.execution.paged_meta import split_row_tiles
from hetero.kernels.registry import forcing
from hetero.llm import LLM
from hetero.model.llama import LlamaModel, load_model
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic

REFS = {"kv_write": "torch", "paged_attention": "torch", "paged_attention_sinks": "torch"}


def reference_fill(g: DecodeGraphs, sched: list[ScheduledRequest], b: int) -> dict:
    """What rows [:b] of each static buffer must hold (logit_rows: its first min(b, max_batch)),
    built as the graphs built it before the arena: a torch tensor per buffer."""
    bs = g.block_size
    tokens, positions, produce = [], [], []
    tables = {k: torch.zeros(b, g.max_blocks, dtype=torch.int32) for k in g.groups}
    chunk_ids = torch.full((b,), -1, dtype=torch.long)
    row = 0
    for i, s in enumerate(sched):
        pos, m = s.start_pos, s.num_new_tokens
        known = m - len(s.spec_ids)
        tokens += [*s.req.tokens(pos, pos + known), *s.spec_ids]
        positions += range(pos, pos + m)
        for k, t in tables.items():
            table = s.req.block_tables[k][: (pos + m - 1) // bs + 1]
            t[row : row + m, : len(table)] = torch.tensor(table, dtype=torch.int32)
        if not (s.produces_token and m == 1 + len(s.spec_ids)):
            chunk_ids[row : row + m] = i
        row += m
        if s.produces_token:
            produce += range(row - 1 - len(s.spec_ids), row)
    pad, lc = b - row, min(b, g.max_batch)
    pos_t = torch.tensor(positions + [0] * pad, dtype=torch.long)
    lens = torch.where(torch.arange(b) < row, pos_t + 1, 0).to(torch.int32)
    want = {
        "produced": len(produce),
        "logit_rows": torch.tensor(produce + [0] * (lc - len(produce)), dtype=torch.long),
        "tokens": torch.tensor(tokens + [0] * pad, dtype=torch.long),
        "positions": pos_t,
        "seq_lens": lens,
    }
    block_of = (pos_t // bs)[:, None].to(torch.long).clamp_max(g.max_blocks - 1)
    for k, t in tables.items():
        blocks = t.gather(1, block_of)
        want[f"slots{k}"] = torch.where(lens > 0, blocks[:, 0].long() * bs + pos_t % bs, -1)
        want[f"tables{k}"] = t
    if g._tile(b) > 1:
        want["decode_lens"], want["tile_lens"] = split_row_tiles(lens, chunk_ids, g.row_tile)
        want["tiled"] = int((want["tile_lens"] > 0).sum())
    return want


def static_rows(g: DecodeGraphs, b: int, host: bool = True) -> dict:
    got = {
        "logit_rows": g.logit_rows[: min(b, g.max_batch)],
        "tokens": g.tokens[:b],
        "positions": g.positions[:b],
        "seq_lens": g.seq_lens[:b],
    }
    for k in g.groups:
        got[f"slots{k}"], got[f"tables{k}"] = g.slots[k][:b], g.block_tables[k][:b]
    if g._tile(b) > 1:
        got["decode_lens"], got["tile_lens"] = g.decode_lens[:b], g.tile_lens[:b]
    return {k: v.cpu() if host else v.clone() for k, v in got.items()}


def buffer_ptrs(g: DecodeGraphs) -> list[int]:
    tensors = [g.tokens, g.positions, g.seq_lens, g.logit_rows, g.decode_lens, g.tile_lens]
    tensors += [t for t in (*g.slots, *g.block_tables) if t is not None]
    return [t.data_ptr() for t in tensors]


class Checked:
    """Wraps a DecodeGraphs' fill: every step's static rows against reference_fill."""

    def __init__(self, g: DecodeGraphs) -> None:
        self.g, self.fill, self.steps, self.kinds = g, g._fill, 0, set()
        self.ptrs = buffer_ptrs(g)
        g._fill = self

    def __call__(self, sched: list[ScheduledRequest], b: int) -> int:
        g = self.g
        want = reference_fill(g, sched, b)
        tiled = g.tiled_rows
        produced = self.fill(sched, b)
        assert produced == want.pop("produced")
        if "tiled" in want:
            assert g.tiled_rows - tiled == want.pop("tiled")
        got = static_rows(g, b)
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert got[name].dtype == t.dtype, name
            assert torch.equal(got[name], t), (name, b, got[name], t)
        assert buffer_ptrs(g) == self.ptrs  # a captured graph reads these addresses
        self.steps += 1
        kinds = {
            "pad": sum(s.num_new_tokens for s in sched) < b,
            "spec": any(s.spec_ids for s in sched),
            "prompt": any(s.num_new_tokens > 1 + len(s.spec_ids) for s in sched),
        }
        self.kinds |= {k for k, seen in kinds.items() if seen}
        return produced


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("gi") / "t.gguf", "tiny-llama", "q8_0", False)
    return load_model(path, RuntimeConfig(device="cpu", weights="fp16", dtype="fp32"))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("gi") / "g.gguf", "tiny-gpt-oss", "q8_0", False)
    return load_model(path, RuntimeConfig(device="cpu", weights="dense", dtype="fp32"))


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5 + i for i in range(n)] for n in (5, 17, 30, 9, 2)]
PARAMS = [replace(GREEDY, max_tokens=n) for n in (4, 12, 8, 10, 16)]
REPEATS = [[(7 * j + 3 * i) % 200 + 5 for j in range(6 + i)] * 3 for i in range(4)]

# (graph rows, max_rows, row_tile, step token budget, speculation, block size): the kinds of
# step each run must have gone through
RUNS = {
    "decode": ((4, 0, 32, 2048, "off", 16), {"pad"}),
    "prompt rows in tiles": ((8, 32, 4, 12, "off", 16), {"pad", "prompt"}),
    "guesses": ((16, 0, 32, 2048, "ngram", 16), {"pad", "spec"}),
}


@pytest.mark.parametrize("run", RUNS)
def test_every_engine_step_fills_what_the_reference_fills(tiny, run) -> None:
    (rows, max_rows, tile, budget, spec, bs), kinds = RUNS[run]
    prompts, params = (REPEATS, [replace(GREEDY, max_tokens=24)] * 4) if spec != "off" else (
        PROMPTS, PARAMS)  # fmt: skip
    with forcing(REFS):
        llm = LLM(
            loaded=tiny, kv_dtype="fp32", num_kv_blocks=48, block_size=bs, max_model_len=128,
            max_num_seqs=5, enforce_eager=True, device="cpu", speculative=spec,
            num_speculative_tokens=6, max_num_batched_tokens=budget,
        )  # fmt: skip
        ex = llm.engine.executor
        ex.set_graphs(DecodeGraphs(tiny[1], ex.pool, rows, 128, max_rows, tile))
        checked = Checked(ex.runner.graphs)
        llm.generate(prompts, params)
    assert checked.steps > 5 and kinds <= checked.kinds


def test_two_kv_groups_with_window_blocks_released(gpt_oss) -> None:
    """gpt-oss: a window group (blocks released as the window of 8 moves) and a full one, each
    with its own tables and slots; prompt rows in tiles of 4."""
    prompts = [[3 + (5 * i) % 900 for i in range(n)] for n in (21, 6, 13)]
    with forcing(REFS):
        llm = LLM(loaded=gpt_oss, kv_dtype="fp32", num_kv_blocks=40, block_size=4,
                  max_model_len=64, enforce_eager=True, device="cpu", speculative="off",
                  max_num_batched_tokens=8, max_num_seqs=3)  # fmt: skip
        ex = llm.engine.executor
        ex.set_graphs(DecodeGraphs(gpt_oss[1], ex.pool, 4, 64, max_rows=8, row_tile=4))
        g = ex.runner.graphs
        assert g.groups == [0, 1]
        checked = Checked(g)
        llm.generate(prompts, replace(GREEDY, max_tokens=14))
    assert checked.steps > 5 and {"pad", "prompt"} <= checked.kinds and g.tiled_rows > 0


def _random_step(rng: random.Random, reqs: list[Request], g: DecodeGraphs) -> tuple[list, int]:
    """A random step: decodes (some with guesses) and prompt chunks, within a random bucket;
    each request's tables made afresh (longer, shorter or other blocks than its last)."""
    bs, cap = g.block_size, g.max_blocks * g.block_size
    total = rng.randint(1, g.buckets[-1])
    sched, rows, producing = [], 0, 0
    for req in rng.sample(reqs, len(reqs)):
        kind = rng.choice(["decode", "decode", "guess", "prompt"])
        m = 1 if kind == "decode" else rng.randint(2, 9)
        spec = tuple(rng.randrange(900) for _ in range(m - 1)) if kind == "guess" else ()
        produces = kind != "prompt" or rng.random() < 0.5
        if rows + m > total or producing + produces * (1 + len(spec)) > g.max_batch:
            continue
        pos = rng.randint(0, cap - m)
        known = m - len(spec)
        req.prompt_ids = [rng.randrange(900) for _ in range(pos + known)]
        req.output_ids = []
        width = (pos + m - 1) // bs + 1
        # a window group's table may be shorter than the blocks the positions reach
        req.block_tables = [
            [rng.randrange(1, 500) for _ in range(width - (k == 0 and rng.random() < 0.2))]
            for k in range(g.pool.layout.n_groups)
        ]
        sched.append(ScheduledRequest(req, m, pos, kind == "prompt", produces, spec))
        rows += m
        producing += produces * (1 + len(spec))
    if not sched:
        return _random_step(rng, reqs, g)
    return sched, bucket_for(rows, g.buckets)


@pytest.mark.parametrize("model", ["tiny", "gpt_oss", "gpt_oss window layer"])
def test_random_steps_fill_what_the_reference_fills(request, model) -> None:
    """300 random steps through one set of buffers: every bucket, padding, guesses, prompt rows
    (tiled in the buckets past max_batch), tables that shrink, grow and change rows; a stage
    holding only gpt-oss's first layer (its window) has only the window group's tables."""
    loaded = request.getfixturevalue(model.split()[0])
    layers = range(1) if model.endswith("window layer") else range(loaded[1].config.n_layers)
    cfg = loaded[1].config
    pool = KVPool(cfg, layers, 64, 4, "fp32")
    with forcing(REFS):
        stage = loaded[1] if len(layers) == cfg.n_layers else LlamaModel(
            loaded[0], loaded[1].runtime, layers)  # fmt: skip
        g = DecodeGraphs(stage, pool, 8, 96, max_rows=40, row_tile=4)
    assert g.groups == ([1] if len(layers) == 1 else list(range(pool.layout.n_groups)))
    checked = Checked(g)
    rng = random.Random(model)
    reqs = [Request(f"r{i}", [1]) for i in range(12)]
    for _ in range(300):
        sched, b = _random_step(rng, reqs, g)
        g._fill(sched, b)
    assert checked.kinds == {"pad", "spec", "prompt"} and g.tiled_rows > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fills_queued_behind_a_busy_device_keep_their_values(tmp_path) -> None:
    """Steps filled while the device is still busy (their copies from the pinned mirrors queued
    behind ~0.1 s of device work, each step's rows cloned on the device after its copy): every
    snapshot holds its own step's values, so no fill overwrote a mirror whose copy had not run."""
    path = write_synthetic(tmp_path / "t.gguf", "tiny-llama", "q8_0", progress=False)
    _, model = load_model(path, RuntimeConfig(device="cuda", weights="dense"))
    pool = KVPool(model.config, range(model.config.n_layers), 64, 4, "fp16", device="cuda")
    with forcing(REFS):
        g = DecodeGraphs(model, pool, 8, 96, max_rows=40, row_tile=4)
    rng = random.Random(7)
    reqs = [Request(f"r{i}", [1]) for i in range(12)]
    wants, snaps = [], []
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # cycles: ~0.1 s at H200 clocks
    for _ in range(12):
        sched, b = _random_step(rng, reqs, g)
        want = reference_fill(g, sched, b)
        tiled = g.tiled_rows
        assert g._fill(sched, b) == want.pop("produced")
        if "tiled" in want:
            assert g.tiled_rows - tiled == want.pop("tiled")
        wants.append(want)
        snaps.append(static_rows(g, b, host=False))
    torch.cuda.synchronize()
    for want, snap in zip(wants, snaps, strict=True):
        for name, t in want.items():
            assert torch.equal(snap[name].cpu(), t), name
