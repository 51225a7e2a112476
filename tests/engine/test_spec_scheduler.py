"""Speculative steps in the scheduler and block manager, on test_scheduler's simulated engine.

Each decoding request gets guesses that are right for a random number of tokens and then wrong;
the simulated model scores every guess row from the KV it reads back through the block table, so
outputs match the plain reference only if guess slots were reserved, written, read, and rolled
back (rejected KV dropped, blocks past the accepted length freed, no name for an unaccepted
block) correctly, under preemption, prefix hits and chunked prefill.
"""

from __future__ import annotations

import random

from hetero.engine.config import SchedulerConfig
from hetero.engine.request import Request
from hetero.engine.spec.verify import accept_sampled
from tests.engine.test_scheduler import EOS, VOCAB, Engine, next_token, params, reference


class SpecEngine(Engine):
    def __init__(self, *args, seed: int = 0, k: int = 6) -> None:
        super().__init__(*args)
        self.rng, self.k = random.Random(seed), k
        self.proposed = self.accepted = 0

    def guesses(self) -> dict[str, list[int]]:
        """Up to k tokens per decoding request: a right prefix, then wrong tokens."""
        out = {}
        for req in self.sched.decoding():
            k = self.rng.randint(0, self.k)
            right = self.rng.randint(0, k)
            want = reference(req.prompt_ids, req.output_ids, len(req.output_ids) + k, None)
            guess = want[len(req.output_ids) :]
            for j in range(right, len(guess)):
                guess[j] = (guess[j] + 1) % VOCAB
            if guess:
                out[req.request_id] = guess
        return out

    def step(self):
        sched, bm, bs = self.sched, self.bm, self.bm.block_size
        out = sched.schedule(self.guesses())
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        for (_, d), data in zip(
            out.copies, [self.kv[s * bs : (s + 1) * bs] for s, _ in out.copies]
        ):
            self.kv[d * bs : (d + 1) * bs] = data
        for s in out.scheduled:
            known = s.req.tokens(s.start_pos, s.start_pos + s.num_new_tokens - len(s.spec_ids))
            new = known + list(s.spec_ids)
            slots = bm.slot_mapping(s.req, s.start_pos, s.start_pos + s.num_new_tokens)
            for j, slot in enumerate(slots):
                self.kv[slot] = (s.start_pos + j, new[j])
        sampled = {}
        for s in out.scheduled:
            end = s.start_pos + s.num_new_tokens
            seen = [t for _, t in (self.kv[x] for x in bm.slot_mapping(s.req, 0, end))]
            want = s.req.tokens(0, end - len(s.spec_ids)) + list(s.spec_ids)
            assert seen == want, s.req
            if s.produces_token:  # one row per guess plus the last token's
                rows = range(end - len(s.spec_ids), end + 1)
                tokens = accept_sampled([next_token(seen[:r]) for r in rows], s.spec_ids)
                sampled[s.req.request_id] = tokens
                self.proposed += len(s.spec_ids)
                self.accepted += len(tokens) - 1
        finished = sched.update(out, sampled)
        bm.check()
        self.check_scheduler()
        for r in sched.running:  # no block held past what the accepted tokens need
            assert len(r.block_table) <= bm.blocks_for(r.num_tokens + self.k)
        self.steps += 1
        return out, finished


def test_guesses_are_verified_and_rolled_back_without_leaks() -> None:
    rng = random.Random(3)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32)
    eng = SpecEngine(40, 4, config, seed=1)
    reqs = []
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]  # prefix-cache hits
    for i in range(30):
        body = [rng.randrange(1, VOCAB) for _ in range(rng.choice([1, 5, 20, 45]))]
        prompt = shared + body if i % 2 else body
        reqs.append(Request(f"r{i}", prompt, params(rng.randint(1, 25)), eos_token_id=EOS))
        eng.sched.add(reqs[-1])
        if i % 4 == 0:
            eng.step()
    eng.run()
    assert eng.proposed > 0 and 0 < eng.accepted < eng.proposed
    assert eng.sched.num_preemptions > 0, "the pool was meant to force preemption"
    for r in reqs:
        assert r.output_ids == reference(r.prompt_ids, [], r.max_tokens, EOS), r


def test_stop_and_max_tokens_inside_accepted_guesses() -> None:
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=40)
    eng = SpecEngine(64, 4, config, seed=2, k=8)
    eng.rng = random.Random(5)
    prompt = [3, 1, 4, 1, 5]
    want = reference(prompt, [], 30, None)
    stop = want[6]  # a stop token the guesses run past
    a = Request("a", prompt, params(30, stop_token_ids=[stop]))
    b = Request("b", [2, 7, 1, 8], params(7, ignore_eos=True))  # ends by max_tokens
    c = Request("c", list(range(1, 31)), params(30, ignore_eos=True))  # ends by max_model_len
    for r in (a, b, c):
        eng.sched.add(r)
    eng.run()
    assert a.output_ids == want[: want.index(stop) + 1] and a.finish_reason == "stop"
    assert b.output_ids == reference(b.prompt_ids, [], 7, None) and b.finish_reason == "length"
    assert c.num_tokens == 40 and c.finish_reason == "length"
    assert c.output_ids == reference(c.prompt_ids, [], 10, None)


def test_guesses_never_preempt_and_take_only_spare_budget() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6)
    eng = SpecEngine(64, 4, config, seed=4, k=8)
    reqs = [Request(f"r{i}", [i + 1, 2, 3], params(20, ignore_eos=True)) for i in range(4)]
    for r in reqs:
        eng.sched.add(r)
    eng.step()
    out, _ = eng.step()  # four decodes: two tokens of budget left for guesses
    assert len(out.scheduled) == 4
    assert sum(len(s.spec_ids) for s in out.scheduled) <= 2
    eng.run()
    assert eng.sched.num_preemptions == 0
    for r in reqs:
        assert r.output_ids == reference(r.prompt_ids, [], 20, None)
