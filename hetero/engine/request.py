"""One sequence in the engine: its token ids, how far its KV is computed, and its blocks."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterable
from typing import Any

# Tie-breaker for requests created within one tick of the monotonic clock: arrival order must be
# total, since the scheduler preempts the newest request.
_ARRIVAL_SEQ = itertools.count()

DEFAULT_MAX_TOKENS = 16  # what the OpenAI API (and vLLM) assume when max_tokens is not given


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """A prompt and the tokens generated for it so far.

    params is the caller's sampling-params object; only `max_tokens`, `stop_token_ids` and
    `ignore_eos` are read from it (with defaults when absent). eos_token_id comes from the model's
    tokenizer: it stops the request unless params.ignore_eos, while stop_token_ids always stop it
    (as in the OpenAI-compatible servers).

    num_computed_tokens: leading tokens of all_ids whose KV is in the cache.
    num_cached_tokens: of the prompt, how many came from the prefix cache at admission.
    block_tables: KV block ids, one table per KV cache group (engine/kv_groups.py), block i of
        each holding positions [i*block_size, (i+1)*block_size); block_table: the first's.
    """

    __slots__ = (
        "request_id",
        "prompt_ids",
        "output_ids",
        "params",
        "eos_token_id",
        "max_tokens",
        "stop_token_ids",
        "ignore_eos",
        "status",
        "error",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "block_tables",
        "arrival",
        "admitted",
        "timeline",
        "stop_now",
        "_seq",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: Any = None,
        *,
        eos_token_id: int | Iterable[int] | None = None,
        arrival: float | None = None,
    ) -> None:
        if not prompt_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        # one id, or the set a vocabulary marks as ends of generation (EOS, EOT, EOM ...)
        if eos_token_id is None:
            self.eos_token_id: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_id = frozenset((eos_token_id,))
        else:
            self.eos_token_id = frozenset(eos_token_id)
        max_tokens = getattr(params, "max_tokens", None)
        self.max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        self.stop_token_ids = frozenset(getattr(params, "stop_token_ids", None) or ())
        self.ignore_eos = bool(getattr(params, "ignore_eos", False))
        self.status = RequestStatus.WAITING
        self.error: str | None = None  # why an aborted request was failed by the engine
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.block_tables: list[list[int]] = []
        self.arrival = time.monotonic() if arrival is None else arrival
        self.admitted: float | None = None  # perf_counter when first given KV blocks
        self.timeline: Any = None  # the engine's RequestTimeline of it (engine/timeline.py)
        self.stop_now = False  # set by the engine when its grammar has ended (structured outputs)
        self._seq = next(_ARRIVAL_SEQ)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def block_table(self) -> list[int]:
        """The first KV cache group's table (the only one of a model without windows)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def order(self) -> tuple[float, int]:
        """Arrival order (total): smaller is older."""
        return (self.arrival, self._seq)

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (called every step on long sequences)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """ "stop" | "length" | "abort" once finished, else None."""
        return _FINISH_REASONS.get(self.status)

    def stops_at(self, token: int) -> RequestStatus | None:
        """The finished status that appending `token` (already appended) leads to, if any."""
        if self.stop_now:
            return RequestStatus.FINISHED_STOPPED
        if token in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in self.eos_token_id and not self.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_ids) >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={len(self.output_ids)}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_tables})"
        )
