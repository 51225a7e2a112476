"""Structured outputs, logit_bias and min_tokens through the engine, on a random-weight model:
constrained rows beside speculating free rows, n > 1, and the effect of each field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.engine.engine import Engine
from hetero.factory import LaunchConfig
from hetero.launch import build_engine
from hetero.llm import LLM
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams
from hetero.structured_outputs import StructuredOutputsParams
from hetero.synth import write_synthetic
from tests.engine.test_spec_engine import assert_same_greedy, repetitive_prompts
from tests.support import exact_weights

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tags", "ok"],
    "additionalProperties": False,
}
CONSTRAINED = StructuredOutputsParams(json=SCHEMA)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_synthetic(
        tmp_path_factory.mktemp("so") / "tiny.gguf", "tiny-llama", "q8_0", progress=False
    )
    return path, load_model(path, exact_weights.runtime())


def engine(model, speculative: str = "off") -> Engine:
    path, loaded = model
    cfg = EngineConfig(
        kv_dtype="fp32",
        num_kv_blocks=256,
        block_size=8,
        speculative=speculative,
        num_speculative_tokens=6,
        scheduler=SchedulerConfig(max_num_seqs=8),
    )
    return build_engine(str(path), LaunchConfig(cfg), loaded=loaded)


def run(eng: Engine, prompts, params) -> list[tuple[list[int], str]]:
    """(tokens, finish reason) per request, all in one batch."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    outs = {f"r{i}": ([], None) for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            tokens, _ = outs[o.request_id]
            outs[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
    return [outs[f"r{i}"] for i in range(len(prompts))]


def test_constrained_rows_beside_speculating_free_rows(tiny):
    prompts = repetitive_prompts(6, 200)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=150, structured_outputs=CONSTRAINED)
        if i % 2
        else free
        for i, s in enumerate(range(6))
    ]
    eng = engine(tiny, "ngram")
    asked: list[str] = []
    propose = eng.spec.propose
    eng.spec.propose = lambda reqs: asked.extend(r.request_id for r in reqs) or propose(reqs)
    got = run(eng, prompts, params)
    assert eng.spec.proposed > 0 and eng.spec.accepted > 0, "the free rows were meant to guess"
    assert asked and not {f"r{i}" for i in (1, 3, 5)} & set(asked)  # constrained rows never
    tok = eng.tokenizer
    for tokens, reason in got[1::2]:
        assert reason == "stop", tok.decode(tokens)  # the object closed: the request ended
        jsonschema.validate(json.loads(tok.decode(tokens)), SCHEMA)
    want = run(engine(tiny), prompts[::2], [free] * 3)
    assert_same_greedy(
        (tiny[0], tiny), prompts[::2], [t for t, _ in got[::2]], [t for t, _ in want]
    )


def test_n_sequences_each_follow_the_schema(tiny):
    llm = LLM(str(tiny[0]), loaded=tiny[1], kv_dtype="fp32", num_kv_blocks=256, speculative="off")
    p = SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=150, structured_outputs=CONSTRAINED
    )
    (out,) = llm.generate([[1, 50, 60, 70]], p)
    texts = [c.text for c in out.outputs]
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len(set(texts)) > 1, texts  # three matchers, three samples


def test_a_grammar_that_does_not_compile_is_refused_before_it_is_queued(tiny):
    eng = engine(tiny)
    bad = StructuredOutputsParams(grammar="start: nowhere")
    with pytest.raises(ValueError, match="invalid structured output"):
        eng.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=bad))
    assert not eng.has_unfinished() and "bad" not in eng.params


def test_logit_bias_changes_the_greedy_token(tiny):
    eng = engine(tiny)
    prompt = [1, 40, 41, 42]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ((plain, _),) = run(eng, [prompt], [greedy])
    banned = SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, logit_bias={plain[0]: -100}
    )
    forced = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={77: 100})
    (other, _), (seventy_sevens, _) = run(eng, [prompt, prompt], [banned, forced])
    assert other[0] != plain[0] and seventy_sevens == [77, 77, 77]
    with pytest.raises(ValueError, match="logit_bias"):
        eng.add_request("x", prompt, SamplingParams(logit_bias={10**6: 1.0}))


def test_min_tokens_delays_the_end(tiny):
    eng = engine(tiny)
    eos = min(eng.tokenizer.eos_ids)
    ends = {eos: 100}  # a model that would stop at once
    p = [
        SamplingParams(temperature=0, max_tokens=20, logit_bias=ends),
        SamplingParams(temperature=0, max_tokens=20, logit_bias=ends, min_tokens=5),
        SamplingParams(temperature=0.9, seed=3, max_tokens=20, logit_bias=ends, min_tokens=7),
    ]
    (at_once, r0), (five, r1), (seven, r2) = run(eng, [[1, 9, 8]] * 3, p)
    assert at_once == [eos] and r0 == "stop"
    assert len(five) == 6 and five[-1] == eos and eos not in five[:-1] and r1 == "stop"
    assert len(seven) == 8 and seven[-1] == eos and not set(eng.tokenizer.eos_ids) & set(seven[:-1])
    stop = SamplingParams(
        temperature=0, max_tokens=20, logit_bias={55: 100}, stop_token_ids=[55], min_tokens=2
    )
    ((tokens, reason),) = run(eng, [[1, 9, 8]], [stop])
    assert len(tokens) == 3 and tokens[-1] == 55 and 55 not in tokens[:-1] and reason == "stop"
