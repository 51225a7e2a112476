"""Block manager: copy-on-write forks (n choices), and random operation sequences over a small
pool that must keep every invariant and read back each request's own tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero.engine.request import Request
from tests.support.block_sim import CheckedBlockManager, SimKV, compute, prefill, snapshot


def test_fork_copy_on_write_at_partial_block() -> None:
    bm = CheckedBlockManager(8, 4)
    kv = SimKV(bm)
    parent = Request("p", list(range(10)))
    prefill(bm, parent, kv)  # blocks: 4 + 4 + 2 (partial)
    parent.output_ids.append(77)
    child = Request("c", list(range(10)))
    child.output_ids.append(88)  # another sample from the same logits
    free_before = bm.num_free_blocks
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and child.num_computed_tokens == 10
    assert bm.num_free_blocks == free_before and all(
        bm.ref_count(b) == 2 for b in child.block_table
    )
    partial = parent.block_table[2]
    compute(bm, kv, child, 1)  # first write into the shared partial block copies it
    assert child.block_table[2] != partial and parent.block_table[2] == partial
    assert bm.ref_count(partial) == 1 and bm.ref_count(child.block_table[0]) == 2
    assert bm.take_copies() == []  # compute() took the copy
    compute(bm, kv, parent, 1)  # the parent is alone on it now: no copy
    assert parent.block_table[2] == partial
    assert kv.read(parent, 11)[-1] == 77 and kv.read(child, 11)[-1] == 88
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_fork_copy_recorded_and_dropped_with_its_request() -> None:
    bm = CheckedBlockManager(8, 4)
    parent = Request("p", list(range(6)))
    prefill(bm, parent)
    parent.output_ids.append(1)
    child = Request("c", list(range(6)) + [2])
    bm.fork(parent, child)
    assert bm.append_slots(child, 1)
    ((src, dst),) = bm._copies
    assert src == parent.block_table[1] and dst == child.block_table[1]
    bm.free(child)  # a copy into a block nobody holds is moot
    assert bm.take_copies() == []


def test_fork_at_block_boundary_copies_nothing() -> None:
    bm = CheckedBlockManager(8, 4)
    parent = Request("p", list(range(8)))
    prefill(bm, parent)
    child = Request("c", list(range(8)) + [5])
    parent.output_ids.append(4)
    bm.fork(parent, child)
    assert bm.append_slots(child, 1) and bm.take_copies() == []
    assert len(child.block_table) == 3 and child.block_table[:2] == parent.block_table


def test_copy_on_write_needs_a_free_block() -> None:
    bm = CheckedBlockManager(3, 4)
    parent = Request("p", list(range(6)))
    prefill(bm, parent)
    parent.output_ids.append(1)
    child = Request("c", list(range(6)) + [2])
    bm.fork(parent, child)
    filler = Request("f", [9])
    assert bm.allocate(filler)
    before = snapshot(bm, parent, child)
    assert not bm.append_slots(child, 1)
    assert snapshot(bm, parent, child) == before


def test_fork_rejects_a_child_that_disagrees() -> None:
    bm = CheckedBlockManager(8, 4)
    parent = Request("p", list(range(6)))
    prefill(bm, parent)
    with pytest.raises(ValueError, match="extend"):
        bm.fork(parent, Request("c", [0, 1, 2, 3, 4, 9, 9]))
    with pytest.raises(ValueError, match="extend"):
        bm.fork(parent, Request("c", list(range(6))))  # nothing left to compute
    with pytest.raises(ValueError, match="holds no KV"):
        bm.fork(Request("x", [1, 2]), Request("y", [1, 2, 3]))


# -- property: random allocate / compute / fork / free over a small pool ----------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["new", "new", "compute", "compute", "compute", "fork", "fork", "free", "free"]
        ),
        st.integers(0, 50),
        st.integers(1, 12),
    ),
    min_size=5,
    max_size=60,
)


@settings(max_examples=120, deadline=None)
@given(num_blocks=st.integers(2, 24), block_size=st.integers(1, 4), ops=OPS)
def test_random_operations_keep_invariants(num_blocks: int, block_size: int, ops) -> None:
    bm = CheckedBlockManager(num_blocks, block_size)
    kv, live, counter = SimKV(bm), [], 0
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6]]

    def run(req: Request, n: int) -> None:  # one model step over n tokens, if they fit
        if bm.append_slots(req, n):
            kv.copy_blocks(bm.take_copies())
            kv.write(req, req.num_computed_tokens, n)
            req.num_computed_tokens += n
            bm.commit(req)

    for op, pick, length in ops:
        counter += 1
        if op == "new":
            tokens = prefixes[pick % 3][:length] + [pick + 100] * (length % 5)
            req = Request(f"r{counter}", tokens or [pick])
            n = min(length, req.num_tokens - bm.cached_prefix_len(req))
            if bm.allocate(req, n):  # admitted with its first chunk, computed at once
                live.append(req)
                run(req, n)
        elif live and op == "compute":
            req = live[pick % len(live)]
            if req.num_computed_tokens == req.num_tokens:
                req.output_ids.append(pick)
            run(req, min(length, req.num_tokens - req.num_computed_tokens))
        elif live and op == "fork":
            parent = live[pick % len(live)]
            c = parent.num_computed_tokens
            child = Request(f"r{counter}", parent.tokens(0, c) + [length])
            bm.fork(parent, child)
            live.append(child)
        elif live and op == "free":
            bm.free(live.pop(pick % len(live)))
        for req in live:  # every live request reads its own tokens back
            end = req.num_computed_tokens
            assert kv.read(req, end) == req.tokens(0, end)
    for req in live:
        bm.free(req)
    assert bm.num_free_blocks == num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(num_blocks))
