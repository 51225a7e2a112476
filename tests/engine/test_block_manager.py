"""Block manager: allocation, prefix caching, LRU eviction, slot mapping, bad input.

Forks with copy-on-write and the random-operation property test are in
test_block_manager_forks.py; the checked manager and simulated KV pool in block_sim.py.
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from hetero.engine.block_manager import BlockManager
from hetero.engine.prefix_cache import _ROOT, block_hash
from hetero.engine.request import Request, RequestStatus
from tests.support.block_sim import CheckedBlockManager, SimKV, compute, prefill, snapshot


def test_allocate_and_free() -> None:
    bm = CheckedBlockManager(10, 4)
    req = Request("a", list(range(10)))
    assert bm.allocate(req)  # whole prompt: ceil(10 / 4) blocks
    assert len(req.block_table) == 3 and req.num_computed_tokens == 0
    assert bm.num_free_blocks == 7 and bm.usage == pytest.approx(0.3)
    assert all(bm.ref_count(b) == 1 for b in req.block_table)
    bm.free(req)
    assert req.block_table == [] and bm.num_free_blocks == 10 and bm.usage == 0.0
    bm.free(req)  # idempotent
    chunked = Request("b", list(range(20)))
    assert bm.allocate(chunked, 5)  # only the first chunk's blocks
    assert len(chunked.block_table) == 2


def test_exhaustion_changes_nothing() -> None:
    bm = CheckedBlockManager(4, 4)
    a, b = Request("a", list(range(12))), Request("b", list(range(100, 109)))
    assert bm.allocate(a)
    before = snapshot(bm, a, b)
    assert not bm.allocate(b)  # needs 3, 1 free
    assert not bm.append_slots(a, 24)  # positions 0..23: 3 more blocks
    assert snapshot(bm, a, b) == before
    assert bm.allocate(b, 4) and bm.num_free_blocks == 0


def test_exhaustion_with_parked_hits_changes_nothing() -> None:
    """A hit on a parked block uses up a free block too: counted before anything changes."""
    bm = CheckedBlockManager(4, 4)
    a = Request("a", list(range(9)))
    prefill(bm, a)  # 3 blocks, 2 of them full and named
    bm.free(a)
    filler = Request("f", list(range(50, 54)))
    assert bm.allocate(filler)  # takes the one unnamed free block
    b = Request("b", list(range(8)) + [7, 7, 7, 7, 7])  # hits both parked blocks, needs 2 more
    assert bm.cached_prefix_len(b) == 8
    before = snapshot(bm, b, filler)
    assert not bm.allocate(b)
    assert snapshot(bm, b, filler) == before and bm.num_cached_blocks == 2


def test_shared_system_prompt_hits() -> None:
    bm, system = CheckedBlockManager(32, 8), list(range(1000, 1032))  # 4 full blocks
    kv = SimKV(bm)
    a = Request("a", system + [1, 2, 3, 4, 5])
    prefill(bm, a, kv)
    b = Request("b", system + [9, 9])
    assert bm.cached_prefix_len(b) == 32
    assert bm.allocate(b)
    assert b.num_computed_tokens == 32 and b.num_cached_tokens == 32
    assert b.block_table[:4] == a.block_table[:4] and b.block_table[4] != a.block_table[4]
    assert all(bm.ref_count(x) == 2 for x in a.block_table[:4])
    compute(bm, kv, b, 2)  # reads the shared system prompt back through its own table


def test_hash_chains_the_prefix() -> None:
    bm = CheckedBlockManager(16, 4)
    a = Request("a", [1, 2, 3, 4, 7, 7, 7, 7, 5])
    prefill(bm, a)
    # the same second block after another first block is another block
    assert bm.cached_prefix_len(Request("b", [9, 2, 3, 4, 7, 7, 7, 7, 5])) == 0
    assert bm.cached_prefix_len(Request("c", [1, 2, 3, 4, 7, 7, 7, 8, 5])) == 4
    assert bm.cached_prefix_len(Request("d", [1, 2, 3, 4, 7, 7, 7, 7, 6])) == 8


def test_block_hash_is_sha256_of_little_endian_ids() -> None:
    tokens = [1, 70000, 2**40]
    expected = hashlib.sha256(_ROOT + struct.pack("<3q", *tokens)).digest()
    assert block_hash(None, tokens) == expected
    assert (
        block_hash(expected, tokens)
        == hashlib.sha256(expected + struct.pack("<3q", *tokens)).digest()
    )
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])


def test_chat_turn_two_extends_turn_one() -> None:
    bm = CheckedBlockManager(32, 4)
    kv = SimKV(bm)
    turn1 = Request("t1", list(range(1, 19)))  # 18 tokens
    prefill(bm, turn1, kv)
    for tok in (40, 41, 42, 43, 44):  # generated; the last one's KV is never computed
        turn1.output_ids.append(tok)
        if tok != 44:
            compute(bm, kv, turn1, 1)
    computed = turn1.num_computed_tokens  # 22 = 18 + 4
    old_table = list(turn1.block_table)
    bm.free(turn1)
    assert bm.num_cached_blocks == computed // 4
    turn2 = Request("t2", turn1.all_ids + [50, 51, 52, 53, 54, 55])
    assert bm.cached_prefix_len(turn2) == (computed // 4) * 4
    assert bm.allocate(turn2)
    assert turn2.block_table[: computed // 4] == old_table[: computed // 4]  # same blocks revived
    assert bm.num_cached_blocks == 0
    compute(bm, kv, turn2, turn2.num_tokens - turn2.num_computed_tokens)


def test_full_hit_backs_off_one_block() -> None:
    bm = CheckedBlockManager(16, 4)
    kv = SimKV(bm)
    a = Request("a", list(range(16)))
    prefill(bm, a, kv)
    a_table = list(a.block_table)
    b = Request("b", list(range(16)))
    assert bm.cached_prefix_len(b) == 12  # never the whole prompt: logits need a computed token
    assert bm.allocate(b)
    assert b.num_computed_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] != a.block_table[3]
    compute(bm, kv, b, 4)
    # b's last block duplicates a's: it stays unnamed, a's keeps the name (check() verifies)
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 4
    c = Request("c", list(range(16)) + [3])
    assert bm.allocate(c) and c.block_table[:4] == a_table


def test_lru_eviction_order() -> None:
    bm = CheckedBlockManager(6, 2)
    a, b = Request("a", [1, 2, 3, 4, 5]), Request("b", [6, 7, 8, 9, 10])
    prefill(bm, a)
    prefill(bm, b)
    a0, a1, _ = a.block_table
    b0, b1, _ = b.block_table
    bm.free(a)
    bm.free(b)  # parked, least recent first: a1 a0 b1 b0 (a request's tail first)
    assert bm._cache.parked_blocks() == [a1, a0, b1, b0]
    c = Request("c", [20, 21, 22, 23, 24, 25])
    assert bm.allocate(c)  # 3 blocks: the 2 unnamed free ones first, then evicts a1
    assert a1 in c.block_table and bm.num_cached_blocks == 3
    assert bm.cached_prefix_len(Request("a2", [1, 2, 3, 4, 5])) == 2  # a0 survived
    assert bm.cached_prefix_len(Request("b2", [6, 7, 8, 9, 10])) == 4
    # a hit revives a0 (out of the LRU); its new block evicts the next least recent, b1
    a3 = Request("a3", [1, 2, 0])
    assert bm.allocate(a3) and a3.block_table == [a0, b1]
    assert bm.cached_prefix_len(Request("b3", [6, 7, 8, 9, 10])) == 2  # b's prefix survived
    bm.free(a3)  # a0 parked again, now the most recent; b1 (unnamed now) is free
    assert bm._cache.parked_blocks() == [b0, a0]
    d = Request("d", [30, 31, 32, 33])
    assert bm.allocate(d) and d.block_table == [b1, b0]
    assert bm._cache.parked_blocks() == [a0]


def test_freed_cached_blocks_are_reused() -> None:
    bm = CheckedBlockManager(8, 4)
    a = Request("a", list(range(13)))
    prefill(bm, a)
    named = list(a.block_table[:3])
    bm.free(a)
    free_before = bm.num_free_blocks
    b = Request("b", list(range(13)))
    assert bm.allocate(b)
    assert b.block_table[:3] == named and b.num_cached_tokens == 12
    assert bm.num_free_blocks == free_before - 4 and bm.num_cached_blocks == 0
    assert all(bm.ref_count(x) == 1 for x in named)


def test_slot_mapping() -> None:
    bm = CheckedBlockManager(8, 4)
    filler, req = Request("f", list(range(5))), Request("a", list(range(10)))
    assert bm.allocate(filler) and bm.allocate(req)
    b0, b1, b2 = req.block_table
    assert bm.slot_mapping(req, 0, 10) == [b0 * 4 + i for i in range(4)] + [
        b1 * 4 + i for i in range(4)
    ] + [b2 * 4, b2 * 4 + 1]
    assert bm.slot_mapping(req, 5, 7) == [b1 * 4 + 1, b1 * 4 + 2]
    assert bm.slot_mapping(req, 3, 3) == []
    with pytest.raises(ValueError, match="outside"):
        bm.slot_mapping(req, 0, 13)
    with pytest.raises(ValueError, match="outside"):
        bm.slot_mapping(req, 4, 2)


def test_prefix_caching_disabled() -> None:
    bm = CheckedBlockManager(8, 4, enable_prefix_caching=False)
    a = Request("a", list(range(9)))
    prefill(bm, a)
    b = Request("b", list(range(9)))
    assert bm.cached_prefix_len(b) == 0 and bm.allocate(b) and b.num_computed_tokens == 0
    bm.free(a)
    assert bm.num_cached_blocks == 0


def test_preempted_request_keeps_its_first_cached_count() -> None:
    bm = CheckedBlockManager(8, 4)
    a = Request("a", list(range(9)))
    prefill(bm, a)
    a.output_ids.append(3)
    bm.free(a)  # preempted: recomputed later
    a.status = RequestStatus.PREEMPTED
    a.num_cached_tokens = 0
    assert bm.allocate(a) and a.num_computed_tokens == 8 and a.num_cached_tokens == 0


def test_reset_prefix_cache() -> None:
    bm = CheckedBlockManager(8, 4)
    a = Request("a", list(range(9)))
    prefill(bm, a)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    bm.check()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    assert bm.cached_prefix_len(Request("b", list(range(9)))) == 0


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    bm = CheckedBlockManager(8, 4)
    req = Request("a", list(range(5)))
    with pytest.raises(ValueError, match="holds no KV"):
        bm.append_slots(req, 1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate(req, 6)
    assert bm.allocate(req)
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate(req)
    with pytest.raises(ValueError, match=">= 0"):
        bm.append_slots(req, -1)
