"""The cost model follows what the engine runs: the matmul kernel at each batch size, CUDA-graph
buckets for decode, eager host overheads for prefill. Made-up profiles, hand-computed numbers."""

from __future__ import annotations

import pytest

from hetero.engine.config import EngineConfig
from hetero.planner.cost import DeviceCost, kv_token_bytes
from hetero.planner.device import DeviceProfile, MatmulRate
from hetero.planner.model_desc import describe
from hetero.planner.plan import PlanConfig, plan

GiB = 2**30


def rate() -> MatmulRate:
    # 100 GB/s at T = 1, 50 at T = 4 (a slower batched kernel), 1 TFLOP/s at T = 64
    return MatmulRate("k", 100.0, 1.0, ((4, 50.0),), 64)


def test_matmul_time_follows_the_measured_curve():
    r, nbytes, params = rate(), 1e6, 2e6
    assert r.seconds(nbytes, params, 1) == pytest.approx(1e6 / 100e9)
    assert r.seconds(nbytes, params, 4) == pytest.approx(1e6 / 50e9)
    # halfway (in T) between the T = 1 and T = 4 points
    assert r.seconds(nbytes, params, 2) == pytest.approx(1e-5 + (2e-5 - 1e-5) / 3)
    at64 = 2 * 64 * params / 1e12
    assert r.seconds(nbytes, params, 34) == pytest.approx(2e-5 + (at64 - 2e-5) * 30 / 60)
    assert r.seconds(nbytes, params, 128) == pytest.approx(2 * 128 * params / 1e12)
    # without a curve: the two-ceiling roofline, as datasheet profiles have it
    flat = MatmulRate("k", 100.0, 1.0)
    assert flat.seconds(nbytes, params, 4) == pytest.approx(max(1e-5, 8 * params / 1e12))


def test_a_matrix_streams_at_the_rate_measured_nearest_its_size():
    # 100 GB/s measured on a 32 MB matrix, 50 at T = 1 on a 4 MB one (a CPU's profile)
    r = MatmulRate("k", 100.0, 1.0, ((4, 50.0),), 64, (4e6, 50.0, 32e6))
    assert r.seconds(64e6, 1e6, 1) == pytest.approx(64e6 / 100e9)  # larger: the main rate
    assert r.seconds(2e6, 1e6, 1) == pytest.approx(2e6 / 50e9)  # smaller: the small one's
    mid = 4e6 * 8**0.5  # halfway in log(bytes): the geometric mean of the two rates
    assert r.seconds(mid, 1e6, 1) == pytest.approx(mid / (50e9 * 2**0.5))
    # the curve's batched points slow down by the same factor; the prefill point does not
    assert r.seconds(2e6, 1e6, 4) == pytest.approx(2 * 2e6 / 50e9)
    assert r.seconds(2e6, 1e6, 128) == pytest.approx(2 * 128 * 1e6 / 1e12)
    # a share of the device scales the small matrix's rate too, and JSON brings it back
    assert r.scaled(0.5, 1.0).seconds(2e6, 1e6, 1) == pytest.approx(2 * 2e6 / 50e9)
    cpu = gpu(id="cpu", kind="cpu", matmul={"qdot": r}, compute_capability="")
    assert DeviceProfile.from_dict(cpu.to_dict()).matmul["qdot"] == r


def gpu(**over) -> DeviceProfile:
    """A made-up H200-like card: prefill of 128 tokens of an 8B model is ~5 ms of matmuls."""
    fast = MatmulRate("k", 2000.0, 400.0, ((4, 1000.0),), 2048)
    fields = dict(
        id="cuda:0", kind="cuda", name="test", memory_total=80 * GiB, memory_free=80 * GiB,
        mem_bw_gbs=3000.0, bf16_tflops=500.0, matmul={"quant": fast, "dense": fast},
        attn_gbs=1000.0, step_overhead_s=1e-4, layer_overhead_s=1e-5, seq_overhead_s=1e-6,
        eager_step_overhead_s=2e-3, eager_layer_overhead_s=5e-4, compute_capability="9.0",
        fp8_kv=True,
    )  # fmt: skip
    return DeviceProfile(**{**fields, **over})


def test_profile_round_trips_with_curves_and_eager_overheads():
    d = gpu()
    assert DeviceProfile.from_dict(d.to_dict()) == d


@pytest.fixture(scope="module")
def llama8b():
    return describe("synth:llama3-8b:q4_k_m")


def test_graph_replayed_decode_runs_its_bucket(llama8b):
    c = DeviceCost(llama8b, gpu(), "quant", "fp8", graphs=True, max_num_seqs=16)
    assert [c.decode_rows(m) for m in (1, 3, 5, 16, 17)] == [1, 4, 8, 16, None]
    kv = kv_token_bytes(llama8b, "fp8") * 100 / 1000e9
    # 5 sequences run 8 rows: the same matmuls and per-row overheads, 3 sequences' fewer KV reads
    five, eight = c.decode_layer_seconds(5, 100), c.decode_layer_seconds(8, 100)
    assert five[0] == pytest.approx(eight[0] - 3 * kv)
    assert not c.eager(16) and c.eager(17)  # past the largest bucket the engine runs eagerly


def test_eager_steps_take_the_longer_of_host_and_device_on_a_gpu(llama8b):
    c = DeviceCost(llama8b, gpu(), "quant", "fp8")
    host = 2e-3 + 32 * 5e-4
    assert c.step_seconds(32, 1e-3, True) == pytest.approx(host)
    assert c.step_seconds(32, 0.1, True) == pytest.approx(0.1)
    assert c.step_seconds(32, 0.1, False) == pytest.approx(0.1 + 1e-4)
    cpu = DeviceCost(llama8b, gpu(id="cpu", kind="cpu"), "dense", "fp16")
    assert cpu.step_seconds(32, 0.1, True) == pytest.approx(0.1 + host)


def test_plan_prices_short_prompts_as_replayed_and_long_ones_eagerly(llama8b):
    """A 128-token prompt replays a graph (cuda_graph_max_tokens 512): no eager host time; with
    the option at 0, or a 2048-token prompt (past the rows and the row-context budget), the
    prefill step pays the host's launches. Decode replays either way unless --enforce-eager."""
    host = 2e-3 + 32 * 5e-4
    cfg = dict(concurrency=1, context=4096, prompt_len=128)
    graphed = plan(llama8b, [gpu()], PlanConfig(**cfg))
    no_prompt_graphs = plan(
        llama8b, [gpu()], PlanConfig(**cfg, engine=EngineConfig(cuda_graph_max_tokens=0))
    )
    eager = plan(llama8b, [gpu()], PlanConfig(**cfg, engine=EngineConfig(enforce_eager=True)))
    assert graphed.ttft_s < host <= no_prompt_graphs.ttft_s
    assert eager.ttft_s >= host
    slow_host = gpu(eager_layer_overhead_s=5e-3)  # launches outlast the device's work
    long = plan(llama8b, [slow_host], PlanConfig(**{**cfg, "prompt_len": 2048}))
    assert long.ttft_s >= 2e-3 + 32 * 5e-3  # eager: its host time counts
    short = plan(llama8b, [slow_host], PlanConfig(**cfg))
    assert short.ttft_s == pytest.approx(graphed.ttft_s)  # replayed: no eager host time
    assert eager.single_stream_tok_s < graphed.single_stream_tok_s
    (s,) = eager.stages
    assert s.single_step_s >= host


def test_pipeline_stages_replay_graphs_unless_eager(llama8b):
    """A split over two processes: each stage replays its decode graphs as one process does
    (no eager host time); under --enforce-eager each pays its host time, and the slow host of
    cuda:1 gets few layers."""
    a, b = gpu(), gpu(id="cuda:1", eager_layer_overhead_s=2e-3)
    cfg = dict(concurrency=1, context=512, use_all_devices=True)
    graphed = plan(llama8b, [a, b], PlanConfig(**cfg))
    eager = plan(llama8b, [a, b], PlanConfig(**cfg, engine=EngineConfig(enforce_eager=True)))
    for s in eager.stages:
        per_layer = 5e-4 if s.device == "cuda:0" else 2e-3
        assert s.single_step_s >= 2e-3 + s.n_layers * per_layer
    assert eager.stages[0].n_layers > eager.stages[1].n_layers
    for s in graphed.stages:
        assert s.single_step_s < 2e-3 + s.n_layers * 5e-4
    assert graphed.single_stream_tok_s > eager.single_stream_tok_s


def test_calibration_with_the_gpu_settings_batched_attention_pair_runs_on_the_cpu():
    """The GPU calibration measures attention at 8 sequences (not 1): the same code on the CPU,
    on the tiny shape and a short context so that it takes seconds."""
    import math

    from hetero.planner.specs import load_spec
    from hetero.profiler.calibrate import _Setting, calibrate

    prof = load_spec("desktop-ddr5").replace(id="cpu")
    got = calibrate(prof, "cpu", "fp16", setting=_Setting({}, 8, 96, 256))
    assert set(got) == {
        "step_overhead_s", "layer_overhead_s", "seq_overhead_s", "seq_step_overhead_s",
        "attn_gbs", "eager_step_overhead_s", "eager_layer_overhead_s", "pipeline_hop_s",
    }  # fmt: skip
    assert all(math.isfinite(v) and v >= 0 for v in got.values()) and got["attn_gbs"] > 0
    # a prefill step and a decode step on a real engine are not free
    assert got["eager_step_overhead_s"] + got["eager_layer_overhead_s"] > 0
    assert got["step_overhead_s"] + got["layer_overhead_s"] > 0
    # "pipeline_hop_s" is in the set above: two stage processes ran (the CPU only). Its value is
    # a difference of two noisy step times and may read 0 on a loaded 2-core machine.


def test_a_pipeline_boundary_costs_each_side_half_the_hosts_hop(llama8b):
    from hetero.planner.placement import place_split

    cfg, ranges = PlanConfig(concurrency=2), [(0, 16), (16, 32)]
    devs = [gpu(id="cuda:0"), gpu(id="cuda:1")]
    base = place_split(llama8b, [d.replace(pipeline_hop_s=0.0) for d in devs], cfg, ranges)
    hop = place_split(llama8b, [d.replace(pipeline_hop_s=2e-3) for d in devs], cfg, ranges)
    for a, b in zip(base.stages, hop.stages):
        assert b.single_step_s == pytest.approx(a.single_step_s + 1e-3)
        assert b.predicted_step_s == pytest.approx(a.predicted_step_s + 1e-3)
    # one stream pays the whole hop a token; one stage alone pays none
    assert 1 / hop.single_stream_tok_s == pytest.approx(1 / base.single_stream_tok_s + 2e-3)
    alone = place_split(llama8b, [devs[0].replace(pipeline_hop_s=2e-3)], cfg, [(0, 32)])
    none = place_split(llama8b, [devs[0].replace(pipeline_hop_s=0.0)], cfg, [(0, 32)])
    assert alone.stages[0].single_step_s == none.stages[0].single_step_s


def test_gpus_and_their_shares_take_the_hosts_hop_from_the_cpu_profile():
    from hetero.planner.specs import load_spec
    from hetero.profiler.machine import host_hop_s

    cpu = load_spec("desktop-ddr5").replace(id="cpu", pipeline_hop_s=1.7e-3)
    gpus = [gpu(id="cuda:0").replace(pipeline_hop_s=0.0)]
    assert host_hop_s(gpus + [cpu]) == 1.7e-3
    assert host_hop_s(gpus) == 0.0  # no CPU profiled: nothing measured the hand-off


def test_a_part_of_a_joined_matrix_streams_at_the_joined_matrix_rate(llama8b):
    # a rate that is 2x slower below 100 MB: the 8B's gate and up (33 MB each) run joined (66 MB)
    cpu = gpu(
        id="cpu", kind="cpu", compute_capability="",
        matmul={"qdot": MatmulRate("k", 100.0, 1.0, (), 0, (10e6, 50.0, 100e6))},
    )  # fmt: skip
    c = DeviceCost(llama8b, cpu, "qdot", "fp16")
    gate = next(t for t in llama8b.layers[0] if t.name.endswith("ffn_gate.weight"))
    nbytes = c._bytes(gate)
    alone = cpu.matmul["qdot"].seconds(nbytes, gate.params, 1)
    joined = c.linear_seconds(gate, 1, 0)
    assert joined < alone
    assert joined == pytest.approx(cpu.matmul["qdot"].seconds(nbytes, gate.params, 1, 2 * nbytes))


def test_prompt_attention_runs_at_its_own_rate_where_measured(llama8b):
    n, h, dd = 512, llama8b.config.n_heads, llama8b.config.head_dim
    flops = 4.0 * n * (n / 2) * h * dd
    plain, timed = gpu(), gpu(attn_tflops=50.0)  # bf16_tflops 500
    layer = DeviceCost(llama8b, plain, "quant", "fp8").prefill_layer_seconds(n, 0)[0]
    slower = DeviceCost(llama8b, timed, "quant", "fp8").prefill_layer_seconds(n, 0)[0]
    assert slower - layer == pytest.approx(flops / 50e12 - flops / 500e12)


def test_the_offloaded_layer_calibration_runs_the_streamed_split(tmp_path):
    """calibrate.offload_ttft_s: the -ngl 1 split of a small model in one process, its prompt
    step streaming the CPU layers' matmuls (here to the CPU itself, the same code a GPU runs);
    the factory's split_on builds it."""
    import dataclasses

    from hetero.config import RuntimeConfig
    from hetero.engine.config import EngineConfig
    from hetero.factory import LaunchConfig, assemble
    from hetero.profiler.calibrate import OFFLOAD_PROMPT, offload_ttft_s
    from hetero.sampling import SamplingParams
    from hetero.synth import write_synthetic
    from hetero.synth_shapes import get_shape

    shape = dataclasses.replace(get_shape("tiny-llama"), n_layers=3)
    path = write_synthetic(tmp_path / "t3.gguf", shape, "q8_0", progress=False)
    assert offload_ttft_s(path, "cpu", "fp16", 128) > 0
    rt = RuntimeConfig(device="cpu", n_gpu_layers=1, offload_min_tokens=32)
    engine = assemble(path, LaunchConfig(EngineConfig(num_kv_blocks=64), rt), split_on="cpu")
    try:
        assert [len(s.model.blocks) for s in engine.executor.segments] == [1, 2]
        params = SamplingParams(temperature=0, max_tokens=1)
        engine.add_request("r", list(range(5, 5 + OFFLOAD_PROMPT)), params)
        while engine.has_unfinished():
            engine.step()
        # both segments are on the CPU here, so all three layers stream, four matmuls each
        assert engine.executor.offload.calls == 3 * 4
    finally:
        engine.close()


@pytest.mark.gpu
def test_the_calibration_leaves_the_gpu_as_it_found_it(tmp_path):
    """The small models' engines of a GPU's calibration (the -ngl 1 split's too) give their
    memory back: the engine hetero-serve builds next in the same process, under a memory cap,
    has the whole of it (their weights sat in reference cycles until the collector ran)."""
    from hetero.planner.specs import load_spec
    from hetero.profiler.calibrate import GPU_SHAPE, _Setting, calibrate

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.init()
    before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    prof = load_spec("rtx4090").replace(id="cuda:0")
    got = calibrate(prof, "cuda:0", "fp16", setting=_Setting(GPU_SHAPE, 2, 256, 256))
    assert got["offload_layer_overhead_s"] >= 0
    # (cuBLAS's workspace stays: 32 MiB on a Hopper GPU)
    assert torch.cuda.memory_allocated() - before[0] < 40 << 20
    assert torch.cuda.memory_reserved() - before[1] < 64 << 20


def test_an_offloaded_layers_calibrated_overhead_is_part_of_its_prompt_time(llama8b):
    """A card too small for the 8B beside the host, in one process: each CPU layer of a
    prompt step pays the profile's offloaded-layer overhead (its weights' copy hidden here)."""
    from hetero.planner.specs import load_spec

    host = load_spec("desktop-ddr5").replace(id="cpu")
    card = gpu(memory_total=4 * GiB, memory_free=4 * GiB, h2d_gbs=1000.0, d2h_gbs=1000.0)
    cfg = PlanConfig(context=2048, in_process=True, prompt_len=512)
    base = plan(llama8b, [card, host], cfg)
    slow = plan(llama8b, [card.replace(offload_layer_overhead_s=2e-3), host], cfg)
    cpu_layers = 32 - base.stages[0].layer_end
    assert cpu_layers > 0 and slow.stages[0].layer_end == base.stages[0].layer_end
    assert slow.ttft_s == pytest.approx(base.ttft_s + cpu_layers * 2e-3, rel=1e-6)
