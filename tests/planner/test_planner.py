"""The planner as a pure function: made-up device profiles, real model descriptions."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hetero.engine.config import EngineConfig
from hetero.planner.cost import DeviceCost, kv_token_bytes
from hetero.planner.device import DeviceProfile, MatmulRate
from hetero.planner.model_desc import describe, from_gguf
from hetero.planner.plan import Plan, PlanConfig, PlanError, plan

GiB = 2**30


def gpu(dev_id: str, bw: float, mem_gib: float, fp8: bool = True) -> DeviceProfile:
    """A made-up GPU whose speed is set by its bandwidth (GB/s)."""
    return DeviceProfile(
        id=dev_id,
        kind="cuda",
        name=f"test gpu {bw:g} GB/s",
        memory_total=int(mem_gib * GiB),
        memory_free=int(mem_gib * GiB),
        mem_bw_gbs=bw,
        bf16_tflops=bw / 10,
        matmul={
            "quant": MatmulRate("triton", bw * 0.5, bw / 20),
            "dense": MatmulRate("torch", bw * 0.8, bw / 10),
        },
        attn_gbs=bw * 0.3,
        h2d_gbs=25.0,
        d2h_gbs=25.0,
        link_latency_s=1e-5,
        step_overhead_s=2e-4,
        layer_overhead_s=2e-5,
        seq_overhead_s=1e-6,
        compute_capability="8.9" if fp8 else "8.6",
        fp8_kv=fp8,
    )


def cpu(mem_gib: float = 64) -> DeviceProfile:
    return DeviceProfile(
        id="cpu",
        kind="cpu",
        name="test cpu",
        memory_total=int(mem_gib * GiB),
        memory_free=int(mem_gib * GiB),
        mem_bw_gbs=60.0,
        bf16_tflops=1.0,
        matmul={"fp16": MatmulRate("fbgemm-fp16", 40.0, 0.5), "dense": MatmulRate("torch", 45, 1)},
        attn_gbs=10.0,
        step_overhead_s=1e-3,
        layer_overhead_s=1e-4,
        fp8_kv=False,
    )


@pytest.fixture(scope="module")
def llama8b():
    return describe("synth:llama3-8b:q4_k_m")  # 4.9 GB of weights, described without writing


def covers(p: Plan, n_layers: int) -> None:
    """Stages are contiguous, in order, and hold every layer once."""
    start = 0
    for s in p.stages:
        assert s.layer_start == start and s.layer_end > s.layer_start
        start = s.layer_end
    assert start == n_layers


def test_fast_and_slow_card_get_balanced_stage_times(llama8b):
    fast, slow = gpu("cuda:0", 2000, 32), gpu("cuda:1", 1000, 24)
    cfg = PlanConfig(concurrency=16, use_all_devices=True, context=4096)
    p = plan(llama8b, [fast, slow], cfg)
    covers(p, 32)
    a, b = p.stages
    assert a.n_layers > b.n_layers  # the card with twice the bandwidth takes more layers
    assert 1.6 < a.n_layers / b.n_layers < 2.6
    # balanced: moving one layer cannot bring the two stage times closer than they are
    one_layer = max(a.predicted_step_s / a.n_layers, b.predicted_step_s / b.n_layers)
    assert abs(a.predicted_step_s - b.predicted_step_s) <= one_layer
    assert p.microbatches == 2
    assert p.aggregate_tok_s == pytest.approx(
        16 / (2 * max(a.predicted_step_s, b.predicted_step_s))
    )


def test_one_stream_stays_on_the_fastest_card_that_holds_it(llama8b):
    p = plan(llama8b, [gpu("cuda:0", 1000, 24), gpu("cuda:1", 2000, 32)], PlanConfig(context=4096))
    assert [s.device for s in p.stages] == ["cuda:1"]
    assert p.unused_devices == ("cuda:0",)
    assert p.single_stream_tok_s == pytest.approx(1 / p.stages[0].single_step_s)


def test_small_memory_card_gets_few_layers(llama8b):
    big, small = gpu("cuda:0", 1000, 24), gpu("cuda:1", 1000, 2.0)
    cfg = PlanConfig(concurrency=8, use_all_devices=True, context=2048)
    p = plan(llama8b, [big, small], cfg)
    covers(p, 32)
    a, b = p.stages
    assert b.n_layers < a.n_layers
    assert b.weight_bytes + b.kv_bytes + b.activation_bytes <= b.memory_budget
    # the small card is full: one more layer would not fit beside its weights, KV and activations
    cost = DeviceCost(llama8b, small, b.weights, b.kv_dtype)
    per_layer_kv = kv_token_bytes(llama8b, b.kv_dtype) * 2048 * 8 / cfg.engine.kv_memory_fraction
    more = cost.weights_bytes(b.layer_start - 1, 32, False, True) + (b.n_layers + 1) * per_layer_kv
    assert more + b.activation_bytes > b.memory_budget


def test_model_larger_than_all_vram_spills_last_layers_to_cpu(llama8b):
    gpus = [gpu("cuda:0", 1000, 2.5), gpu("cuda:1", 1000, 2.5)]
    p = plan(llama8b, [*gpus, cpu()], PlanConfig(context=2048))
    covers(p, 32)
    assert p.stages[-1].device == "cpu" and p.stages[-1].layer_end == 32
    assert {s.device for s in p.stages[:-1]} == {"cuda:0", "cuda:1"}
    assert p.stages[-1].weights in ("fp16", "dense")
    assert any("CPU" in n for n in p.notes)
    # and with enough VRAM the CPU takes nothing
    roomy = plan(llama8b, [gpu("cuda:0", 1000, 24), cpu()], PlanConfig(context=2048))
    assert [s.device for s in roomy.stages] == ["cuda:0"] and roomy.unused_devices == ("cpu",)


def test_kv_blocks_follow_the_memory_left(llama8b):
    cfg = PlanConfig(concurrency=4, use_all_devices=True, context=2048)
    p = plan(llama8b, [gpu("cuda:0", 1000, 24), gpu("cuda:1", 1000, 12)], cfg)
    for s in p.stages:
        per_block = kv_token_bytes(llama8b, s.kv_dtype) * s.n_layers * cfg.engine.block_size
        left = s.memory_budget - s.weight_bytes - s.activation_bytes
        assert s.kv_room_blocks == int(left * cfg.engine.kv_memory_fraction // per_block)
        assert s.num_kv_blocks == min(x.kv_room_blocks for x in p.stages)  # one block manager
        assert s.kv_bytes == s.num_kv_blocks * per_block
    more = plan(llama8b, [gpu("cuda:0", 1000, 40), gpu("cuda:1", 1000, 24)], cfg)
    assert more.num_kv_blocks > p.num_kv_blocks
    assert more.max_concurrency > p.max_concurrency
    assert p.max_concurrency == p.num_kv_blocks // (2048 // cfg.engine.block_size)


def test_fp8_kv_only_where_the_device_has_fp8(llama8b):
    cfg = PlanConfig(concurrency=16, use_all_devices=True, context=2048)
    p = plan(llama8b, [gpu("cuda:0", 1000, 24, fp8=True), gpu("cuda:1", 900, 24, fp8=False)], cfg)
    assert [s.kv_dtype for s in p.stages] == ["fp8", "fp16"]
    assert p.stages[1].kernels["qlinear"] == "triton"
    forced = plan(
        llama8b,
        [gpu("cuda:0", 1000, 24)],
        dataclasses.replace(cfg, engine=EngineConfig(kv_dtype="bf16")),
    )
    assert forced.stages[0].kv_dtype == "bf16"
    # a CPU keeps fp16 unless fp8 is asked for (stored in software there)
    one_cpu = dataclasses.replace(cfg, use_all_devices=False)
    assert plan(llama8b, [cpu()], one_cpu).stages[0].kv_dtype == "fp16"
    asked = dataclasses.replace(one_cpu, engine=EngineConfig(kv_dtype="fp8"))
    assert plan(llama8b, [cpu()], asked).stages[0].kv_dtype == "fp8"


def test_plans_are_deterministic_and_round_trip_json(llama8b, tmp_path):
    devs = [gpu("cuda:0", 1500, 16), gpu("cuda:1", 1000, 12), cpu()]
    cfg = PlanConfig(concurrency=8, use_all_devices=True, context=4096)
    p1, p2 = plan(llama8b, devs, cfg), plan(llama8b, devs, cfg)
    assert p1 == p2 and p1.to_json() == p2.to_json()
    assert Plan.from_json(p1.to_json()) == p1
    path = tmp_path / "plan.json"
    path.write_text(p1.to_json())
    loaded = Plan.load(path)
    assert loaded == p1 and isinstance(loaded.stages[0].kernels, dict)
    assert loaded.stages[0].device == "cuda:0" and loaded.stages[-1].device == "cpu"
    assert loaded.model_path == "synth:llama3-8b:q4_k_m"
    with pytest.raises(ValueError, match="not a version-1 hetero plan"):
        Plan.from_json('{"version": 99}')
    with pytest.raises(FileNotFoundError):
        Plan.load(tmp_path / "missing.json")


def test_refuses_a_model_that_fits_nowhere_by_how_much(llama8b):
    with pytest.raises(PlanError, match=r"fits nowhere.*short by (\d+\.\d+) GB") as err:
        plan(llama8b, [gpu("cuda:0", 1000, 2.0), gpu("cuda:1", 1000, 1.5)], PlanConfig())
    short = float(err.value.args[0].rsplit("short by ", 1)[1].split(" GB")[0])
    assert 0.5 < short < 4.9  # 4.9 GB of weights against ~2.3 GB offered


def test_refuses_a_context_that_cannot_fit(llama8b):
    cfg = PlanConfig(concurrency=64, context=8192)
    with pytest.raises(PlanError, match="max concurrency at context 8192 is") as err:
        plan(llama8b, [gpu("cuda:0", 1000, 8)], cfg)
    assert "GB of KV" in str(err.value)
    # the maxima it names are the largest that plan, over two devices too (whole blocks)
    for devs in ([gpu("cuda:0", 1000, 8)], [gpu("cuda:0", 1000, 8), gpu("cuda:1", 900, 6)]):
        with pytest.raises(PlanError) as err:
            plan(llama8b, devs, cfg)
        found = re.search(r"max context at concurrency 64 is (\d+), max concurrency at context "
                          r"8192 is (\d+)", str(err.value))  # fmt: skip
        ctx, conc = int(found[1]), int(found[2])
        assert ctx % 16 == 0 and conc >= 1
        plan(llama8b, devs, PlanConfig(concurrency=64, context=ctx))
        plan(llama8b, devs, PlanConfig(concurrency=conc, context=8192))
        with pytest.raises(PlanError):
            plan(llama8b, devs, PlanConfig(concurrency=64, context=ctx + 16))
        with pytest.raises(PlanError):
            plan(llama8b, devs, PlanConfig(concurrency=conc + 1, context=8192))
    with pytest.raises(PlanError, match="longer than the model's 8192"):
        plan(llama8b, [gpu("cuda:0", 1000, 80)], PlanConfig(context=100_000))
    with pytest.raises(PlanError, match="need 9100 tokens of context; the plan's context is 8192"):
        plan(llama8b, [gpu("cuda:0", 1000, 80)], PlanConfig(prompt_len=9000, output_len=100))
    with pytest.raises(PlanError, match="need 300 tokens of context; the plan's context is 100"):
        plan(
            llama8b,
            [gpu("cuda:0", 1000, 80)],
            PlanConfig(context=100, prompt_len=200, output_len=100),
        )
    with pytest.raises(PlanError, match="listed twice"):
        plan(llama8b, [gpu("cuda:0", 1000, 80)] * 2, PlanConfig())
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        PlanConfig(concurrency=0)


def test_check_devices_refuses_a_vanished_device(llama8b):
    p = plan(llama8b, [gpu("cuda:0", 1000, 24), gpu("cuda:1", 900, 24)],
             PlanConfig(concurrency=8, use_all_devices=True, context=1024))  # fmt: skip
    p.check_devices(["cuda:0", "cuda:1", "cpu"])
    with pytest.raises(PlanError, match="cuda:1, not present now"):
        p.check_devices(["cuda:0", "cpu"])


def test_description_from_the_gguf_header_matches_the_file(smollm2_path):
    d = from_gguf(str(smollm2_path))
    assert d.n_layers == 30 and d.config.d_model == 576 and d.output is None  # tied
    assert d.source == str(smollm2_path)
    header = smollm2_path.stat().st_size - d.file_bytes
    assert 0 < header < 8 << 20  # tensor data is the file but its header (and the vocabulary)
    synth = describe("synth:smollm2-135m:q4_1")
    shapes = {t.name: t.shape for t in d.layers[3]}
    assert synth.n_layers == 30 and {t.name: t.shape for t in synth.layers[3]} == shapes
    with pytest.raises(ValueError, match="unknown shape"):
        describe("synth:nope")


def _brute_force(n_dev, n_layers, c, fits, stage_s, use_all=False):
    """Every composition of the layers over the devices: the reference for the search."""
    import itertools

    best = None
    for cuts in itertools.combinations_with_replacement(range(n_layers + 1), n_dev - 1):
        bounds = (0, *cuts, n_layers)
        ranges = list(zip(bounds, bounds[1:]))
        used = [(i, a, b) for i, (a, b) in enumerate(ranges) if b > a]
        if (use_all and len(used) < n_dev) or not all(fits(i, a, b) for i, a, b in used):
            continue
        micro = min(c, len(used))
        m = -(-c // micro)
        times = [stage_s(i, a, b, m) for i, a, b in used]
        cycle = max(sum(times), micro * max(times))
        best = cycle if best is None else min(best, cycle)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_split_search_matches_brute_force(seed):
    import random

    from hetero.planner.search import search

    rng = random.Random(seed)
    n_dev, n_layers = rng.choice([2, 3]), rng.randint(3, 9)
    per_layer = [[rng.uniform(0.5, 3.0) for _ in range(n_layers)] for _ in range(n_dev)]
    fixed = [rng.uniform(0.0, 2.0) for _ in range(n_dev)]
    room = [rng.randint(1, n_layers) for _ in range(n_dev)]
    room[0] = n_layers if seed % 2 else room[0]

    def fits(i, a, b):
        return b - a <= room[i]

    def stage_s(i, a, b, m):
        return fixed[i] + m * sum(per_layer[i][a:b])

    for c in (1, 2, 5):
        for use_all in (False, True):
            want = _brute_force(n_dev, n_layers, c, fits, stage_s, use_all)
            got = search(n_dev, n_layers, c, fits, stage_s, use_all)
            if want is None:
                assert got is None
            else:
                # exact at c = 1 (sum) and c >= stages (slowest stage); between, within 25%
                assert got is not None and got.cycle_s >= want * (1 - 1e-9)
                assert got.cycle_s <= want * (1.0 if c == 1 or c >= n_dev else 1.25) + 1e-9


def test_equal_cards_fill_in_order_and_cpu_only_plans_say_nothing_of_gpus(llama8b):
    """Of two equal cards where one holds the model, the first is used (not the second, which
    ties); a pipeline over a CPU alone gets no note about GPUs that cannot hold the model."""
    p = plan(llama8b, [gpu("cuda:0", 1000, 24), gpu("cuda:1", 1000, 24)], PlanConfig())
    assert [s.device for s in p.stages] == ["cuda:0"] and p.unused_devices == ("cuda:1",)
    two = dataclasses.replace(cpu(), id="cpu#2")
    p = plan(llama8b, [cpu(), two], PlanConfig(concurrency=4, use_all_devices=True))
    assert len(p.stages) == 2 and not any("GPUs" in n for n in p.notes)
    spill = plan(llama8b, [gpu("cuda:0", 1000, 4), cpu()], PlanConfig())
    assert spill.stages[-1].device == "cpu" and any("GPUs cannot hold" in n for n in spill.notes)


def test_in_one_process_the_gpu_keeps_room_for_the_streamed_prompt_matmuls(llama8b):
    """A CPU layer's prompt matmuls run on the GPU in one process (execution/offload.py): the
    GPU holds a ring of staging buffers for their row slabs and a bf16 slab of rows beside its
    layers; not the general way's two whole parts (the 8B's gate|up, 66 MB in qdot blocks), their
    blocks, repack and whole bf16 part (117M weights), which Q4_K and Q6_K no longer take."""
    from hetero.execution.offload import RING_BYTES, SLAB_ELEMENTS

    host = dataclasses.replace(cpu(), matmul={**cpu().matmul, "qdot": MatmulRate("q", 50.0, 1.0)})
    card = gpu("cuda:0", 1000, 4)
    apart = plan(llama8b, [card, host], PlanConfig(context=2048))
    one = plan(llama8b, [card, host], PlanConfig(context=2048, in_process=True))
    off = plan(llama8b, [card, host], PlanConfig(context=2048, in_process=True,
                                                 offload_min_tokens=0))  # fmt: skip
    assert [s.device for s in one.stages] == ["cuda:0", "cpu"] and one.stages[1].weights == "qdot"
    gate_up = 2 * 14336 * 4096
    scratch = one.stages[0].activation_bytes - off.stages[0].activation_bytes
    staged = gate_up * 144 / 256
    assert RING_BYTES + 2 * SLAB_ELEMENTS <= scratch < 4 * staged + 2 * gate_up
    assert apart.stages[0].activation_bytes == off.stages[0].activation_bytes
    assert one.stages[0].layer_end < off.stages[0].layer_end  # the room comes from its layers
    assert one.stages[1].activation_bytes == off.stages[1].activation_bytes  # the CPU's own


def test_a_streamed_cpu_layer_sends_each_linear_input_once_in_bf16(llama8b):
    """An offloaded CPU layer's prompt: q|k|v's input goes over once, o's, and the feed-forward's
    input and output only (it runs whole on the GPU); bf16 rows through pinned buffers, back at
    the profile's device-to-host rate."""
    from hetero.planner.cost import ACT_BYTES_WIRE
    from hetero.planner.setup import crossing

    c = llama8b.config
    assert crossing(llama8b.layers[0]) == (3 * c.d_model, c.q_size + 2 * c.kv_size + 2 * c.d_model)
    host = dataclasses.replace(cpu(), matmul={**cpu().matmul, "qdot": MatmulRate("q", 50.0, 1.0)})
    fast = dataclasses.replace(gpu("cuda:0", 1000, 4), h2d_gbs=25.0, d2h_gbs=25.0)
    slow = dataclasses.replace(fast, d2h_gbs=2.5)  # 10x slower back
    cfg = PlanConfig(context=2048, in_process=True, prompt_len=512)
    a, b = (plan(llama8b, [g, host], cfg) for g in (fast, slow))
    assert [s.layer_end for s in a.stages] == [s.layer_end for s in b.stages]
    _, back = crossing(llama8b.layers[0])
    extra = 2 * 512 * back * (1 / 2.5e9 - 1 / 25e9) * (32 - a.stages[0].layer_end)
    extra += 512 * c.d_model * ACT_BYTES_WIRE * (1 / 2.5e9 - 1 / 25e9)  # the GPU stage's hand-off
    assert b.ttft_s - a.ttft_s == pytest.approx(extra, rel=1e-3)
    # the plan says where such a layer's time goes (its note, in ms), the crossing back there
    (note_a,), (note_b,) = ([n for n in p.notes if "matmuls on cuda:0" in n] for p in (a, b))
    acts = [float(re.search(r"activations ([0-9.]+)", n).group(1)) for n in (note_a, note_b)]
    assert acts[1] - acts[0] == pytest.approx(
        2 * 512 * back * (1 / 2.5e9 - 1 / 25e9) * 1e3, abs=0.02
    )


def test_a_streamed_layer_takes_the_longer_of_its_weights_copy_and_its_work(llama8b):
    """The staging ring copies a CPU layer's weights while its attention and products run: over
    a fast link the copy hides, over a slow one the layer takes the copy's time."""
    host = dataclasses.replace(cpu(), matmul={**cpu().matmul, "qdot": MatmulRate("q", 50.0, 1.0)})
    cfg = PlanConfig(context=2048, in_process=True, prompt_len=512)

    def note(h2d: float) -> tuple[dict[str, float], int]:
        card = dataclasses.replace(gpu("cuda:0", 1000, 4), h2d_gbs=h2d, d2h_gbs=25.0)
        p = plan(llama8b, [card, host], cfg)
        (n,) = [n for n in p.notes if "matmuls on cuda:0" in n]
        parts = {
            k.strip(): float(v) for k, v in re.findall(r"([a-z ]+) ([0-9.]+)", n.split("(")[1])
        }
        return parts, p.stages[1].layer_start

    fast, _ = note(200.0)
    assert fast["weights beyond"] == 0.0
    slow, layer = note(0.5)
    weights = sum(t.nbytes for t in llama8b.layers[layer])  # the layer's GGUF bytes
    assert slow["weights beyond"] > 0
    assert sum(slow.values()) == pytest.approx(weights / 0.5e9 * 1e3, rel=0.01)
