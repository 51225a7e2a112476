"""KV cache groups (engine/kv_groups.py) and the prefix hit over them (engine/prefix_match.py):
which layers share a table and a pool slot, and how long a hit every group can take is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hetero.engine.kv_groups import KVGroups, blocks_needed, first_needed, group_name
from hetero.engine.prefix_match import match_prefix


def config(windows: list[int]):
    return SimpleNamespace(n_layers=len(windows), layer_window=lambda i: windows[i])


def test_groups_of_gpt_oss_and_of_a_dense_model() -> None:
    gpt_oss = KVGroups.of(config([128, 0] * 12))  # every other layer from the first
    assert gpt_oss.windows == (0, 128) and gpt_oss.windowed
    assert gpt_oss.layer_group[:4] == (1, 0, 1, 0)
    assert gpt_oss.slots(range(24)) == ([i // 2 for i in range(24)], 12)  # half the layers
    assert gpt_oss.slots(range(13, 24)) == ([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5], 6)
    dense = KVGroups.of(config([0] * 5))
    assert dense.windows == (0,) and not dense.windowed
    assert dense.slots(range(2, 5)) == ([0, 1, 2], 3)  # as before: a slot a layer
    tiny = KVGroups.of(config([6, 0, 6]))  # uneven: the larger group sets the slots
    assert tiny.slots(range(3)) == ([0, 0, 1], 2)


def test_names_and_window_arithmetic() -> None:
    name = bytes(range(32))
    assert group_name(0, name) == name  # full attention keeps a dense model's names
    assert group_name(128, name) != name and group_name(128, name) != group_name(64, name)
    # the query at 40 sees 35 .. 40 (window 6): block 8 of 4 on
    assert first_needed(6, 40, 4) == 8 and first_needed(6, 3, 4) == 0
    assert first_needed(6, 40, 4, slack=8) == 6 and first_needed(0, 40, 4) == 0
    assert blocks_needed((0,), 100, 16, 4) == 25
    assert blocks_needed((0, 6), 100, 1, 4) == 25 + 3
    assert blocks_needed((0, 6), 8, 1, 4) == 2 + 2  # never more than the sequence's blocks


def locator(full: set[int], window: set[int], w: int, names: list[bytes], tier: str = ""):
    """locate() over runs whose full blocks (indices in `full`) and window blocks are cached;
    `tier`: say they are in that lower tier rather than on the device."""
    where = {}
    for i in full:
        where[group_name(0, names[i])] = tier or i
    for i in window:
        where[group_name(w, names[i])] = tier or 100 + i
    return where.get


NAMES = [bytes([i]) * 32 for i in range(12)]


@pytest.mark.parametrize(
    ("full", "window", "hit"),
    [
        (range(12), range(12), 12),
        (range(5), range(12), 5),  # the full chain ends at its first miss
        (range(12), [8, 9], 10),  # the last window (K = 2 blocks of 4 for window 6) ends at 10
        (range(12), [8, 9, 11], 10),  # 11 alone is no window: back to the run 8, 9
        (range(12), [3, 4, 9], 5),
        (range(12), [0], 1),  # shorter than K: every block from 0 on
        (range(12), [1, 2], 3),
        (range(12), [], 0),
    ],
)
def test_hit_ends_where_the_window_blocks_are(full, window, hit) -> None:
    got = match_prefix(iter(NAMES), (0, 6), 4, locator(set(full), set(window), 6, NAMES))
    assert got.n == hit
    taken = {(b.group, b.index) for b in got.blocks}
    assert taken == {(0, i) for i in range(hit)} | {(1, i) for i in range(max(0, hit - 2), hit)}


def test_two_windows_agree_and_lower_tiers_are_marked() -> None:
    where = locator(set(range(12)), {2, 3, 4, 5, 6, 7}, 6, NAMES)
    wide = {group_name(12, NAMES[i]): 200 + i for i in range(0, 5)}  # K = 3 for window 12

    def both(name):
        found = where(name)
        return wide.get(name) if found is None else found

    assert match_prefix(iter(NAMES), (0, 6, 12), 4, both).n == 5  # 8 for 6, then 5 for both
    lower = match_prefix(iter(NAMES), (0, 6), 4, locator({0, 1, 2}, {1, 2}, 6, NAMES, "ram"))
    assert lower.n == 3 and lower.in_tier("ram") == 5 and len(lower.lower) == 5


def test_a_model_of_windows_only_hits_on_its_window_alone() -> None:
    got = match_prefix(iter(NAMES), (6,), 4, locator(set(), {6, 7}, 6, NAMES))
    assert got.n == 8 and [b.index for b in got.blocks] == [6, 7]
