"""make_batch's tensors (one host buffer, one copy) against the straightforward ones, and the
engine's SamplingStates: a kept state equals a fresh make_batch, and it is rebuilt whenever the
step could change it (a seeded row, a logit bias, min_tokens pending, penalties, other params,
an allowed mask)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from hetero.rng import stream_key
from hetero.sampler import SamplingState, SamplingStates, make_batch
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0)
HOT = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05)
EOS = (2,)


def same_state(a: SamplingState, b: SamplingState) -> None:
    for f in fields(SamplingState):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif isinstance(x, tuple) and x and isinstance(x[0], torch.Tensor):
            assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True)), f.name
        else:
            assert x == y, f.name


def test_make_batch_rows_equal_the_straightforward_tensors() -> None:
    ps = [
        GREEDY,
        HOT,
        replace(HOT, seed=2**63 - 1),
        SamplingParams(temperature=1.3, seed=0, repetition_penalty=1.2, presence_penalty=-0.5,
                       frequency_penalty=0.25, top_k=-1),
    ]  # fmt: skip
    steps = [0, 3, 7, 2**20]
    state = make_batch(ps, [[1, 2]] * 4, [[3]] * 4, steps, "cpu")
    f32 = torch.float32
    want = {
        "temperature": torch.tensor([1.0, 0.7, 0.7, 1.3], dtype=f32),
        "top_p": torch.tensor([p.top_p for p in ps], dtype=f32),
        "min_p": torch.tensor([p.min_p for p in ps], dtype=f32),
        "repetition": torch.tensor([p.repetition_penalty for p in ps], dtype=f32),
        "presence": torch.tensor([p.presence_penalty for p in ps], dtype=f32),
        "frequency": torch.tensor([p.frequency_penalty for p in ps], dtype=f32),
        "top_k": torch.tensor([0, 40, 40, 0]),
        "seed_keys": torch.tensor([0, 0, stream_key(2**63 - 1, 7), stream_key(0, 2**20)]),
        "greedy": torch.tensor([True, False, False, False]),
        "seeded": torch.tensor([False, False, True, True]),
    }
    for name, t in want.items():
        got = getattr(state, name)
        assert got.dtype == t.dtype and torch.equal(got, t), name
    assert (state.all_greedy, state.any_greedy, state.max_top_k) == (False, True, 40)
    assert (state.any_seeded, state.all_seeded, state.any_repetition) == (True, False, True)


def test_a_steady_batch_keeps_its_state() -> None:
    states = SamplingStates()
    ps = [GREEDY, HOT, replace(HOT, logprobs=3, min_tokens=2)]
    first = states.make(ps, [[1]] * 3, [[]] * 3, [5, 6, 7], "cpu", None, EOS)
    again = states.make(list(ps), [[1]] * 3, [[4]] * 3, [6, 7, 8], "cpu", None, EOS)
    assert states.hits == 1 and again is first
    same_state(again, make_batch(ps, [[1]] * 3, [[4]] * 3, [6, 7, 8], "cpu", None, EOS))
    # equal params in other objects: the same state
    copies = [replace(p) for p in ps]
    assert copies[0] is not ps[0]
    assert states.make(copies, [[1]] * 3, [[]] * 3, [9, 9, 9], "cpu", None, EOS) is first


def _check(states: SamplingStates, ps, steps, outputs=None, allowed=None) -> SamplingState:
    """states.make against a fresh make_batch of the same rows."""
    outputs = outputs or [[]] * len(ps)
    rows = (ps, [[1, 2]] * len(ps), outputs, steps, "cpu", allowed, EOS)
    got = states.make(*rows)
    same_state(got, make_batch(*rows))
    return got


@pytest.mark.parametrize(
    "row",
    [
        replace(HOT, seed=11),
        replace(HOT, logit_bias={7: 3.0}),
        replace(HOT, repetition_penalty=1.3),
        replace(HOT, presence_penalty=0.5),
        replace(HOT, frequency_penalty=0.5),
    ],
    ids=["seed", "logit_bias", "repetition", "presence", "frequency"],
)
def test_rows_that_change_per_step_are_never_kept(row: SamplingParams) -> None:
    """Steps 3, 4, 5 of a batch with such a row: each a fresh state (new seed keys, outputs
    that grow); a logit bias (steady in itself) is rebuilt too."""
    states = SamplingStates()
    out = [5]
    for step in (3, 4, 5):
        _check(states, [GREEDY, row], [step, step], [out, list(out)])
        out = out + [step]
    assert states.hits == 0


def test_min_tokens_pending_is_rebuilt_then_kept_once_past() -> None:
    states = SamplingStates()
    ps = [GREEDY, replace(HOT, min_tokens=2)]
    s0 = _check(states, ps, [0, 0])
    s1 = _check(states, ps, [1, 1])
    assert s0.bias is not None and s1.bias is not None and states.hits == 0
    s2 = _check(states, ps, [2, 2])
    assert s2.bias is None
    assert _check(states, ps, [3, 3]) is s2 and states.hits == 1
    # the same params object in a new request still short of its min_tokens: rebuilt
    s4 = _check(states, ps, [4, 0])
    assert s4.bias is not None and s4.bias[0].tolist() == [1] * len(s4.bias[0])


def test_other_params_an_allowed_mask_or_rows_rebuild() -> None:
    states = SamplingStates()
    ps = [GREEDY, HOT]
    _check(states, ps, [1, 1])
    _check(states, [GREEDY, replace(HOT, top_p=0.5)], [2, 2])  # other params
    _check(states, [HOT, GREEDY], [3, 3])  # other order
    _check(states, [HOT, GREEDY, GREEDY], [4, 4, 4])  # another row
    _check(states, [HOT], [5])  # fewer rows
    assert states.hits == 0
    mask = torch.full((1, 4), -1, dtype=torch.int32)
    mask[0, 0] = 0b1010
    masked = _check(states, [HOT], [6], allowed=mask)
    assert masked.allowed is not None and states.hits == 0
    assert _check(states, [HOT], [7]).allowed is None  # the masked state was not kept
    assert _check(states, [HOT], [8]).allowed is None and states.hits == 1
    with pytest.raises(ValueError, match="one entry per row"):
        states.make([HOT], [[1], [2]], [[]], [9], "cpu")  # a kept state checks the rows too


def test_engine_tokens_equal_with_and_without_kept_states(tmp_path, monkeypatch) -> None:
    """Greedy and sampled requests (seeded, penalized, min_tokens, bias) through a tiny engine:
    the tokens equal those of an engine that builds every state afresh, and steady steps hit."""
    from hetero.config import RuntimeConfig
    from hetero.llm import LLM
    from hetero.model.llama import load_model

    path = write_synthetic(tmp_path / "t.gguf", "tiny-llama", "q8_0", progress=False)
    loaded = load_model(path, RuntimeConfig(device="cpu", weights="fp16"))
    params = [
        replace(GREEDY, max_tokens=12, ignore_eos=True),
        replace(GREEDY, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, max_tokens=12, seed=3, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=4, logit_bias={9: 5.0}, max_tokens=6),
    ]
    prompts = [[5 + 3 * i + j for j in range(4 + i)] for i in range(5)]
    runs, hits = [], []
    for keep in (True, False):
        if not keep:
            monkeypatch.setattr(SamplingStates, "make", lambda self, *a: make_batch(*a))
        llm = LLM(loaded=loaded, kv_dtype="fp32", num_kv_blocks=32, max_model_len=64,
                  speculative="off", enforce_eager=True)  # fmt: skip
        greedy_alone = llm.generate(prompts[:2], params[:2])
        mixed = llm.generate(prompts, params)
        runs.append([o.outputs[0].token_ids for o in greedy_alone + mixed])
        hits.append(llm.engine.sampling_states.hits)
    assert runs[0] == runs[1]
    assert hits[0] >= 8
