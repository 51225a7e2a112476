"""gpt-oss's sliding-window layers keep only their window's KV blocks (engine/kv_groups.py), and
the engine's tokens and logits stay those of the contiguous reference.

A tiny random GptOssForCausalLM (tests/support/moe_models.py: window 6 on layers 0 and 2, layer 1
full), fp32 KV in blocks of 4, greedy decoding well past several windows. The reference is
hetero/model/contiguous_kv.py over each final sequence in one pass (every position's logits,
the window as a mask over all the keys). While the engine runs, each request's window group
holds a bounded number of blocks, whatever its length.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from gguf import GGMLQuantizationType as T

from hetero.config import RuntimeConfig
from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.launch import LaunchConfig, build_engine
from hetero.model.contiguous_kv import ContiguousKV
from hetero.model.forward_batch import ForwardBatch
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams
from tests.model.test_moe_models import RowRecorder
from tests.support.moe_models import VOCAB, tiny_gpt_oss, write_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

B, W, TOKENS = 4, 6, 30  # 30 new tokens: past five windows
TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = write_gguf(tiny_gpt_oss(seed=1), tmp_path_factory.mktemp("swa") / "gpt-oss.gguf")
    return load_model(path, RuntimeConfig(device="cpu", weights="dense"))


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(13)]
    return [shared + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 11))] for _ in range(3)]


def engine(loaded, block_size: int = B, **options):
    sched = SchedulerConfig(max_num_batched_tokens=options.pop("budget", 8), max_num_seqs=2)
    cfg = EngineConfig(block_size=block_size, kv_dtype="fp32", scheduler=sched, **options)
    return build_engine(None, LaunchConfig(cfg), loaded=loaded)


def generate(eng, batch: list[list[int]], tag: str = "", cached=None) -> list[list[int]]:
    """Run the batch to the end, checking the block manager and the window group's blocks
    after every step; the final sequences (`cached`: each request's prompt tokens that came
    from the prefix cache, filled in)."""
    bm, bs = eng.block_manager, eng.block_manager.block_size
    bound = -(-(W - 1) // bs) + (bs + eng.scheduler.step_tokens - 2) // bs + 1
    finals = {}
    for i, p in enumerate(batch):
        eng.add_request(f"{tag}{i}", p, GREEDY)
        finals[f"{tag}{i}"] = list(p)
    while eng.has_unfinished():
        for o in eng.step():
            finals[o.request_id] += o.new_token_ids
            if cached is not None:
                cached[o.request_id] = o.num_cached_tokens
        bm.check()
        for r in eng.scheduler.running:
            full, window = r.block_tables
            assert len([b for b in window if b != bm.null_block]) <= bound
            assert bm.null_block not in full
    return list(finals.values())


def reference_logits(model, seq: list[int]) -> torch.Tensor:
    """[len(seq), V]: every position's logits over a contiguous cache, in one pass."""
    kv = ContiguousKV(model.config, len(seq), torch.float32)
    kv.begin(len(seq))
    rows = torch.arange(len(seq))
    return model(torch.tensor(seq), ForwardBatch(rows, rows, kv))


def check_rows(model, finals: list[list[int]], rec: RowRecorder, chose: bool = True) -> int:
    """Each logits row the engine produced against the reference at its position, and (chose:
    the rows of the model that chose the tokens) each greedy token the reference's argmax; how
    many rows were compared."""
    ref = {tuple(s): reference_logits(model, s) for s in finals}
    n = 0
    for prefix, row in rec.rows:
        seq = next((s for s in finals if s[: len(prefix)] == prefix), None)
        if seq is None:  # a rejected guess's row
            continue
        want = ref[tuple(seq)][len(prefix) - 1]
        assert (row - want).abs().max().item() < TOL
        if chose and len(prefix) < len(seq):
            assert seq[len(prefix)] == int(want.argmax())
        n += 1
    return n


def test_windows_release_blocks_and_match_the_contiguous_reference(loaded) -> None:
    eng = engine(loaded, speculative="off")
    assert eng.executor.info.kv_windows == (0, W)
    pool = eng.executor.pool
    assert pool.k.shape[0] == 2 and pool.layout.slots == (0, 0, 1)  # 2 slots for 3 layers
    rec = RowRecorder(eng.executor.runner)
    finals = generate(eng, prompts())
    assert check_rows(loaded[1], finals, rec) == 3 * TOKENS
    # what the window group released is parked, named: the cache holds more than live tables
    assert eng.block_manager.num_cached_blocks > 0


def test_prefix_hits_give_a_cold_runs_tokens(loaded) -> None:
    """Round two repeats round one's prompts and continues its sequences (the next turn of a
    chat): hits in both groups, the same tokens and logits as an engine without a cache."""
    cold = engine(loaded, speculative="off", enable_prefix_caching=False)
    warm = engine(loaded, speculative="off")
    rec = RowRecorder(warm.executor.runner)
    first = generate(warm, prompts(), tag="a")
    again = prompts() + [s + [7, 8, 9] for s in first]
    cached: dict[str, int] = {}
    got = generate(warm, again, tag="b", cached=cached)
    assert got == generate(cold, again)
    assert check_rows(loaded[1], first + got, rec) == (3 + 6) * TOKENS
    # the repeated prompts hit their shared prefix at least; each continued sequence its own
    # tokens up to the block boundary of its end (the window group kept that window)
    assert all(cached[f"b{i}"] >= 12 for i in range(3))
    for i, s in enumerate(first):
        assert cached[f"b{3 + i}"] == (len(s) - 1) // B * B


def test_speculation_and_preemption(loaded) -> None:
    """n-gram guesses verified in one pass (rejected ones trimmed from both groups) in a pool
    so small that requests are preempted and recomputed: the reference's tokens and logits."""
    eng = engine(loaded, speculative="ngram", num_kv_blocks=22, budget=12)
    rec = RowRecorder(eng.executor.runner)
    batch = [[5, 6, 7, 8] * 4 + p[-3:] for p in prompts(1)]
    finals = generate(eng, batch)
    assert eng.scheduler.num_preemptions > 0
    assert eng.spec.proposed > 0
    assert check_rows(loaded[1], finals, rec) >= 3 * TOKENS


def test_a_draft_model_with_windows_rolls_back_within_its_slack(loaded, tmp_path) -> None:
    """A draft of the model's Q4_K weights: some guesses are rejected, so its mirrors roll back
    by up to k - 1 computed tokens, more than a block of 2, and still read the window blocks
    they kept for that (window_slack). Every row the draft computed on accepted tokens is the
    draft model's reference logits there (with no slack, rows read released blocks)."""
    draft = write_gguf(tiny_gpt_oss(seed=1), tmp_path / "draft.gguf", T.Q4_K)
    eng = engine(loaded, 2, speculative="draft", draft_model=str(draft), num_speculative_tokens=8)
    dbm = eng.spec.bm
    assert dbm.windows == (0, W) and dbm.window_slack == 8
    rec = RowRecorder(eng.executor.runner)
    drafted = RowRecorder(eng.spec.draft.runner)
    finals = generate(eng, prompts(2))
    assert eng.spec.proposed > eng.spec.accepted > 0
    assert check_rows(loaded[1], finals, rec) >= 3 * TOKENS
    assert check_rows(eng.spec.draft.model, finals, drafted, chose=False) >= 3 * 10
