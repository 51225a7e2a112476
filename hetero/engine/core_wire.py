"""What crosses between the server process and the engine-core process (core_process.py).

Server -> engine, one pickled tuple per command:

    ("add", request_id, prompt_ids, SamplingParams)
    ("abort", request_id)
    ("gauges", token)                      the /metrics lines of the engine, answered by token
    ("embed", token, [prompt ids, ...])    embeddings, answered by token between two steps
    ("shutdown",)                          abort the rest, save the KV prefixes, exit

Engine -> server:

    ("ready", EngineInfo)  |  ("failed", message)        once, after loading
    ("step", [output tuple, ...], [(request_id, refusal), ...])   once per engine step
    ("gauges", token, [line, ...])
    ("embedded", token, array | None, (is a refusal, message) | None)
    ("died", message)                      the engine loop raised: the process exits next

Step outputs travel as plain tuples (field order of StepOutput), not dataclasses: a tuple pickles
in about a third of the time, and one message per step carries every running sequence's tokens.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know about a loaded engine, wherever it runs."""

    max_model_len: int
    num_blocks: int
    block_size: int
    kv_description: str  # Engine.describe_kv(), for the ready line

    @classmethod
    def of(cls, engine) -> EngineInfo:
        bm = engine.block_manager
        return cls(engine.max_model_len, bm.num_blocks, bm.block_size, engine.describe_kv())

    @property
    def pool_tokens(self) -> int:
        """Tokens of KV one request can hold at most: the whole pool."""
        return self.num_blocks * self.block_size


def dumps(msg: tuple) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def pack_outputs(outs: list) -> list[tuple]:
    """StepOutputs as tuples; StepOutput(*t) is the inverse. (No import of the engine here: the
    engine process imports this module before it sets its signals, and torch takes seconds.)"""
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
        )
        for o in outs
    ]
