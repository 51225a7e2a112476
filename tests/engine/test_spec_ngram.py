"""N-gram proposals and the per-request controller: pure Python, no model."""

from __future__ import annotations

import random

import pytest

from hetero.engine.spec.adapt import AdaptConfig, SpecState
from hetero.engine.spec.ngram import NgramCache, NgramIndex
from hetero.engine.spec.verify import accept_sampled


def brute_lookup(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: latest earlier occurrence of the longest suffix (n in max_n..min_n)."""
    for n in range(max_n, min_n - 1, -1):
        if len(ids) <= n:
            continue
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):  # occurrences ending before the last token
            if ids[start : start + n] == suffix:
                return ids[start + n : start + n + k]
    return []


def test_index_matches_brute_force_as_the_sequence_grows():
    rng = random.Random(0)
    ids = [rng.randrange(6) for _ in range(40)]  # a small alphabet: many repeats
    index = NgramIndex(2, 4)
    for length in range(1, len(ids) + 1):
        seq = ids[:length]
        index.extend(seq)
        assert index.lookup(seq, 5, 2) == brute_lookup(seq, 5, 2, 4), length
    # extending by several tokens at once (a step that accepted guesses) indexes the same
    bulk = NgramIndex(2, 4)
    bulk.extend(ids[:10])
    bulk.extend(ids)
    assert bulk.maps == index.maps


def test_index_prefers_the_longest_match_and_respects_min_n():
    seq = [1, 2, 3, 9, 9, 5, 3, 7, 8, 2, 3]  # "2 3" follows by 9; "3" alone (n=1) by 7
    index = NgramIndex(1, 3)
    index.extend(seq)
    assert index.lookup(seq, 3, 2) == [9, 9, 5]
    assert index.lookup(seq + [4], 3, 1) == []  # "3 4" / "4" never occurred
    assert index.lookup(seq + [9], 2, 1) == [9, 5]  # "2 3 9" occurred once, then 9 5
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(3, 2)


def test_cache_learns_across_sequences_and_stays_bounded():
    cache = NgramCache(2, 3, width=4, capacity=50)
    cache.add([10, 11, 12, 13, 14, 15, 16])
    assert cache.lookup([99, 11, 12], 4, 2) == [13, 14, 15, 16]
    assert cache.lookup([99, 12], 4, 2) == []  # n=1 is below min_n
    for s in range(20):  # flood with other grams: the old ones are evicted, size stays bounded
        cache.add(list(range(100 + 10 * s, 110 + 10 * s)))
    assert len(cache) <= 50
    assert cache.lookup([99, 11, 12], 4, 2) == []


def test_cache_keeps_the_latest_unindexed_sequences_only():
    """Sequences are indexed at the next lookup (nothing is spent while nobody guesses); until
    then only the latest `pending` are kept."""
    cache = NgramCache(2, 3, width=4, capacity=1000, pending=2)
    for s in range(3):
        cache.add([50 + s, 60 + s, 70 + s, 80 + s])
    assert cache.lookup([1, 50, 60], 4, 2) == []  # the first fell out before it was indexed
    assert cache.lookup([1, 51, 61], 4, 2) == [71, 81]
    assert cache.lookup([1, 52, 62], 4, 2) == [72, 82]
    cache.add([90, 91, 92])  # indexed by len() as well
    assert len(cache) > 0 and cache.lookup([90, 91], 4, 2) == [92]


def test_accept_takes_samples_up_to_the_first_mismatch():
    assert accept_sampled([5], []) == [5]
    assert accept_sampled([1, 2, 3], [1, 2]) == [1, 2, 3]  # all accepted + the bonus token
    assert accept_sampled([1, 7, 3], [1, 2]) == [1, 7]  # 2 rejected: the target's 7 instead
    assert accept_sampled([4, 2, 3], [1, 2]) == [4]
    with pytest.raises(ValueError):
        accept_sampled([1, 2], [1, 2])


def test_k_grows_on_success_and_shrinks_on_rejection():
    s = SpecState(AdaptConfig(k_max=8))
    k0 = s.k
    s.observe(k0, k0)
    assert s.k == min(8, k0 + 2)
    s.observe(s.k, 1)
    assert s.k == 2  # accepted + 1
    s.observe(0, 0)  # a step without guesses changes nothing but the step count
    assert s.k == 2 and s.steps == 3


def test_off_switch_trips_backs_off_and_reprobes():
    cfg = AdaptConfig(k_max=4, probe_rounds=4, backoff=5, max_backoff=20)
    s = SpecState(cfg)
    for _ in range(20):
        if not s.active:
            break
        s.observe(s.k, 0)
    assert not s.active, "all guesses rejected: speculation must switch off"
    assert s.min_n == cfg.min_n  # reset for the next probe
    off_for = s.off_until - s.steps
    assert off_for == 5
    for _ in range(off_for):
        s.observe(0, 0)
    assert s.active, "after the backoff it probes again"
    for _ in range(20):
        if not s.active:
            break
        s.observe(s.k, 0)
    assert s.off_until - s.steps == 10  # backoff doubled


def test_poor_acceptance_asks_for_longer_matches():
    s = SpecState(AdaptConfig(k_max=8, min_n=2, max_n=4, off_below=0.0))
    assert s.min_n == 2
    for _ in range(3):
        s.observe(4, 0)
    assert s.min_n == 3
    for _ in range(6):
        s.observe(4, 4)
    assert s.min_n == 2


def test_min_gain_switches_off_guesses_that_do_not_pay_for_the_step():
    """A request accepting one guess in three (a 33% rate, above off_below) averages 0.33
    accepted tokens a step: where a verify step costs 1.6 plain ones (min_gain 0.6) it stops;
    with min_gain 0 (a CPU) it keeps guessing; one that accepts 1 of 2 a step keeps guessing."""
    for min_gain, accepted, stays in ((0.6, (0, 1, 0), False), (0.0, (0, 1, 0), True),
                                      (0.6, (1, 1, 1), True)):  # fmt: skip
        s = SpecState(AdaptConfig(k_max=8, min_gain=min_gain, off_below=0.15))
        for i in range(12):
            if not s.active:
                break
            s.observe(1 if accepted == (0, 1, 0) else 2, accepted[i % 3])
        assert s.active == stays, (min_gain, accepted)


def test_fit_rows_keeps_guesses_within_the_room_left():
    from hetero.engine.spec.speculator import fit_rows

    g = {"a": [1, 2, 3], "b": [4, 5], "c": [6]}
    assert fit_rows(g, 10) == g
    assert fit_rows(g, 4) == {"a": [1, 2, 3], "b": [4]}
    assert fit_rows(g, 0) == {}


def test_k_min_keeps_guesses_long_after_a_rejection():
    """Where rows cost the same up to the graph bucket (CUDA), a rejection does not shrink k."""
    s = SpecState(AdaptConfig(k_max=8, k_min=8))
    assert s.k == 8
    s.observe(8, 1)
    assert s.k == 8
    s = SpecState(AdaptConfig(k_max=8, k_min=3))
    s.observe(s.k, 0)
    assert s.k == 3
