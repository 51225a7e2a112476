"""What crosses between the server process and the engine process (process.py, client.py).

One pickled message per command or event, each a small typed class:

    server -> engine   Add(request_id, prompt_ids, params)   Abort(request_id)
                       GaugesQuery(token)                     Embed(token, prompts)
                       Shutdown()
    engine -> server   Ready(info) | LoadFailed(message)     once, after loading
                       StepDone(outputs, refused)            once per engine step that did something
                       GaugesReply(token, gauges)            Embedded(token, vectors, refusal)
                       Died(message)

A StepDone's outputs travel as plain tuples in StepOutput's field order (`pack_outputs`;
`StepOutput(*t)` is the inverse), not as dataclasses: a tuple pickles in about a third of the
time, and one message per step carries every running sequence's tokens. The classes use slots
and pickle as their fields.

No import of the engine here: the engine process imports this module before it sets its signals,
and torch takes seconds to load.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know about a loaded engine, wherever it runs."""

    max_model_len: int
    num_blocks: int
    block_size: int
    kv_description: str  # the pool (and stages), for the ready line
    stages: tuple = ()  # engine/executor.py's StageLayouts: where the layers are, as loaded
    max_num_seqs: int = 0  # sequences the scheduler runs at once (llama.cpp's slots)
    # tokens of KV one request can hold at most: the whole pool, or with sliding-window layers
    # what the full layers' blocks may take beside the window's (engine/kv_groups.py); 0:
    # num_blocks * block_size
    max_request_tokens: int = 0

    @classmethod
    def of(cls, engine) -> EngineInfo:
        bm = engine.block_manager
        seqs = engine.config.scheduler.max_num_seqs
        stages = engine.executor.info.stages
        held = bm.max_tokens(engine.scheduler.step_tokens, bm.num_blocks * bm.block_size * 2)
        return cls(
            engine.max_model_len, bm.num_blocks, bm.block_size, engine.describe_kv(), stages, seqs,
            held,
        )  # fmt: skip

    @property
    def pool_tokens(self) -> int:
        """Tokens of KV one request can hold at most: the whole pool."""
        return self.max_request_tokens or self.num_blocks * self.block_size


# -- server -> engine ------------------------------------------------------------------------


@dataclass(slots=True)
class Add:
    request_id: str
    prompt_ids: list[int]
    params: Any  # SamplingParams


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class GaugesQuery:
    token: int  # the reply carries it back


@dataclass(slots=True)
class Embed:
    """Embeddings of token-id prompts, answered by token between two steps."""

    token: int
    prompts: list[list[int]]


@dataclass(slots=True)
class Shutdown:
    """Abort the rest, save the KV prefixes, exit."""


# -- engine -> server ------------------------------------------------------------------------


@dataclass(slots=True)
class Ready:
    info: EngineInfo


@dataclass(slots=True)
class LoadFailed:
    message: str


@dataclass(slots=True)
class StepDone:
    outputs: list[tuple]  # pack_outputs of the step's StepOutputs
    refused: list[tuple[str, str]]  # (request id, why) of requests add_request refused


@dataclass(slots=True)
class GaugesReply:
    token: int
    gauges: Any  # EngineGauges (engine/stats.py)


@dataclass(slots=True)
class Embedded:
    token: int
    vectors: Any  # [N, C] float32 array (None when refused or failed)
    error: tuple[bool, str] | None = None  # (a refusal: the request's fault, the message)


@dataclass(slots=True)
class Died:
    message: str  # the engine loop raised: the process exits next


def dumps(msg) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def pack_outputs(outs: list) -> list[tuple]:
    """StepOutputs as tuples; StepOutput(*t) is the inverse."""
    return [
        (
            o.request_id,
            o.new_token_ids,
            o.logprobs,
            o.finished,
            o.finish_reason,
            o.num_prompt_tokens,
            o.num_cached_tokens,
            o.error,
            o.timeline,
        )
        for o in outs
    ]
