"""SamplingParams validation, the batched sampler against per-row references, seeds."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from hetero.penalties import apply_penalties
from hetero.rng import GOLDEN, stream_key, uniform, uniform_reference
from hetero.sampler import Sampler, make_batch, sample_next
from hetero.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", -0.01),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", math.nan),
        ("seed", 1 << 64),
        ("seed", -(1 << 63) - 1),
        ("seed", "7"),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", 21),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", 1),
        ("skip_special_tokens", None),
        ("include_stop_str_in_output", "yes"),
        ("min_tokens", -1),
        ("min_tokens", 17),  # more than max_tokens (16)
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {5: math.nan}),
        ("logit_bias", [(5, 1.0)]),
        ("structured_outputs", {"json": {}}),
    ],
)
def test_invalid_field_raises_naming_it(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_valid_edges_and_normalisation() -> None:
    p = SamplingParams(
        temperature=0, top_p=1, top_k=-1, min_p=1, seed=-(1 << 63), logprobs=20, stop="\n"
    )
    assert p.greedy and p.stop == ["\n"]
    assert not SamplingParams().greedy and SamplingParams(seed=(1 << 64) - 1).seed is not None
    children = [SamplingParams(n=3, seed=5).for_sequence(i) for i in range(3)]
    assert children[0].seed == 5 and len({c.seed for c in children}) == 3
    assert all(c.n == 1 for c in children) and SamplingParams(n=2).for_sequence(1).seed is None
    with pytest.raises(ValueError, match="index"):
        SamplingParams(n=2).for_sequence(2)


def test_make_batch_and_sampler_reject_bad_shapes() -> None:
    p = SamplingParams()
    with pytest.raises(ValueError, match="one entry per row"):
        make_batch([p, p], [[1], [2]], [[]], [0, 0], "cpu")
    with pytest.raises(ValueError, match="at least one"):
        make_batch([], [], [], [], "cpu")
    state = make_batch([p], [[1]], [[]], [0], "cpu")
    with pytest.raises(ValueError, match=r"logits must be \[1, V\]"):
        Sampler()(torch.zeros(2, 5), state)


# ---------------------------------------------------------------- rng


def test_torch_splitmix_matches_python_bit_for_bit() -> None:
    keys = [stream_key(0, 0), stream_key(1 << 63, 5), stream_key(-7, 123), -1, 0, GOLDEN >> 1]
    keys = [k - (1 << 64) if k >= 1 << 63 else k for k in keys]
    got = uniform(torch.tensor(keys), 300)
    want = [[uniform_reference(k, i) for i in range(300)] for k in keys]
    assert torch.equal(got, torch.tensor(want, dtype=torch.float64))
    assert 0 < got.min() and got.max() < 1
    big = uniform(torch.tensor(keys), 20000)
    assert abs(big.mean().item() - 0.5) < 0.003 and abs(big.var().item() - 1 / 12) < 0.002


# ---------------------------------------------------------------- penalties and greedy


def _reference_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list, outputs: list
) -> torch.Tensor:
    """Row by row, token by token: HF/vLLM repetition, then OpenAI frequency and presence."""
    out = logits.clone()
    f32 = torch.float32
    for b, p in enumerate(params):
        r = torch.tensor(p.repetition_penalty, dtype=f32)
        for t in set(prompts[b]) | set(outputs[b]):
            v = out[b, t]
            out[b, t] = v / r if v > 0 else v * r
        for t, c in Counter(outputs[b]).items():
            out[b, t] = out[b, t] - torch.tensor(p.frequency_penalty, dtype=f32) * c
            out[b, t] = out[b, t] - torch.tensor(p.presence_penalty, dtype=f32)
    return out


def _penalty_batch(vocab: int, greedy: bool) -> tuple[list, list, list, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    params, prompts, outputs = [], [], []
    for b in range(12):
        params.append(
            SamplingParams(
                temperature=0.0 if greedy else 0.9,
                repetition_penalty=(1.0, 1.3, 0.7, 2.0)[b % 4],
                presence_penalty=(0.0, 0.5, -0.5)[b % 3],
                frequency_penalty=(0.0, 0.3, -1.0, 2.0)[(b // 3) % 4],
            )
        )
        prompts.append(torch.randint(0, vocab, (b * 3 + 1,), generator=gen).tolist())
        outputs.append(torch.randint(0, vocab // 4, (b * 2,), generator=gen).tolist())
    logits = torch.randn(12, vocab, generator=gen) * 3
    return params, prompts, outputs, logits


def test_penalties_and_greedy_match_per_row_reference() -> None:
    params, prompts, outputs, logits = _penalty_batch(40, greedy=True)
    state = make_batch(params, prompts, outputs, [len(o) for o in outputs], "cpu")
    want = _reference_penalties(logits, params, prompts, outputs)
    got = apply_penalties(
        logits, state.prompt_ids, state.output_ids, state.repetition, state.presence,
        state.frequency,
    )  # fmt: skip
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)  # the penalties did something
    ids = Sampler()(logits, state).token_ids
    assert torch.equal(ids, want.argmax(-1))
    assert not torch.equal(ids, logits.argmax(-1))  # and changed some greedy choices


def test_greedy_without_penalties_is_argmax() -> None:
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(2))
    state = make_batch([SamplingParams(temperature=0)] * 5, [[1]] * 5, [[]] * 5, [0] * 5, "cpu")
    assert state.prompt_ids is None and state.output_ids is None  # nothing built for nothing
    assert torch.equal(Sampler()(logits, state).token_ids, logits.argmax(-1))


def test_top_p_zero_samples_the_most_likely_token() -> None:
    """OpenAI accepts top_p = 0: the smallest nucleus, the top token alone (ties kept)."""
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=1.5, top_p=0.0, seed=s) for s in range(6)]
    state = make_batch(params, [[1]] * 6, [[]] * 6, [0] * 6, "cpu")
    assert torch.equal(Sampler()(logits, state).token_ids, logits.argmax(-1))


def test_token_tensors_out_of_range_ids_and_tiny_temperature() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=1e-6, repetition_penalty=3.0)  # under 1e-5: greedy
    top = logits.argmax(-1).tolist()
    state = make_batch([p, p], [torch.tensor([top[0]]), [top[1]]], [[], []], [0, 0], "cpu")
    want = _reference_penalties(logits, [p, p], [[top[0]], [top[1]]], [[], []])
    assert p.greedy and torch.equal(Sampler()(logits, state).token_ids, want.argmax(-1))
    # Ids outside [0, V) count as padding instead of failing inside a device kernel.
    odd = make_batch([p, p], [[30, 99], [-5]], [[31], []], [0, 0], "cpu")
    assert torch.equal(Sampler()(logits, odd).token_ids, logits.argmax(-1))


# ---------------------------------------------------------------- seeds


def _mixed_requests(vocab: int) -> tuple[list[SamplingParams], list, list]:
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(),
        SamplingParams(seed=77, top_k=10),
        SamplingParams(top_p=0.8, logprobs=5),
        SamplingParams(seed=3, min_p=0.1, repetition_penalty=1.2),
        SamplingParams(temperature=0.5, frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=2),
        SamplingParams(seed=5, temperature=1.3, top_k=50, top_p=0.95),
    ]
    params = [kinds[i % len(kinds)] for i in range(31)]
    prompts = [[(i * 7 + j) % vocab for j in range(i + 1)] for i in range(31)]
    outputs = [[(i * 5 + j) % vocab for j in range(i % 6)] for i in range(31)]
    return params, prompts, outputs


TARGETS = [
    SamplingParams(seed=1234),
    SamplingParams(seed=1234, temperature=0.7, top_p=0.9),
    SamplingParams(seed=99, top_k=40, min_p=0.02),
    SamplingParams(seed=7, repetition_penalty=1.3, frequency_penalty=0.4, logprobs=3),
]


def _batch_invariance(device: str) -> None:
    vocab, sampler = 256, Sampler()
    gen = torch.Generator().manual_seed(8)
    others, o_prompts, o_outputs = _mixed_requests(vocab)
    prompt, output = [3, 4, 5, 9, 9], [4, 4, 11]
    for target in TARGETS:
        for step in range(2):
            row = (torch.randn(1, vocab, generator=gen) * 2).to(device)
            rest = (torch.randn(32, vocab, generator=gen) * 2).to(device)
            alone = make_batch([target], [prompt], [output], [step], device)
            want = sampler(row, alone).token_ids.item()
            for pos in range(32):
                params = others[:pos] + [target] + others[pos:]
                prompts = o_prompts[:pos] + [prompt] + o_prompts[pos:]
                outputs = o_outputs[:pos] + [output] + o_outputs[pos:]
                logits = torch.cat([rest[:pos], row, rest[pos + 1 :]])
                steps = [step if i == pos else i for i in range(32)]
                state = make_batch(params, prompts, outputs, steps, device)
                assert sampler(logits, state).token_ids[pos].item() == want, (target, step, pos)


def test_seeded_request_is_batch_invariant_at_every_row() -> None:
    _batch_invariance("cpu")


def test_different_seeds_differ_and_unseeded_rows_vary() -> None:
    vocab = 1000
    logits = torch.zeros(64, vocab)
    seeded = make_batch([SamplingParams(seed=s) for s in range(64)], [[0]] * 64, [[]] * 64,
                        [0] * 64, "cpu")  # fmt: skip
    ids = Sampler()(logits, seeded).token_ids
    assert len(set(ids.tolist())) > 55  # 64 draws from 1000 equally likely tokens
    assert torch.equal(Sampler()(logits, seeded).token_ids, ids)  # and they reproduce
    one = make_batch([SamplingParams()], [[0]], [[]], [0], "cpu")
    free = Sampler()
    draws = {free(logits[:1], one).token_ids.item() for _ in range(20)}
    assert len(draws) > 15
    a, b = Sampler(seed=4), Sampler(seed=4)
    assert [a(logits[:1], one).token_ids.item() for _ in range(5)] == [
        b(logits[:1], one).token_ids.item() for _ in range(5)
    ]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_at_sampled_and_top() -> None:
    vocab = 300
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=gen) * 2
    params = [
        SamplingParams(temperature=2.0, logprobs=0, seed=1),
        SamplingParams(temperature=2.0, logprobs=1, seed=2, repetition_penalty=1.8),
        SamplingParams(temperature=0.5, top_k=4, logprobs=20),
        SamplingParams(temperature=0, logprobs=3, presence_penalty=2.0),
        SamplingParams(temperature=1.7, top_p=0.99, logprobs=5),
        SamplingParams(logprobs=None),
    ]
    prompts, outputs = [[int(logits[i].argmax())] for i in range(6)], [[1, 2, 2]] * 6
    state = make_batch(params, prompts, outputs, [3] * 6, "cpu")
    out = Sampler(seed=0)(logits, state)
    ref = torch.log_softmax(logits, -1)
    assert torch.equal(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (6, 20)
    top = ref.sort(-1, descending=True)
    assert torch.equal(out.top_logprobs, top.values[:, :20])
    assert torch.equal(ref.gather(1, out.top_ids), out.top_logprobs)
    # Rows 0-1 sample at temperature 2: their tokens fall outside top-1, yet carry a logprob.
    assert (out.token_ids[:2] != out.top_ids[:2, 0]).any()
    none = make_batch([SamplingParams()], [[1]], [[]], [0], "cpu")
    assert Sampler()(logits[:1], none).logprobs is None


# ---------------------------------------------------------------- the old single-row helper


def test_sample_next_keeps_its_contract() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next(logits, 0.0), logits.argmax(-1))
    a = sample_next(logits, 1.0, torch.Generator().manual_seed(1))
    assert torch.equal(a, sample_next(logits, 1.0, torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0)


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_cuda_matches_cpu_bits_is_batch_invariant_and_never_syncs() -> None:
    keys = torch.tensor([stream_key(s, t) for s in range(4) for t in range(4)])
    assert torch.equal(uniform(keys.cuda(), 4096).cpu(), uniform(keys, 4096))
    _batch_invariance("cuda")
    params, prompts, outputs = _mixed_requests(1000)
    state = make_batch(params, prompts, outputs, list(range(31)), "cuda")
    logits = torch.randn(31, 1000, device="cuda")
    sampler = Sampler()
    sampler(logits, state)  # first call creates the generator (which may sync)
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the call raises
    try:
        out = sampler(logits, state)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.shape == (31,) and out.top_ids.shape == (31, 5)
