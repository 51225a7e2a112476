"""Pipeline pieces that need no stage process: stage specs, micro-batch groups, split models.

Stage specs: --split / --devices / plan parsing, with errors naming the flag. Micro-batches: the
pure-Python scheduler over groups. Split model: stages chained in one process give the full
model's logits exactly (the same ops on the same shapes).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hetero.config import PipelineConfig, RuntimeConfig
from hetero.engine.block_manager import BlockManager
from hetero.engine.config import SchedulerConfig
from hetero.engine.microbatch import MicroBatchScheduler
from hetero.engine.request import Request, RequestStatus
from hetero.launch import require_present, resolve_stages
from hetero.pipeline.stages import (
    StageSpec,
    even_split,
    parse_devices,
    parse_split,
    stages_from_plan,
)


def test_parse_split_inclusive_ranges():
    got = parse_split("cuda:0=0-19, cpu=20-31", 32)
    assert got == [StageSpec("cuda:0", 0, 20), StageSpec("cpu", 20, 32)]
    assert [len(s.layers) for s in got] == [20, 12]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("cpu=0-14,cpu=16-29", "starts at layer 16, expected 15"),  # gap
        ("cpu=0-15,cpu=15-29", "starts at layer 15, expected 16"),  # overlap
        ("cpu=0-14", "model has 30 layers"),  # short
        ("cpu=0-14,cpu=15-30", "model has 30 layers"),  # past the end
        ("cpu:0-14,cpu=15-29", "is not DEVICE=FIRST-LAST"),
        ("cpu=0..14,cpu=15-29", "is not DEVICE=FIRST-LAST"),
        ("cpu=14-0", "ends before it starts"),
        ("tpu=0-14,cpu=15-29", "--split: device 'tpu'"),
        ("cpu=15-29,cpu=0-14", "starts at layer 15, expected 0"),  # out of order
    ],
)
def test_parse_split_errors_are_clear(text, needle):
    with pytest.raises(ValueError, match="--split|layer|model"):
        try:
            parse_split(text, 30)
        except ValueError as e:
            assert needle in str(e), str(e)
            raise


def test_even_split_and_devices():
    assert even_split(["cpu", "cpu"], 30) == [StageSpec("cpu", 0, 15), StageSpec("cpu", 15, 30)]
    three = even_split(["cuda:0", "cuda:1", "cpu"], 32)
    assert [(s.layer_start, s.layer_end) for s in three] == [(0, 11), (11, 22), (22, 32)]
    with pytest.raises(ValueError, match="at most one per layer"):
        even_split(["cpu"] * 5, 4)
    assert parse_devices("cuda:0,cpu") == ["cuda:0", "cpu"]
    for bad in ("", "cpu,,cpu", "gpu0"):
        with pytest.raises(ValueError, match="--devices"):
            parse_devices(bad)


def test_plan_adapter_duck_typed_and_json(tmp_path):
    plan = SimpleNamespace(
        stages=[
            SimpleNamespace(device="cuda:0", layer_start=0, layer_end=20, num_kv_blocks=900,
                            kv_dtype="fp8", weights="dense", kernels={"qlinear": "triton"},
                            mps_percentage=60),
            SimpleNamespace(device="cpu", layer_start=20, layer_end=32, num_kv_blocks=4000,
                            kv_dtype="fp16", weights={"attn": "int8"}, kernels={}),
        ]
    )  # fmt: skip
    got = stages_from_plan(plan, 32)
    assert got[0] == StageSpec("cuda:0", 0, 20, 900, "fp8", "dense", 60)
    assert got[1] == StageSpec("cpu", 20, 32, 4000, "fp16", None)  # non-string weights: engine's
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"stages": [{"device": "cpu", "layer_start": 0, "layer_end": 4}]}))
    assert resolve_stages("m.gguf", 4, PipelineConfig(plan=str(path))) == [StageSpec("cpu", 0, 4)]
    with pytest.raises(ValueError, match="model has 5 layers"):
        resolve_stages("m.gguf", 5, PipelineConfig(plan=str(path)))
    share = stages_from_plan({"stages": [{"device": "cuda:0@70%:32GB", "layer_start": 0,
                                          "layer_end": 4}]}, 4)  # fmt: skip
    assert share == [StageSpec("cuda:0", 0, 4, mps_percentage=70)]  # the planner's GPU share
    with pytest.raises(ValueError, match="mps_percentage must be in 1..100"):
        stages_from_plan({"stages": [{**json.loads(path.read_text())["stages"][0],
                                      "mps_percentage": 0}]}, 4)  # fmt: skip
    with pytest.raises(ValueError, match="needs device, layer_start and layer_end"):
        stages_from_plan({"stages": [{"device": "cpu"}]}, 4)


def test_a_plan_file_for_devices_not_here_is_refused_in_one_line(tmp_path):
    """A plan made on another machine (or before a GPU went away) stops before any stage starts."""
    path = tmp_path / "plan.json"
    stages = [{"device": "cpu", "layer_start": 0, "layer_end": 2},
              {"device": "cuda:63@70%:8GB", "layer_start": 2, "layer_end": 4}]  # fmt: skip
    path.write_text(json.dumps({"stages": stages}))
    here, there = resolve_stages("m.gguf", 4, PipelineConfig(plan=str(path)))
    require_present([here])  # a stage on another host (--remote-stages) is not checked here
    with pytest.raises(ValueError, match=r"places layers on cuda:63, not present now \(present: "):
        require_present([here, there])  # what the pipeline checks before starting its stages
    path.write_text(json.dumps({"version": 1}))
    with pytest.raises(ValueError, match="plan has no 'stages' list"):
        resolve_stages("m.gguf", 4, PipelineConfig(plan=str(path)))


def test_resolve_stages_options():
    assert resolve_stages("m.gguf", 30, PipelineConfig()) is None
    assert len(resolve_stages("m.gguf", 30, PipelineConfig(devices="cpu,cpu,cpu"))) == 3
    assert (
        resolve_stages("m.gguf", 30, PipelineConfig(devices="cpu,cpu", split="cpu=0-9,cpu=10-29"))[
            0
        ].layer_end
        == 10
    )
    with pytest.raises(ValueError, match="disagrees"):
        resolve_stages(
            "m.gguf", 30, PipelineConfig(devices="cpu,cuda:0", split="cpu=0-9,cpu=10-29")
        )
    with pytest.raises(ValueError, match="only one of --split and --plan"):
        resolve_stages("m.gguf", 30, PipelineConfig(split="cpu=0-29", plan="p.json"))


# -- micro-batch groups ----------------------------------------------------------------------


def _sched(num_blocks=64, groups=2, **cfg) -> MicroBatchScheduler:
    cfg.setdefault("max_num_seqs", 8)
    cfg.setdefault("max_num_batched_tokens", 64)
    return MicroBatchScheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, 4), groups)


def _req(rid: str, n: int = 6, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, n + 1)), SimpleNamespace(max_tokens=max_tokens))


def _finish_step(s: MicroBatchScheduler, out) -> None:
    s.update(out, {x.req.request_id: 7 for x in out.scheduled if x.produces_token})


def test_groups_split_requests_evenly_and_never_overlap():
    s = _sched()
    for i in range(5):
        s.add(_req(f"r{i}"))
    a, b = s.schedule_group(0), s.schedule_group(1)
    ga = {x.req.request_id for x in a.scheduled}
    gb = {x.req.request_id for x in b.scheduled}
    assert len(ga) == 3 and len(gb) == 2 and not ga & gb  # ceil(5 / 2) seats each
    _finish_step(s, a)  # group 0 came back; group 1 is still in flight
    a2 = s.schedule_group(0)
    assert {x.req.request_id for x in a2.scheduled} == ga  # only its own requests, decoding
    assert all(x.num_new_tokens == 1 for x in a2.scheduled)
    with pytest.raises(RuntimeError, match="schedule_group"):
        s.schedule()


def test_group_short_of_blocks_waits_for_the_other_group():
    # 5 blocks of 4 tokens. Each request: 8-token prompt + 8 outputs = 4 blocks alone (fits).
    s = _sched(num_blocks=5, max_num_seqs=2, max_num_batched_tokens=16)
    s.add(_req("a", n=8))
    s.add(_req("b", n=8))
    out_a, out_b = s.schedule_group(0), s.schedule_group(1)
    assert len(out_a.scheduled) == len(out_b.scheduled) == 1  # 2 + 2 blocks taken
    _finish_step(s, out_a)
    steps = 0
    # group 0 decodes while group 1 stays in flight: when the pool runs dry, group 0's only
    # request must go back to waiting (not fail: group 1 holds blocks it will free)
    while (a := s.get("a")) is not None and a.status is RequestStatus.RUNNING and steps < 20:
        out = s.schedule_group(0)
        if out.scheduled:
            _finish_step(s, out)
        steps += 1
    assert a is not None and a.error is None, "group 0's request failed instead of waiting"
    assert a.status is RequestStatus.PREEMPTED and s.num_preemptions == 1
    _finish_step(s, out_b)
    while s.has_work():  # both finish once the groups take turns
        for g in (0, 1):
            out = s.schedule_group(g)
            if out.scheduled:
                _finish_step(s, out)
    assert s.block_manager.num_free_blocks == 5


# -- a model split into stages, in one process -------------------------------------------------


def test_stage_models_chain_to_the_full_model(tmp_path):
    from hetero.gguf_loader import load_gguf
    from hetero.model.contiguous_kv import ContiguousKV
    from hetero.model.forward_batch import ForwardBatch
    from hetero.model.llama import LlamaModel
    from hetero.synth import write_synthetic

    path = write_synthetic(tmp_path / "q.gguf", "tiny-qwen2", "q8_0", progress=False)
    gm, rt = load_gguf(path), RuntimeConfig(weights="dense")
    full = LlamaModel(gm, rt)
    parts = [LlamaModel(gm, rt, range(a, b)) for a, b in ((0, 1), (1, 2), (2, 3))]
    assert parts[0].lm_head is None and parts[1].embed is None and parts[1].norm is None
    assert parts[2].embed is not None  # tied lm_head: the last stage keeps the table
    tokens = torch.tensor([1, 50, 60, 70, 80])

    def batch():
        kv = ContiguousKV(gm.config, 8, torch.float32)
        kv.begin(len(tokens))
        return ForwardBatch(torch.arange(len(tokens)), torch.tensor([2, 4]), kv)

    want = full(tokens, batch())
    b = batch()
    h = parts[0](tokens, b)
    assert h.shape == (5, gm.config.d_model)
    h = parts[1](tokens, b, h)
    got = parts[2](tokens, b, h)
    assert torch.equal(got, want)
