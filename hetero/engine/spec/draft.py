"""Draft-model proposals: a small model with the target's vocabulary guesses k tokens.

The draft keeps its own paged KV (pool, block manager without prefix caching, runner) and one
mirror Request per target request. Each step, per guessing request:

    sync     mirror tokens := target tokens; its KV is cut back to the common prefix (the guesses
             the target rejected are dropped: BlockManager.trim)
    k passes one batched draft forward per pass over all guessing requests: the first catches up
             (new prompt, or the target's last accepted tokens), the others decode one token;
             each samples a guess from q, the request's sampling distribution over draft logits

The guesses go to the target with their q rows; verification uses the rule of verify.draft_rule
(accept with min(1, p/q), else sample the residual), so the output distribution is the target's.
Greedy requests take the draft's argmax and are verified by argmax comparison: the exact greedy
output.
"""

from __future__ import annotations

import torch

from hetero.engine.block_manager import BlockManager
from hetero.engine.executor import Executor, Step
from hetero.engine.request import Request
from hetero.engine.scheduler import ScheduledRequest, SchedulerOutput
from hetero.engine.spec.speculator import Speculator
from hetero.engine.spec.verify import accept_draft, accept_sampled, draft_rule
from hetero.rng import gumbel, random_keys
from hetero.sampler import make_batch
from hetero.sampling_filters import probabilities


def check_same_vocab(target_tok, draft_tok, draft_path: str) -> None:
    """Refuse a draft whose token ids mean other text: its guesses would be nonsense."""
    if target_tok.vocab_size != draft_tok.vocab_size:
        raise ValueError(
            f"draft model {draft_path}: vocabulary of {draft_tok.vocab_size} tokens, the model's "
            f"has {target_tok.vocab_size}; a draft model must share the model's vocabulary"
        )
    for i in range(target_tok.vocab_size):
        if target_tok.id_to_token(i) != draft_tok.id_to_token(i):
            raise ValueError(
                f"draft model {draft_path}: token {i} is {draft_tok.id_to_token(i)!r}, the "
                f"model's is {target_tok.id_to_token(i)!r}; a draft must share the vocabulary"
            )


class DraftSpeculator(Speculator):
    def __init__(self, config, draft: Executor, params: dict) -> None:
        """`draft`: the draft model's executor (one device, its own KV pool; hetero/launch.py
        builds it and checks its vocabulary); `params`: the engine's live map of request id ->
        SamplingParams."""
        super().__init__(config.num_speculative_tokens)
        self.cheap_proposals = False
        self.draft = draft
        # a window group keeps the blocks of the guesses a rollback may drop (_sync)
        self.bm = BlockManager(
            draft.info.num_blocks, config.block_size, False,
            windows=draft.info.kv_windows, window_slack=config.num_speculative_tokens,
        )  # fmt: skip
        self.params = params
        self.mirrors: dict[str, Request] = {}
        self.q: dict[str, list[torch.Tensor]] = {}  # request id -> [V] draft distribution rows
        self.gen = torch.Generator(device=draft.info.device)
        self.gen.manual_seed(0 if config.seed is None else config.seed)
        self._steps = 0

    # -- proposing -------------------------------------------------------------------------------

    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        todo = {r.request_id: (self._sync(r), s.k) for r, s in self.active(requests)}
        todo = {rid: v for rid, v in todo.items() if v[0] is not None}
        guesses: dict[str, list[int]] = {rid: [] for rid in todo}
        self.q = {rid: [] for rid in todo}
        for _ in range(max((k for _, k in todo.values()), default=0)):
            batch = [m for rid, (m, k) in todo.items() if len(guesses[rid]) < k]
            batch = [m for m in batch if self._reserve(m)]
            if not batch:
                break
            for m, token, q in zip(batch, *self._draft_step(batch)):
                guesses[m.request_id].append(token)
                self.q[m.request_id].append(q)
        return {rid: g for rid, g in guesses.items() if g}

    def _sync(self, req: Request) -> Request | None:
        """The mirror of req, holding req's tokens, its KV cut back to the common prefix."""
        m = self.mirrors.get(req.request_id)
        if m is None:
            m = self.mirrors[req.request_id] = Request(req.request_id, req.prompt_ids)
        common = _common_prefix(m.output_ids, req.output_ids) + m.num_prompt_tokens
        m.output_ids = list(req.output_ids)
        if m.block_table:
            m.num_computed_tokens = min(m.num_computed_tokens, common, m.num_tokens - 1)
            self.bm.trim(m, m.num_computed_tokens)
        return m

    def _reserve(self, m: Request) -> bool:
        n = m.num_tokens - m.num_computed_tokens
        if not m.block_table:
            return self.bm.allocate(m, n)
        return self.bm.append_slots(m, n)

    def _draft_step(self, batch: list[Request]) -> tuple[list[int], torch.Tensor]:
        """One draft forward over the mirrors' uncomputed tokens; a guess and q row each."""
        sched = [
            ScheduledRequest(
                m, m.num_tokens - m.num_computed_tokens, m.num_computed_tokens, True, True
            )
            for m in batch
        ]
        self.draft.submit(Step(self._steps, SchedulerOutput(sched)))
        self._steps += 1
        logits = self.draft.collect().logits
        params = [self.params[m.request_id] for m in batch]
        state = make_batch(
            params,
            [m.prompt_ids for m in batch],
            [m.output_ids for m in batch],
            [len(m.output_ids) for m in batch],
            logits.device,
        )
        q = probabilities(logits, state)  # [B, V]; a point mass on the argmax for greedy rows
        keys = random_keys(len(batch), self.gen, q.device)
        tokens = (q.log() + gumbel(keys, q.shape[1])).argmax(-1).tolist()
        for m, token in zip(batch, tokens):
            m.num_computed_tokens = m.num_tokens
            m.output_ids.append(token)
        return tokens, q

    # -- verifying -------------------------------------------------------------------------------

    def accept(self, producing, spans, ids, logits, state, sampler) -> list[list[int]]:
        """Greedy rows compare argmaxes; sampled rows use the draft rule with their q rows."""
        out = []
        p = None
        for s, (lo, hi) in zip(producing, spans):
            params = self.params[s.req.request_id]
            qs = self.q.get(s.req.request_id, [])
            if not s.spec_ids or params.greedy or len(qs) < len(s.spec_ids):
                out.append(accept_sampled(ids[lo:hi], s.spec_ids))
                continue
            if p is None:
                p = probabilities(logits, state)
                keys = sampler.row_keys(state, logits.device)
            k = len(s.spec_ids)
            guess = torch.tensor(s.spec_ids, device=p.device)
            ok, tokens = draft_rule(p[lo : lo + k], torch.stack(qs[:k]), guess, keys[lo : lo + k])
            out.append(accept_draft(tokens.tolist(), ok.tolist(), ids[hi - 1]))
        return out

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        m = self.mirrors.pop(request_id, None)
        if m is not None:
            self.bm.free(m)
        self.q.pop(request_id, None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
