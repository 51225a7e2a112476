"""The sampler draws from the distribution its parameters define: sampled tokens stay inside
the top-k / top-p / min-p set computed per row in float64, and empirical frequencies over many
seeded draws match the target distribution (chi-square).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from hetero.sampler import Sampler, make_batch
from hetero.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- truncation


def _allowed(row: torch.Tensor, p: SamplingParams, slack: float) -> torch.Tensor:
    """bool [V]: the tokens p may sample from this logits row (float64, per row, sorted walk).

    slack > 0 widens each cut a little so that float32 rounding cannot make a legal token fail.
    """
    x = row.double() / p.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if p.top_k > 0:
        keep &= x >= x.sort(descending=True).values[min(p.top_k, x.numel()) - 1] - slack
    if p.top_p < 1:
        probs = torch.softmax(x.masked_fill(~keep, -math.inf), -1)
        mass, cut = 0.0, 1.0
        for i in probs.argsort(descending=True).tolist():
            if mass >= p.top_p + slack:
                break
            cut, mass = probs[i].item(), mass + probs[i].item()
        keep &= probs >= cut * (1 - slack)
    if p.min_p > 0:
        probs = torch.softmax(x, -1)
        keep &= probs >= p.min_p * probs.max() * (1 - slack)
    return keep


TRUNCATIONS = [
    SamplingParams(top_k=3),
    SamplingParams(temperature=0.6, top_p=0.5),
    SamplingParams(temperature=1.4, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(top_k=1),
    SamplingParams(top_k=100000, top_p=0.3),
]


def test_sampled_tokens_stay_inside_the_allowed_set() -> None:
    vocab, draws = 64, 200
    gen = torch.Generator().manual_seed(5)
    sampler = Sampler(seed=0)
    for p in TRUNCATIONS:
        for seeded in (True, False):
            q = replace(p, seed=9 if seeded else None)
            row = torch.randn(vocab, generator=gen) * 2
            allowed = _allowed(row, q, slack=1e-5)
            # one request at `draws` different steps, as one batch: a row per step
            state = make_batch([q] * draws, [[0]] * draws, [[]] * draws, range(draws), "cpu")
            ids = sampler(row.expand(draws, vocab), state).token_ids
            assert allowed[ids].all(), (q, sorted(set(ids.tolist())))
            if allowed.sum() > 1:
                assert len(set(ids.tolist())) > 1  # it samples, not a constant


PROBS = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.03, 0.02], dtype=torch.float64)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(min_p=0.3),
        SamplingParams(temperature=1.5, top_k=6, top_p=0.9, min_p=0.1),
        SamplingParams(top_k=4, top_p=0.8),  # top-p renormalised after top-k keeps 3, not 4
    ],
)
@pytest.mark.parametrize("seeded", [True, False])
def test_empirical_distribution_matches_target(params: SamplingParams, seeded: bool) -> None:
    n = 20000
    logits = PROBS.log().float()
    # Rows alternate with a contrasting request, so a parameter read from the wrong row shows.
    contrast = SamplingParams(temperature=2.5, seed=77 if seeded else None)
    # Seeded: one request's n successive steps. Unseeded: rows of the sampler's own stream.
    row = replace(params, seed=2024 if seeded else None)
    rows = [row, contrast] * (n // 2)
    state = make_batch(rows, [[0]] * n, [[]] * n, [i // 2 for i in range(n)], "cpu")
    ids = Sampler(seed=1)(logits.expand(n, -1), state).token_ids
    for p, got in ((params, ids[0::2]), (contrast, ids[1::2])):
        keep = _allowed(logits, p, slack=0.0)
        target = torch.softmax(logits.double() / p.temperature, -1) * keep
        target /= target.sum()
        freq = torch.bincount(got, minlength=PROBS.numel()).double() / got.numel()
        assert freq[~keep].sum() == 0
        # Deterministic (seeded), so it cannot flake. TV's mean here is ~0.01; chi-square
        # has at most 7 degrees of freedom, and 30 is its 1e-4 tail.
        assert 0.5 * (freq - target).abs().sum() < 0.03, (p, freq, target)
        assert got.numel() * ((freq - target)[keep] ** 2 / target[keep]).sum() < 30
