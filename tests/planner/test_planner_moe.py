"""The planner on mixture-of-experts models: expert bytes apart from the rest, experts priced by
the ones a step reads, experts in RAM (--cpu-moe, --n-cpu-moe N, or chosen by the planner when
the GPUs cannot hold the model), and the options refused clearly where they cannot apply.
Made-up profiles (tests/planner/test_planner.py's), `hetero synth` shapes."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from hetero.cli import main
from hetero.planner.cost import DeviceCost
from hetero.planner.model_desc import describe
from hetero.planner.placement import _place_with
from hetero.planner.plan import Plan, PlanConfig, PlanError, plan
from hetero.planner.report import format_plan
from tests.planner.test_planner import cpu, gpu

GiB = 2**30


@pytest.fixture(scope="module")
def a3b():
    return describe("synth:qwen3-30b-a3b:q4_k_m")


def test_expert_bytes_are_told_apart(a3b):
    cfg = a3b.config
    assert (cfg.n_experts, cfg.n_experts_used, cfg.d_ff_expert) == (128, 8, 768)
    experts = [t for layer in a3b.layers for t in layer if t.is_expert]
    assert len(experts) == 3 * 48
    assert {t.shape for t in experts} == {(128, 768, 2048), (128, 2048, 768)}
    assert a3b.expert_bytes() == sum(t.nbytes for t in experts)
    # Q4_K gate/up (0.5625 B/weight), Q4_K or Q6_K down: about 17.5 GB of the file's ~18.6
    assert 16e9 < a3b.expert_bytes() < 19e9 and a3b.expert_bytes() > 0.9 * a3b.file_bytes
    assert a3b.expert_bytes(range(10)) == sum(t.nbytes for t in experts[:30])
    assert describe("synth:qwen3-8b:q4_k_m").expert_bytes() == 0


def test_a_decode_step_reads_only_the_chosen_experts(a3b):
    c = DeviceCost(a3b, gpu("cuda:0", 1000, 80), "quant", "fp8")
    gate = next(t for t in a3b.layers[0] if t.name.endswith("ffn_gate_exps.weight"))
    one = c.linear_seconds(gate, 1)
    rate = gpu("cuda:0", 1000, 80).matmul["quant"]
    assert one == pytest.approx(8 * rate.seconds(gate.nbytes / 128, gate.params / 128, 1))
    # 64 tokens choosing 8 of 128 each touch nearly every expert: close to the whole tensor
    assert c.linear_seconds(gate, 64) > 10 * one


def test_n_cpu_moe_moves_those_experts_to_ram_and_prices_them_on_the_cpu(a3b):
    devices = [gpu("cuda:0", 1000, 24), cpu(64)]
    base = plan(a3b, devices, PlanConfig())
    moved = plan(a3b, devices, PlanConfig(n_cpu_moe=20))
    assert base.experts_in_ram == 0 and moved.experts_in_ram == 20
    assert moved.expert_device == "cpu" and moved.unused_devices == ()
    assert moved.expert_ram_bytes == a3b.expert_bytes(range(20))
    freed = base.stages[0].weight_bytes - moved.stages[0].weight_bytes
    assert freed == pytest.approx(a3b.expert_bytes(range(20)), rel=1e-9)
    assert moved.single_stream_tok_s < base.single_stream_tok_s  # the CPU's 60 GB/s
    lines = format_plan(moved).splitlines()
    assert any(line.startswith("experts: layers 0-19 in RAM on cpu") for line in lines)
    assert "experts: with their layers" in format_plan(base)
    again = Plan.from_json(moved.to_json())
    assert (again.experts_in_ram, again.expert_ram_bytes) == (20, moved.expert_ram_bytes)
    every = plan(a3b, devices, PlanConfig(cpu_moe=True))
    assert every.experts_in_ram == 48 and "every layer's" in format_plan(every)


def test_a_card_too_small_gets_the_fewest_experts_in_ram(a3b):
    """12 GiB cannot hold the 18.6 GB model: the planner keeps the experts of the fewest first
    layers in RAM rather than running the last layers on the CPU, which is slower here."""
    devices = [gpu("cuda:0", 400, 12), cpu(64)]
    p = plan(a3b, devices, PlanConfig())
    n = p.experts_in_ram
    assert 0 < n < 48 and [s.device for s in p.stages] == ["cuda:0"]
    assert any(f"--n-cpu-moe {n}" in note for note in p.notes)
    with pytest.raises(PlanError):
        plan(a3b, devices, PlanConfig(n_cpu_moe=n - 1))
    spilled, _ = _place_with(a3b, devices, PlanConfig(), 8192, 0)  # the last layers on the CPU
    assert spilled is not None and spilled.stages[-1].device == "cpu"
    assert spilled.aggregate_tok_s < p.aggregate_tok_s


def test_bad_expert_placements_are_refused_clearly(a3b):
    devices = [gpu("cuda:0", 1000, 24), cpu(64)]
    with pytest.raises(PlanError, match="--n-cpu-moe 49: the model has only 48 layers"):
        plan(a3b, devices, PlanConfig(n_cpu_moe=49))
    with pytest.raises(PlanError, match="has no experts"):
        plan(describe("synth:qwen3-8b:q4_k_m"), devices, PlanConfig(cpu_moe=True))
    with pytest.raises(PlanError, match="need a CPU among the devices"):
        plan(a3b, devices[:1], PlanConfig(n_cpu_moe=4))
    with pytest.raises(PlanError, match=r"take \d+\.\d+ GB; cpu's RAM has"):
        plan(a3b, [devices[0], cpu(8)], PlanConfig(cpu_moe=True))
    with pytest.raises(ValueError, match="not both"):
        PlanConfig(cpu_moe=True, n_cpu_moe=3)


def test_command_line_validates_the_options():
    runner = CliRunner()
    out = runner.invoke(
        main,
        ["plan", "synth:qwen3-30b-a3b", "--devices", "rtx4090,desktop-ddr5", "--n-cpu-moe", "12"],
    )
    assert out.exit_code == 0, out.output
    assert "experts: layers 0-11 in RAM on desktop-ddr5" in out.output
    bad = runner.invoke(main, ["plan", "synth:qwen3-30b-a3b", "--devices", "rtx4090,desktop-ddr5",
                               "--n-cpu-moe", "60"])  # fmt: skip
    assert bad.exit_code != 0 and "the model has only 48 layers" in bad.output
    neg = runner.invoke(main, ["plan", "synth:qwen3-30b-a3b", "--n-cpu-moe", "-1"])
    assert neg.exit_code != 0 and "-1" in neg.output


def test_a_gguf_header_describes_its_experts_as_the_shape_does(tmp_path):
    from hetero.synth import write_synthetic

    path = write_synthetic(tmp_path / "m.gguf", "tiny-gpt-oss", "mxfp4_moe", progress=False)
    header, shape = describe(str(path)), describe("synth:tiny-gpt-oss:mxfp4_moe")
    assert header.expert_bytes() == shape.expert_bytes() > 0
    assert header.config.n_experts == shape.config.n_experts == 8
    assert header.config.swa_layers == shape.config.swa_layers == (True, False)
    assert {t.ggml_type for layer in header.layers for t in layer if t.is_expert} == {"MXFP4"}


def test_an_automatic_placement_runs_its_experts_in_ram():
    """hetero-serve with nothing asked, a MoE model too big for the card: the one-process plan
    keeps the first layers' experts in RAM, and the launch runs them there (--n-cpu-moe)."""
    from hetero.factory import LaunchConfig
    from hetero.launch import _running
    from hetero.planner.specs import load_spec

    card = load_spec("rtx3060").replace(id="cuda:0")
    host = load_spec("desktop-ddr5").replace(id="cpu")
    p = plan(describe("synth:qwen3-30b-a3b:q4_k_m"), [card, host], PlanConfig(in_process=True))
    assert p.in_process and p.experts_in_ram > 0 and [s.device for s in p.stages] == ["cuda:0"]
    rt = _running(LaunchConfig(), p, "test").runtime
    assert (rt.device, rt.n_gpu_layers, rt.n_cpu_moe) == ("cuda:0", None, p.experts_in_ram)


def test_a_pipeline_plan_runs_its_experts_in_ram(a3b, tmp_path):
    """Two GPUs too small for the model, as pipeline stages: the plan keeps the first layers'
    experts in RAM, and each stage (from the plan, or from its saved file as a stage on another
    host reads it) runs with those layers' experts on its host's CPU."""
    from hetero.config import PipelineConfig, RuntimeConfig
    from hetero.engine.config import EngineConfig
    from hetero.launch import resolve_stages
    from hetero.pipeline.stages import stages_from_plan
    from hetero.pipeline.worker import StageArgs, stage_runtime

    devices = [gpu("cuda:0", 1000, 8), gpu("cuda:1", 1000, 8), cpu(64)]
    p = plan(a3b, devices, PlanConfig())
    assert not p.in_process and [s.device for s in p.stages] == ["cuda:0", "cuda:1"]
    n = p.experts_in_ram
    assert 0 < n < p.stages[0].layer_end and p.expert_device == "cpu"
    path = tmp_path / "plan.json"
    path.write_text(p.to_json())
    for stages in (
        stages_from_plan(p, 48),
        resolve_stages("m.gguf", 48, PipelineConfig(plan=str(path))),
    ):
        assert [s.n_cpu_moe for s in stages] == [n, n]
        args = StageArgs(
            0, tuple(stages), "", "m.gguf", RuntimeConfig(), EngineConfig(), PipelineConfig()
        )
        rt = stage_runtime(args)
        assert (rt.device, rt.cpu_moe, rt.n_cpu_moe) == ("cuda:0", False, n)
    # a plan with no experts in RAM leaves the runtime's options as asked
    asked = RuntimeConfig(cpu_moe=True)
    plain = stages_from_plan(plan(a3b, [gpu("cuda:0", 1000, 80)], PlanConfig()), 48)
    assert plain[0].n_cpu_moe is None
    args = StageArgs(0, tuple(plain), "", "m.gguf", asked, EngineConfig(), PipelineConfig())
    assert stage_runtime(args).cpu_moe


def test_gpt_oss_window_layers_need_half_the_kv_a_block():
    """gpt-oss-20b's 12 window layers share the KV block's layer slots with its 12 full ones
    (engine/kv_groups.py): a block costs 12 layers, not 24, so the pool holds twice the
    blocks; a sequence holds every block of its context for the full layers and a window's
    worth for the others, so about twice the 32k-token sequences fit."""
    import dataclasses

    from hetero.planner.cost import seq_blocks

    windowed = describe("synth:gpt-oss-20b:mxfp4_moe")
    assert windowed.config.sliding_window == 128
    dense = dataclasses.replace(
        windowed, config=dataclasses.replace(windowed.config, swa_layers=(), sliding_window=0)
    )
    config = PlanConfig(context=32768, concurrency=16)
    w, d = (plan(m, [gpu("cuda:0", 4000, 141)], config) for m in (windowed, dense))
    per_block = [p.stages[0].kv_bytes // p.stages[0].num_kv_blocks for p in (w, d)]
    assert 2 * per_block[0] == per_block[1]
    # the same bytes in half-size blocks, less the window pool's null block
    assert w.num_kv_blocks in (2 * d.num_kv_blocks - 1, 2 * d.num_kv_blocks)
    blocks = seq_blocks(windowed, 32768, config.engine)
    assert blocks == 2048 + 8 + (16 + 2048 - 2) // 16 + 1  # the window's 8, a step's 129, 1
    assert w.max_concurrency == w.num_kv_blocks // blocks
    assert d.max_concurrency == d.num_kv_blocks // 2048
    assert 1.8 < w.max_concurrency / d.max_concurrency < 2.0


def test_prompts_stream_the_ram_experts_to_the_gpu(a3b):
    """With the experts in RAM, a prompt step of offload_min_tokens or more streams them to the
    GPU (execution/offload_experts.py): each layer costs the slower of its experts' copy over
    the host link and their multiply there, not the CPU's multiply; decode still multiplies on
    the CPU, and offload_min_tokens=0 prices the CPU for prompts too."""
    devices = [gpu("cuda:0", 1000, 24), cpu(64)]
    streamed = plan(a3b, devices, PlanConfig(cpu_moe=True, prompt_len=512))
    on_cpu = plan(a3b, devices, PlanConfig(cpu_moe=True, prompt_len=512, offload_min_tokens=0))
    assert streamed.experts_in_ram == on_cpu.experts_in_ram == 48
    assert streamed.single_stream_tok_s == pytest.approx(on_cpu.single_stream_tok_s)
    # at least the copy of every layer's experts over the 25 GB/s link; well under the CPU
    crossing = a3b.expert_bytes() / 25e9
    assert crossing <= streamed.ttft_s < 0.5 * on_cpu.ttft_s
    setup = _place_with(a3b, devices, PlanConfig(cpu_moe=True), 4096, 48)[1]
    layer = setup.costs[0]._layer_matmuls
    assert layer(0, 512) >= a3b.expert_bytes(range(1)) / 25e9  # streamed: the copy at least
    # the CPU multiplies a step too small for the experts' copy (fewer than 8 rows an expert),
    # or any step when offload_min_tokens is 0
    assert layer(0, 127) < layer(0, 128)
    off = _place_with(a3b, devices, PlanConfig(cpu_moe=True, offload_min_tokens=0), 4096, 48)
    on_the_cpu = off[1].costs[0]._layer_matmuls
    assert on_the_cpu(0, 127) == layer(0, 127) and on_the_cpu(0, 512) > layer(0, 512)


def test_graphs_stop_below_the_first_streamed_prompt_step(a3b):
    """The engine captures no step that streams the RAM experts (execution/local.py caps its
    graphs' rows below the first one): the planner prices such prompt steps eagerly, and those
    below, or any step of a plan without experts in RAM, as replays."""
    devices = [gpu("cuda:0", 1000, 24), cpu(64)]
    ram = _place_with(a3b, devices, PlanConfig(cpu_moe=True), 4096, 48)[1]
    assert ram._replays_prompt(0, 127, 0, 1) and not ram._replays_prompt(0, 128, 0, 1)
    never = _place_with(a3b, devices, PlanConfig(cpu_moe=True, offload_min_tokens=0), 4096, 48)
    assert never[1]._replays_prompt(0, 256, 0, 1)  # nothing streams: graphs up to 512 rows
    whole = _place_with(a3b, [gpu("cuda:0", 1000, 80), cpu(64)], PlanConfig(), 4096, 0)[1]
    assert whole._replays_prompt(0, 256, 0, 1)
