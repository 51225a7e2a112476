"""logit_bias, min_tokens and the packed allowed-token masks in the batched sampler: each row
gets its own, beside rows that have none, greedy and sampled alike."""

from __future__ import annotations

import math

import pytest
import torch

from hetero.sampler import Sampler, make_batch
from hetero.sampling import SamplingParams
from hetero.sampling_filters import probabilities, unpack_allowed, unpack_on_device

pytestmark = pytest.mark.usefixtures("one_torch_thread")
V = 100
EOS = (3, 7)


def pack(rows: torch.Tensor) -> torch.Tensor:
    """[B, V] bool -> [B, ceil(V / 32)] int32, bit j of word i for token 32 i + j."""
    b, v = rows.shape
    padded = torch.zeros(b, -(-v // 32) * 32, dtype=torch.int64)
    padded[:, :v] = rows.long()
    words = (padded.view(b, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def sample(params, logits, steps=None, allowed=None):
    n = len(params)
    state = make_batch(params, [[1]] * n, [[]] * n, steps or [0] * n, "cpu", allowed, EOS)
    return Sampler(0)(logits, state).token_ids.tolist(), state


def test_logit_bias_moves_greedy_choices_of_its_row_only():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0, logit_bias={top[0]: -100}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={42: 100}),
    ]
    ids, _ = sample(params, logits)
    second = logits[0].topk(2).indices[1].item()
    assert ids == [second, top[1], 42]
    assert sample([params[1]], logits[1:2].clone())[0] == [top[1]]  # alone: the same


def test_logit_bias_shifts_the_sampled_distribution_by_its_value():
    logits = torch.zeros(1, V)
    state = make_batch([SamplingParams(logit_bias={5: math.log(9.0)})], [[1]], [[]], [0], "cpu")
    p = probabilities(logits, state)[0]
    assert p[5].item() == pytest.approx(9 / (V - 1 + 9), rel=1e-5)  # e^bias times as likely


def test_min_tokens_holds_end_and_stop_tokens_back_until_it_is_reached():
    logits = torch.full((4, V), -5.0)
    logits[:, EOS[0]] = 5.0  # every row would end now
    logits[:, 11] = 4.0  # ... or take 11, which row 3 names as a stop token
    logits[:, 12] = 3.0
    p = [
        SamplingParams(temperature=0, min_tokens=2),
        SamplingParams(temperature=0, min_tokens=2),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[11]),
    ]
    ids, _ = sample(p, logits, steps=[1, 2, 0, 0])
    assert ids == [11, EOS[0], EOS[0], 12]  # row 1 has its 2 tokens; row 2 has no minimum
    logits[:, EOS[1]] = 6.0
    assert sample(p[:1], logits[:1].clone())[0] == [11]  # every end token is held back


def test_packed_masks_meet_bias_and_sampling():
    g = torch.Generator().manual_seed(1)
    allowed = torch.rand(3, V, generator=g) < 0.1
    allowed[:, 50] = True
    logits = torch.randn(3, V, generator=g)
    bias = {50: -100}
    params = [
        SamplingParams(temperature=0, logit_bias=bias),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.7, top_k=3, seed=4),
    ]
    bits = pack(allowed)
    assert torch.equal(unpack_allowed(bits, V), allowed)
    assert torch.equal(unpack_on_device(bits, V), allowed)
    for _ in range(20):
        ids, state = sample(params, logits, allowed=bits)
        assert all(allowed[i, t] for i, t in enumerate(ids))
        assert ids[0] != 50  # -100 on an allowed token: another allowed token wins
    masked = logits.masked_fill(~allowed, -math.inf)
    masked[0, 50] -= 100
    assert ids[0] == masked[0].argmax().item()


def test_logprobs_stay_raw_under_bias():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=0, logprobs=2, logit_bias={9: 100})
    state = make_batch([p], [[1]], [[]], [0], "cpu")
    out = Sampler()(logits, state)
    assert out.token_ids.item() == 9
    assert out.logprobs.item() == pytest.approx(logits.log_softmax(-1)[0, 9].item(), abs=1e-6)


@pytest.mark.gpu
def test_on_device_bias_and_masks_never_sync():
    allowed = torch.rand(4, V) < 0.2
    allowed[:, 1] = True
    bits = pack(allowed)
    assert torch.equal(unpack_allowed(bits.cuda(), V).cpu(), allowed)
    params = [SamplingParams(temperature=0, min_tokens=3, logit_bias={1: 5.0})] * 4
    state = make_batch(params, [[1]] * 4, [[]] * 4, [0] * 4, "cuda", bits, EOS)
    logits = torch.randn(4, V, device="cuda")
    sampler = Sampler()
    sampler(logits, state)
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = sampler(logits, state).token_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(allowed[i, t] for i, t in enumerate(ids.tolist()))
