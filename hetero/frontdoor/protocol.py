"""The one interface the server holds an engine by, wherever the engine runs.

    thread.AsyncEngine     the engine on a thread of the server's process
    client.EngineProcess   the engine in a process of its own, over two pipes

Both stream one sequence's StepOutputs to a caller on an asyncio event loop; text stays with the
caller (the tokenizer lives beside it in both cases).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hetero.engine.output import StepOutput
    from hetero.engine.stats import EngineGauges
    from hetero.frontdoor.wire import EngineInfo
    from hetero.sampling import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine stopped (it died, or the server is shutting down); no request can be served."""


class EngineLoadError(RuntimeError):
    """The engine could not load the model (the message names the error there)."""


class EngineClient(Protocol):
    info: EngineInfo | None
    tokenizer: object

    @property
    def num_in_flight(self) -> int:
        """Sequences being streamed to callers."""

    @property
    def max_model_len(self) -> int: ...

    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        pace: Callable[[], float] | None = None,
    ) -> AsyncIterator[StepOutput]:
        """One sequence's outputs until the finished one (stream.paced merges and spaces them);
        ValueError for a request the engine refuses, EngineDeadError when it cannot serve.
        The request is aborted when the caller stops listening first."""

    def abort(self, request_id: str) -> None: ...

    async def embed(self, prompts: list[list[int]]):
        """Engine.embed between two steps: [N, C] float32 (ValueError: a refusal)."""

    async def gauges(self) -> EngineGauges | None:
        """The engine's queues, pool and counters now (None when it cannot answer)."""

    def close(self, timeout: float = 30.0) -> None:
        """Stop serving (requests end saying why) and keep the KV prefixes for the next start."""
