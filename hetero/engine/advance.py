"""The scheduler's half of overlapped steps (engine/overlap.py): advance past a step whose
tokens are still on their way to the host, schedule the next one, then settle the step with
its tokens.

An advanced request holds a placeholder -1 - i for its newest token (i: its row among the
step's producing rows), which the next step's runner reads from the step's samples on the
device. Its KV advances as for a known token: the placeholder's position is the one the next
step computes, so no block named by its tokens (the prefix cache's) ever holds a placeholder.
A request that the placeholder brings to its max_tokens (or the model's length) ends with it
whatever the token is, and is not scheduled again; one that stops at the token (an end of
text, a stop token) is found at settling, after its row of the next step was submitted: that
row is wasted and its token dropped (the request is finished by then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetero.engine.request import RequestStatus

if TYPE_CHECKING:
    from hetero.engine.request import Request
    from hetero.engine.scheduled import SchedulerOutput


class Advancing:
    """Scheduler's advance() and the settling update() of an advanced step (mixed in: it
    reads the scheduler's config, block manager, _ending set, _stops and _finish)."""

    def advance(self, output: SchedulerOutput) -> None:
        """Apply a computed step whose tokens are still on their way (an overlapped step: the
        next one is scheduled before update() has them). Each producing request gets a
        placeholder token -1 - i (i: its row among the producing ones, in the order of
        output.scheduled) and its KV advances as update() would advance it; a request the
        placeholder brings to max_tokens or max_model_len ends with it whatever the token, and
        is not scheduled again. update(output, sampled) then puts the tokens in their places.
        Steps with guesses are not advanced (how many are accepted is not known yet)."""
        limit, row = self.config.max_model_len, 0
        for s in output.scheduled:
            if s.spec_ids:
                raise ValueError("a step with speculative guesses cannot be advanced")
            req = s.req
            live = req.status is RequestStatus.RUNNING
            if live and req.num_computed_tokens != s.start_pos:
                raise RuntimeError(
                    f"request {req.request_id!r}: step applied twice or out of order"
                )
            if s.produces_token:
                row += 1
                if not live:
                    continue
                req.output_ids.append(-row)
                if len(req.output_ids) >= req.max_tokens or (
                    limit is not None and req.num_tokens >= limit
                ):
                    self._ending.add(req.request_id)
            elif not live:
                continue
            req.num_computed_tokens = s.start_pos + s.num_new_tokens
            self.block_manager.commit(req)
        output.advanced = True

    def _settle(
        self, output: SchedulerOutput, sampled: dict[str, int | list[int]]
    ) -> list[Request]:
        """update() of an advanced step: each placeholder replaced by its token, then the stop
        checks (a request preempted since keeps its token and may finish in the queue)."""
        finished, row = [], 0
        for s in output.scheduled:
            if not s.produces_token:
                continue
            row += 1
            req = s.req
            if req.is_finished:  # aborted since
                continue
            token = sampled.get(req.request_id)
            if isinstance(token, list):
                (token,) = token
            if token is None:
                raise ValueError(f"no sampled token for {[req.request_id]}")
            if req.output_ids[-1] != -row:
                raise RuntimeError(f"request {req.request_id!r}: no placeholder of its token")
            req.output_ids[-1] = token
            self._ending.discard(req.request_id)
            status = self._stops(req, token)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        return finished
