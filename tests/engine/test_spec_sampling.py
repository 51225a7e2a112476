"""The acceptance rules keep the output distribution: chi-square tests on a 5-token vocabulary.

Fixed seeds and bounded sample counts (deterministic, so never flaky); the bound is the
chi-square critical value at alpha = 1e-3 for 4 degrees of freedom.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hetero.engine.spec.verify import accept_draft, accept_sampled, draft_rule, expand_rows
from hetero.rng import random_keys
from hetero.sampler import Sampler, make_batch
from hetero.sampling import SamplingParams
from hetero.sampling_filters import probabilities

V, CHI2_CRIT_DF4 = 5, 18.47
N = 20_000


def chi2(tokens: list[int], p: torch.Tensor) -> float:
    obs = torch.bincount(torch.tensor(tokens), minlength=V).double()
    exp = p.double() * len(tokens)
    return float(((obs - exp) ** 2 / exp).sum())


def test_ngram_rule_keeps_the_distribution_of_every_position():
    logits = torch.tensor([[1.0, 0.2, 1.5, -0.5, 0.3], [0.1, 2.0, -1.0, 0.5, 0.0]])
    guess = [2, 1]  # row 0 verifies 2, row 1 (seen after 2) verifies 1, row 2 is the bonus
    params = SamplingParams(temperature=0.8, max_tokens=10)
    reqs = [SimpleNamespace(prompt_ids=[0], output_ids=[3]) for _ in range(N)]
    rows = expand_rows(reqs, [guess] * N, [params] * N)
    state = make_batch(rows.params, rows.prompts, rows.outputs, rows.steps, "cpu")
    third = torch.tensor([[0.0, 0.0, 1.0, 0.0, -1.0]])
    batch = torch.cat([logits, third]).repeat(N, 1)  # [3N, V]
    sampled = Sampler(seed=1)(batch, state).token_ids.tolist()
    outs = [accept_sampled(sampled[3 * i : 3 * i + 3], guess) for i in range(N)]
    p = probabilities(
        torch.cat([logits, third]), make_batch([params] * 3, [[0]] * 3, [[3]] * 3, [1, 2, 3], "cpu")
    )
    assert chi2([o[0] for o in outs], p[0]) < CHI2_CRIT_DF4
    second = [o[1] for o in outs if len(o) > 1]  # only after the first guess was accepted
    assert abs(len(second) / N - float(p[0, 2])) < 4 * (p[0, 2] * (1 - p[0, 2]) / N) ** 0.5
    assert chi2(second, p[1]) < CHI2_CRIT_DF4
    rejected = [o[0] for o in outs if o[0] != 2]  # p without the guess, renormalized
    assert 2 not in rejected
    rest = p[0].clone()
    rest[2] = 0
    rest /= rest.sum()
    obs = torch.bincount(torch.tensor(rejected), minlength=V).double()
    mask = rest > 0
    stat = float(
        ((obs[mask] - rest[mask] * len(rejected)) ** 2 / (rest[mask] * len(rejected))).sum()
    )
    assert stat < 16.27  # 3 degrees of freedom, alpha = 1e-3


def test_draft_rule_keeps_the_distribution():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.4, 0.1, 0.3, 0.1], dtype=torch.float64)  # a poor draft
    gen = torch.Generator().manual_seed(3)
    guess = torch.multinomial(q.float(), N, replacement=True, generator=gen)
    keys = random_keys(N, gen, torch.device("cpu"))
    accepted, tokens = draft_rule(p.expand(N, V), q.expand(N, V), guess, keys)
    assert chi2(tokens.tolist(), p) < CHI2_CRIT_DF4
    rate = float(torch.minimum(p, q).sum())  # the known acceptance rate sum min(p, q)
    assert abs(accepted.double().mean().item() - rate) < 4 * (rate * (1 - rate) / N) ** 0.5
    same, _ = draft_rule(p.expand(N, V), p.expand(N, V), guess, keys)
    assert same.all(), "a draft equal to the target is always accepted"


def test_accept_draft_stops_at_the_first_rejection():
    assert accept_draft([4, 1, 2], [True, False, True], 9) == [4, 1]
    assert accept_draft([4, 1], [True, True], 9) == [4, 1, 9]
    assert accept_draft([], [], 9) == [9]
