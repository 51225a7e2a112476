"""Block manager with a sliding-window KV cache group (gpt-oss's layout, engine/kv_groups.py):
the window group holds only its window's blocks while the full group holds every block, prefix
hits take a window group's blocks only where they cover the hit's last window, forks and trims
keep both groups' tables. SimKV (block_sim.py) writes every group and reads each group's
positions back, so a block released too early, or shared wrongly, fails the read.
"""

from __future__ import annotations

import pytest

from hetero.engine.kv_groups import group_name
from hetero.engine.request import Request
from tests.support.block_sim import CheckedBlockManager, SimKV, compute, prefill

W, B = 6, 4  # window 6 over blocks of 4: a hit needs its last ceil(5 / 4) = 2 window blocks


def held(bm, table: list[int]) -> list[int]:
    return [b for b in table if b != bm.null_block]


def start(num_blocks: int, prompt: list[int], windows=(0, W)):
    """A checked manager with a window group, its simulated pool, and a prefilled request."""
    bm = CheckedBlockManager(num_blocks, B, windows=windows)
    kv = SimKV(bm)
    req = Request("a", prompt)
    prefill(bm, req, kv)
    return bm, kv, req


def decode(bm, kv, req: Request, n: int, first: int = 100) -> None:
    """n greedy-style steps: append a token, compute the one before it."""
    for i in range(n):
        req.output_ids.append(first + i)
        compute(bm, kv, req, 1)


def test_window_group_holds_only_its_window() -> None:
    bm, kv, req = start(64, list(range(10)))
    for i in range(40):  # past several windows
        decode(bm, kv, req, 1, first=100 + i)
        full, window = req.block_tables
        assert held(bm, full) == full and len(full) == bm.blocks_for(req.num_computed_tokens)
        # the window of the last block boundary (2 blocks) and the block written: 3 at most
        assert len(held(bm, window)) <= 3, window
    # the released window blocks were named when they filled: parked, not lost
    assert bm.num_cached_blocks >= bm.blocks_for(req.num_computed_tokens) - 3
    used = len(held(bm, req.block_tables[0])) + len(held(bm, req.block_tables[1]))
    assert bm.num_free_blocks == 64 - used
    bm.free(req)
    assert bm.num_free_blocks == 64


def test_a_prompt_chunk_holds_its_blocks_then_slides() -> None:
    bm = CheckedBlockManager(64, B, windows=(0, W))
    kv = SimKV(bm)
    req = Request("a", list(range(30)))
    assert bm.allocate(req, 20)  # a 20-token chunk: every group holds all 5 blocks
    assert [len(held(bm, t)) for t in req.block_tables] == [5, 5]
    compute(bm, kv, req, 20)
    compute(bm, kv, req, 10)  # from position 20 the window starts at 15: blocks 0-2 go
    assert req.block_tables[1][:3] == [bm.null_block] * 3
    assert len(held(bm, req.block_tables[1])) == 5  # blocks 3 .. 7 (positions 12 .. 31)
    # a step of 10 from 4k + 3 holds window blocks k - 2 .. k + 3 (positions 4k - 5 ..): 6
    assert bm.blocks_needed(30, 10) == 8 + 6


def test_hit_takes_the_window_blocks_of_its_end() -> None:
    bm = CheckedBlockManager(64, B, windows=(0, W))
    kv = SimKV(bm)
    a = Request("a", list(range(24)))
    prefill(bm, a, kv)  # one chunk: every window block named, none released
    a_full, a_window = (list(t) for t in a.block_tables)
    bm.free(a)
    b = Request("b", list(range(24)) + [99] * 5)
    assert bm.cached_prefix_len(b) == 24
    assert bm.allocate(b)
    full, window = b.block_tables
    assert full[:6] == a_full[:6]
    assert window[:6] == [bm.null_block] * 4 + a_window[4:6]  # only the hit's last window
    compute(bm, kv, b, 5)  # reads its window through the revived blocks


def test_hit_shrinks_to_where_the_window_blocks_remain() -> None:
    """A's window blocks released while it ran are parked first, so evicted first: a hit at
    the end of its prompt loses its window and takes none; one at the end of its computed
    tokens (the next chat turn) still finds the window blocks A held to the end (those of its
    last block boundary's window)."""
    bm, kv, a = start(24, list(range(24)))
    decode(bm, kv, a, 10)  # 34 computed: window blocks 0 .. 5 released (and parked) on the way
    released = bm._cache.parked_blocks()
    assert len(released) == 6 and len(held(bm, a.block_tables[1])) == 3  # 6, 7, 8 are held
    assert all(bm._cache.hash_of(b) is not None for b in released)
    turn2 = Request("t", a.all_ids[:32] + [7, 7])
    prompt_again = Request("p", list(range(24)) + [5, 5])
    assert bm.cached_prefix_len(prompt_again) == 24  # a parked window, still there
    bm.free(a)
    filler = Request("f", [1000 + i for i in range(4 * 7)])
    # 2 x 7 blocks: the 8 free ones (6, and a's partial last blocks: unnamed), then the 6
    # released first
    assert bm.allocate(filler)
    assert all(b not in bm._cache.parked_blocks() for b in released)
    assert bm.cached_prefix_len(prompt_again) == 0  # full blocks 0 .. 5 alone are no hit
    assert bm.cached_prefix_len(turn2) == 32
    bm.free(filler)
    assert bm.allocate(turn2)
    compute(bm, kv, turn2, 2)


def test_fork_shares_both_groups_and_copies_their_partial_blocks() -> None:
    bm, kv, parent = start(32, list(range(14)))
    decode(bm, kv, parent, 1)  # 15 computed: window block 0 released
    parent.output_ids.append(77)
    child = Request("c", parent.all_ids[:-1] + [88])
    bm.fork(parent, child)
    assert child.block_tables == parent.block_tables
    nulls = child.block_tables[1].count(bm.null_block)
    assert nulls == 1
    compute(bm, kv, child, 1)  # writes into the shared partial block of each group: 2 copies
    assert child.block_tables[0][-1] != parent.block_tables[0][-1]
    assert child.block_tables[1][-1] != parent.block_tables[1][-1]
    assert child.block_tables[1].count(bm.null_block) >= nulls
    compute(bm, kv, parent, 1)
    assert kv.read(parent, 16)[-1] == 77 and kv.read(child, 16)[-1] == 88


def test_trim_drops_rejected_guesses_in_every_group() -> None:
    bm, kv, req = start(32, list(range(13)))
    req.output_ids.append(50)
    assert bm.append_slots(req, 1 + 6)  # a decode and 6 guesses: positions 13 .. 19
    assert [len(t) for t in req.block_tables] == [5, 5]
    bm.trim(req, req.num_tokens)  # none accepted
    assert [len(t) for t in req.block_tables] == [4, 4]
    compute(bm, kv, req, 1)


def test_capacity_counts_every_group() -> None:
    bm = CheckedBlockManager(20, B, windows=(0, 8))
    # steps of 4 from 4k + 3: window blocks k - 2 .. k + 1 (positions 4k - 7 .. 4k + 6)
    assert bm.blocks_needed(64, 4) == 16 + 4 and bm.blocks_needed(8, 4) == 2 + 2
    assert bm.max_tokens(4, 10_000) == 64
    assert CheckedBlockManager(20, B).max_tokens(4, 10_000) == 80  # dense: the whole pool


def test_window_blocks_are_named_apart_from_full_ones() -> None:
    bm = CheckedBlockManager(16, B, windows=(0, W))
    a = Request("a", list(range(9)))
    prefill(bm, a)
    name = bm._hashes["a"][0]
    assert bm._cache.hash_of(a.block_tables[0][0]) == name == group_name(0, name)
    assert bm._cache.hash_of(a.block_tables[1][0]) == group_name(W, name) != name


@pytest.mark.parametrize("windows", [(0, 1), (0, 4), (0, 5), (0, 9), (3,)])
def test_windows_of_any_size_read_back(windows) -> None:
    """Windows shorter than a block, a block, between blocks, and a model of windows only."""
    bm, kv, req = start(64, list(range(7)), windows)
    decode(bm, kv, req, 25)
    again = Request("b", req.all_ids[:24] + [3])
    bm.free(req)
    assert bm.allocate(again)
    compute(bm, kv, again, again.num_tokens - again.num_computed_tokens)
