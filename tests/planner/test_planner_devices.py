"""Device specs, GPU shares, the CPU profile measured for real, and `hetero plan` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hetero.planner.model_desc import rate_key
from hetero.planner.plan import Plan, PlanConfig, PlanError, plan
from hetero.planner.shares import derive_share, parse_share
from hetero.planner.specs import available, load_spec
from hetero.profiler.machine import ThisMachine
from hetero.profiler.measure import CPU_CURVE_T, QDOT_TYPES

SPECS = ("rtx5090", "rtx4090", "rtx4080", "rtx3090", "rtx3060", "a4000", "h200", "desktop-ddr5")


@pytest.mark.parametrize("name", SPECS)
def test_spec_tomls_load(name):
    assert name in available()
    d = load_spec(name)
    assert d.source == "datasheet" and d.id == name
    assert d.memory_total >= 12 * 2**30 and d.mem_bw_gbs > 50 and d.bf16_tflops > 0.5
    if d.is_cpu:
        assert "fp16" in d.matmul
    else:
        major, minor = d.cc
        assert d.fp8_kv == ((major, minor) >= (8, 9))  # FP8 tensor cores from Ada on
        assert d.h2d_gbs > 10 and d.matmul["quant"].kernel == "triton"
        # what the registry picks on such a card (triton_supported: compute capability 8.0)
        assert set(d.kernels.values()) == {"triton" if major >= 8 else "torch"}


def test_unknown_spec_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown device 'rtx9999'.*rtx4090"):
        load_spec("rtx9999")


def test_share_parse_and_derived_scaling():
    s = parse_share("cuda:0@70%:32GB")
    assert (s.base, s.fraction, s.memory_cap, s.id) == (
        "cuda:0",
        0.7,
        32 * 10**9,
        "cuda:0@70%:32GB",
    )
    h200 = load_spec("h200")
    lo = derive_share(h200, parse_share("h200@30%:24GB"))
    hi = derive_share(h200, parse_share("h200@70%:32GB"))
    # the H200 with MPS measured 2.55 and 3.84 TB/s: a ratio of 1.51, not the 2.33 of the shares
    assert hi.mem_bw_gbs / lo.mem_bw_gbs == pytest.approx(3.84 / 2.55, rel=0.03)
    assert hi.bf16_tflops / lo.bf16_tflops == pytest.approx(70 / 30)
    assert hi.usable_memory == 32 * 10**9 and lo.usable_memory == 24 * 10**9
    for bad in ("cuda:0@0%", "cuda:0@150%", "cuda:0@x%", "cuda:0@50%:0GB"):
        with pytest.raises(ValueError, match="share"):
            parse_share(bad)
    with pytest.raises(ValueError, match="more than"):
        derive_share(h200, parse_share("h200@50%:500GB"))


def test_two_shares_of_one_gpu_get_an_uneven_split():
    from hetero.planner.model_desc import describe
    from hetero.planner.resolve import resolve_devices

    # Without host overheads (as with CUDA graphs) the steps are device-bound: the 70% share's
    # higher bandwidth must earn it more layers. (Stage processes run eagerly today: with the
    # datasheet's ~0.75 ms of host launches a layer both stages are host-bound, split evenly.)
    zero = dict(step_overhead_s=0.0, layer_overhead_s=0.0, seq_overhead_s=0.0, pipeline_hop_s=0.0)
    devs = [
        d.replace(**zero, eager_step_overhead_s=0.0, eager_layer_overhead_s=0.0)
        for d in resolve_devices(["h200@70%:32GB", "h200@30%:24GB"])
    ]
    cfg = PlanConfig(concurrency=16, use_all_devices=True, context=4096)
    p = plan(describe("synth:llama3-8b:q4_k_m"), devs, cfg)
    big, small = p.stages
    assert big.device == "h200@70%:32GB" and big.n_layers > small.n_layers
    # what a pipeline stage process starts with: the device, its SM share and memory cap
    assert (big.base_device, big.mps_percentage, big.memory_cap) == ("h200", 70, 32 * 10**9)
    assert (small.mps_percentage, small.memory_cap) == (30, 24 * 10**9)
    assert Plan.from_json(p.to_json()).stages == p.stages


def test_shares_of_one_gpu_contend_for_its_bandwidth_when_stages_overlap():
    from hetero.planner.model_desc import describe
    from hetero.planner.placement import place_split
    from hetero.planner.resolve import resolve_devices
    from hetero.planner.shares import bandwidth_fraction

    desc, ranges = describe("synth:llama3-8b:q4_k_m"), [(0, 21), (21, 32)]
    zero = dict(step_overhead_s=0.0, layer_overhead_s=0.0, seq_overhead_s=0.0, pipeline_hop_s=0.0)
    pair = [d.replace(**zero) for d in resolve_devices(["h200@70%:32GB", "h200@30%:24GB"])]
    apart = [pair[0], pair[1].replace(id="rtx4090@30%:24GB")]  # the same share of another card
    one, two = (
        place_split(desc, devs, PlanConfig(concurrency=16), ranges) for devs in (pair, apart)
    )
    # 16 streams in two micro-batches: both stages stream weights at once; on one card the two
    # shares' alone bandwidths (0.84 + 0.55 of it) must fit in the card's once
    factor = bandwidth_fraction(0.7) + bandwidth_fraction(0.3)
    assert factor == pytest.approx(1.385, abs=1e-3)
    for a, b in zip(one.stages, two.stages):
        assert a.predicted_step_s > b.predicted_step_s * 1.2
    assert one.aggregate_tok_s < two.aggregate_tok_s / 1.2
    # one stream: the stages take turns, nothing contends
    assert [s.single_step_s for s in one.stages] == [s.single_step_s for s in two.stages]
    assert one.single_stream_tok_s == two.single_stream_tok_s


def test_uncapped_shares_of_one_gpu_divide_its_memory():
    from hetero.planner.resolve import resolve_devices

    free = load_spec("h200").memory_free
    a, b = resolve_devices(["h200@60%", "h200@40%"])
    assert a.usable_memory == b.usable_memory == free // 2  # as the stages size their pools
    capped, rest = resolve_devices(["h200@60%:40GB", "h200@40%"])
    assert capped.usable_memory == 40 * 10**9 and rest.usable_memory == free - 40 * 10**9
    c, d = resolve_devices(["h200@60%", "rtx4090@40%"])  # different cards: nothing shared
    assert c.usable_memory == free and d.usable_memory == load_spec("rtx4090").memory_free


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetero.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_cli_plan_dry_run_for_two_cards_it_does_not_have(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "synth:llama3-8b", "--devices", "rtx5090,rtx4090", "-c", "16"]
    r = run_cli(*args, "--use-all-devices", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "rtx5090" in r.stdout and "tok/s aggregate" in r.stdout and "TTFT" in r.stdout
    p = Plan.load(out)
    assert [s.device for s in p.stages] == ["rtx5090", "rtx4090"]
    # 1.8 TB/s against 1.0, but the pipeline's stage processes run eagerly: ~0.75 ms of host
    # launches a layer bound both stages, so the split is even (device-bound splits are uneven:
    # test_two_shares_of_one_gpu_get_an_uneven_split)
    assert p.stages[0].n_layers >= p.stages[1].n_layers
    assert p.stages[-1].layer_end == 32 and p.aggregate_tok_s > p.single_stream_tok_s
    r = run_cli("plan", "synth:llama3-8b", "--devices", "rtx5090,rtx4090", "--json")
    assert r.returncode == 0, r.stderr
    assert [s["device"] for s in json.loads(r.stdout)["stages"]] == ["rtx5090"]  # one stream


def test_cli_plan_refusals_name_the_numbers(tmp_path):
    r = run_cli("plan", "synth:llama3-8b:f16", "--devices", "rtx3060")
    assert r.returncode != 0 and "fits nowhere" in r.stderr and "short by" in r.stderr
    r = run_cli("plan", "synth:llama3-8b", "--devices", "rtx4090", "--context", "8192", "-c", "64")
    assert r.returncode != 0 and "max concurrency at context 8192 is" in r.stderr
    # a device that is not here is refused before anything is measured
    r = run_cli(
        "plan", "synth:llama3-8b", "--devices", "cuda:7@50%", env={"XDG_CACHE_HOME": str(tmp_path)}
    )
    assert r.returncode != 0 and "no device cuda:7 on this machine" in r.stderr
    assert not (tmp_path / "hetero").exists()


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_cpu_profile_measures_for_real_and_is_cached(cache_home, monkeypatch):
    from hetero.kernels import cpu_threads
    from hetero.profiler import machine as profile

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    # as a fresh process starts (an engine built earlier in this one may have set --threads 1):
    # the profile configures the default itself, and `hetero profile` below finds its key
    monkeypatch.setattr(cpu_threads, "_threads", None)
    first = profile.machine_profiles(progress=False)
    cpu = first[-1]
    assert cpu.id == "cpu" and cpu.source == "measured"
    assert cpu.mem_bw_gbs > 0 and cpu.bf16_tflops > 0 and cpu.attn_gbs > 0
    assert cpu.attn_tflops > 0  # the prompt's attention, timed on its own
    assert {"fp16", "dense"} <= set(cpu.matmul) and cpu.matmul["fp16"].decode_gbs > 0
    assert cpu.step_overhead_s >= 0 and cpu.layer_overhead_s >= 0
    # a prefill step's host time: a 16-token prompt's first token on a tiny model is not free
    assert cpu.eager_step_overhead_s + 2 * cpu.eager_layer_overhead_s > 0
    assert [t for t, _ in cpu.matmul["fp16"].curve] == list(CPU_CURVE_T)
    assert cpu.kernels["qlinear"] == "torch"
    if "qdot" in cpu.matmul:  # each type on its own blocks: Q4_1, QDOT_TYPES (codebooks too)
        assert {"IQ4_NL", "IQ4_XS", "MXFP4"} <= set(QDOT_TYPES)
        for t in QDOT_TYPES:
            rate = cpu.matmul[f"qdot:{t}"]
            assert rate.decode_gbs > 0 and rate.prefill_tflops > 0
            assert cpu.matmul_rate(*rate_key("qdot", t)) is rate
        assert cpu.matmul_rate(*rate_key("qdot", "Q4_1")) is cpu.matmul["qdot"]
        assert cpu.matmul_rate(*rate_key("qdot", "Q5_0")) is cpu.matmul["qdot"]  # not timed
    files = list((cache_home / "hetero" / "profiles").glob("*.json"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    again = profile.machine_profiles(progress=False)  # the cache, not a second measurement
    assert files[0].stat().st_mtime_ns == mtime
    assert [p.replace(memory_free=0) for p in again] == [p.replace(memory_free=0) for p in first]
    assert cpu.name.endswith(f"({cpu_threads.default_threads()} threads)")


def test_cli_profile_json_reads_the_cache(cache_home):
    """`hetero profile --json` after the measurement above: the cached profile, at once."""
    # the fingerprint holds the kernels' thread count: the child's default, measured above
    env = {"XDG_CACHE_HOME": str(cache_home)}
    (cached,) = (cache_home / "hetero" / "profiles").glob("*.json")
    mtime = cached.stat().st_mtime_ns
    r = run_cli("profile", "--json", env=env)
    assert r.returncode == 0, r.stderr
    (cpu,) = [d for d in json.loads(r.stdout) if d["id"] == "cpu"]
    assert cpu["source"] == "measured" and cpu["matmul"]["fp16"]["kernel"] == "fbgemm-fp16"
    assert cached.stat().st_mtime_ns == mtime and "stage 0" not in r.stderr  # nothing measured
    table = run_cli("profile", env=env).stdout
    head, _, row = table.splitlines()[:3]
    assert "decode GB/s" in head and "prefill TFLOP/s" in head
    fp16 = cpu["matmul"]["fp16"]
    assert f"fp16 {fp16['decode_gbs']:.3g}" in row and f"fp16 {fp16['prefill_tflops']:.3g}" in row


def test_plan_devices_for_a_pipeline(cache_home, monkeypatch, smollm2_path):
    """The pipeline's entry point: a GGUF path and device names of this machine."""
    from hetero.planner.model_desc import describe
    from hetero.planner.resolve import resolve_devices

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))  # the CPU profile measured above
    p = plan(describe(str(smollm2_path)), resolve_devices(["cpu"], ThisMachine()), PlanConfig())
    (stage,) = p.stages
    assert (stage.device, stage.layer_start, stage.layer_end) == ("cpu", 0, 30)
    assert stage.kv_dtype == "fp16" and stage.weights in (
        "qdot",
        "fp16",
        "dense",
    )  # qdot: where it builds
    assert stage.mps_percentage is None and p.model_path == str(smollm2_path)


def test_a_device_gone_since_profiling_is_refused(tmp_path, monkeypatch):
    from hetero.planner.resolve import resolve_devices
    from hetero.profiler import machine as profile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # this machine's cache entry (datasheet numbers stand in for a measurement: what is tested
    # here is the lookup), and an older one made when a 4090 was in the box
    here = [load_spec("desktop-ddr5").replace(id="cpu")]
    profile.save(profile.fingerprint(profile.live_devices()), here, {})
    gone = load_spec("rtx4090").replace(id="cuda:5", name="RTX 4090", bus_id="00000000:41:00.0")
    profile.save("older-configuration", [gone, *here], {})
    with pytest.raises(PlanError, match=r"cuda:5 \(RTX 4090, bus 00000000:41:00.0\).*not present"):
        resolve_devices(["cuda:5"], ThisMachine(progress=False))
    assert resolve_devices(["cpu"], ThisMachine(progress=False))[0].id == "cpu"


def test_refresh_only_names_a_device_of_this_machine(tmp_path, monkeypatch):
    """`hetero profile --refresh --only DEVICE`: a device that is not here is refused before
    anything is measured; --only without --refresh is a usage error."""
    from hetero.profiler import machine as profile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(
        ValueError, match=r"no device cuda:7 here to profile again \(present: .*cpu"
    ):
        profile.machine_profiles(refresh=True, progress=False, only=["cuda:7"])
    assert not (tmp_path / "hetero").exists()  # nothing measured, nothing cached
    r = run_cli("profile", "--only", "cpu", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "--only names the devices that --refresh" in r.stderr
    r = run_cli("profile", "--refresh", "--only", "cuda:7", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 1 and "no device cuda:7 here" in r.stderr


@pytest.mark.gpu
def test_refresh_only_the_cpu_keeps_the_gpus_cached_profile(tmp_path, monkeypatch):
    """A cached profile (datasheet numbers stand in for this machine's measurement), then the
    CPU measured again alone: every GPU keeps its cached profile but for the host hand-off,
    which comes from the new CPU measurement."""
    from hetero.profiler import machine as profile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    live = profile.live_devices()
    stand_in = [
        load_spec("desktop-ddr5" if d.kind == "cpu" else "rtx4090").replace(id=d.id) for d in live
    ]
    profile.save(profile.fingerprint(live), stand_in, {})
    got = profile.machine_profiles(refresh=True, progress=False, only=["cpu"])
    cpu = got[-1]
    assert cpu.id == "cpu" and cpu.source == "measured" and stand_in[-1].source != "measured"
    for old, new in zip(stand_in[:-1], got[:-1], strict=True):
        assert new.replace(memory_free=0, pipeline_hop_s=0) == old.replace(
            memory_free=0, pipeline_hop_s=0
        )
        assert new.pipeline_hop_s == cpu.pipeline_hop_s
    doc = profile.load_cached(profile.fingerprint(live))
    assert (
        doc["devices"][-1].source == "measured" and doc["devices"][0].bus_id == stand_in[0].bus_id
    )


def test_gpu_matmul_measurement_runs_the_registry_kernels_on_small_shapes():
    """The GPU profile's qlinear measurement, run on the CPU (the registry picks the torch
    reference there) at a small shape: the same code path the GPU takes."""
    import torch

    from hetero.profiler.measure import gpu_matmul_rates

    cpu = torch.device("cpu")
    rates = gpu_matmul_rates(cpu, ["Q4_K", "Q8_0"], (256, 512), 1 << 20, (2, 8), 64)
    assert set(rates) == {"quant:Q4_K", "quant:Q8_0", "dense"}
    assert all(
        r.kernel == "torch" and r.decode_gbs > 0 and r.prefill_tflops > 0 for r in rates.values()
    )
    # the batched-decode curve at the asked T, each point a measured rate
    assert all([t for t, _ in r.curve] == [2, 8] and r.prefill_t == 64 for r in rates.values())
    assert all(g > 0 for r in rates.values() for _, g in r.curve)


def test_a_gpu_measured_in_a_child_that_is_not_here_fails_with_its_reason(capfd):
    """The child process that measures a whole GPU (share_worker.py) is started as a share's is;
    a device this machine lacks ends it with the reason on stderr and the parent's error."""
    import torch

    from hetero.profiler.gpu import measure_gpu_subprocess

    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(RuntimeError, match=r"measuring cuda:7 failed \(exit 1\)"):
        measure_gpu_subprocess("cuda:7")
    assert "cuda:7 is not present" in capfd.readouterr().err


@pytest.mark.gpu
def test_gpu_profile_by_bus_id(tmp_path, monkeypatch):
    """A GPU is measured in a child process: this one holds no GPU memory after it (the engine
    hetero-serve builds next, under a memory cap, has the whole of it)."""
    import torch

    from hetero.profiler import machine as profile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    live = profile.live_devices()
    gpus = [d for d in live if d.kind == "cuda"]
    assert gpus and all(d.bus_id and d.compute_capability for d in gpus)
    profs = profile.machine_profiles(progress=False)
    g = profs[0]
    assert g.id == gpus[0].id and g.bus_id == gpus[0].bus_id
    assert g.matmul["quant:Q4_K"].kernel == "triton" and g.matmul["quant:Q4_K"].decode_gbs > 100
    assert g.h2d_gbs > 1 and g.mem_bw_gbs > 100 and g.bf16_tflops > 10
    assert g.offload_layer_overhead_s > 0 and g.source == "measured"
    assert not torch.cuda.is_initialized() or torch.cuda.memory_reserved() == 0


def test_a_share_the_split_leaves_idle_does_not_slow_its_sibling():
    """Shares of one GPU contend only when both hold layers: a 30% share with too little memory
    for a layer beside its 70% sibling must leave the plan as it is without it."""
    from hetero.planner.model_desc import describe
    from hetero.planner.resolve import resolve_devices

    desc, cfg = describe("synth:llama3-8b:q4_k_m"), PlanConfig(concurrency=32, context=8192)
    three = plan(desc, resolve_devices(["h200@70%:24GB", "h200@30%:1GB", "rtx4090"]), cfg)
    two = plan(desc, resolve_devices(["h200@70%:24GB", "rtx4090"]), cfg)
    assert three.unused_devices == ("h200@30%:1GB",)
    assert len(two.stages) == 2 and three.stages == two.stages
    assert three.aggregate_tok_s == two.aggregate_tok_s


def test_shares_of_one_gpu_cannot_take_more_than_it_has():
    from hetero.planner.model_desc import describe
    from hetero.planner.resolve import resolve_devices

    with pytest.raises(PlanError, match=r"take 140% of its SMs: at most 100"):
        resolve_devices(["h200@70%", "h200@70%"])
    with pytest.raises(PlanError, match=r"memory caps of h200's shares .* add up to 280.0 GB"):
        resolve_devices(["h200@70%:140GB", "h200@30%:140GB"])
    # two equal halves are two devices, each with its own half (not halved again)
    a, b = resolve_devices(["h200@50%:40GB", "h200@50%:40GB"])
    assert (a.id, b.id) == ("h200@50%:40GB", "h200@50%:40GB#2")
    assert a.sm_share == b.sm_share == 0.5 and a.memory_cap == b.memory_cap == 40 * 10**9
    cfg = PlanConfig(concurrency=16, use_all_devices=True)
    p = plan(describe("synth:llama3-8b:q4_k_m"), [a, b], cfg)
    assert [(s.base_device, s.mps_percentage) for s in p.stages] == [("h200", 50), ("h200", 50)]


def test_damaged_profile_caches_are_skipped_not_raised(tmp_path, monkeypatch):
    """A file of the profile cache that another version wrote, or that was damaged, counts as
    absent: a device that vanished is still named from the intact ones."""
    from hetero.profiler import machine as profile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = profile.cache_dir()
    folder.mkdir(parents=True)
    (folder / "0damaged.json").write_text("[1, 2]")
    (folder / "1old.json").write_text(json.dumps({"devices": [{"id": "cuda:1", "name": "x"}]}))
    assert profile.profiled_elsewhere("cuda:1") is None
    assert profile.load_cached("0damaged") is None
    gone = load_spec("rtx4090").replace(id="cuda:1", source="measured")
    profile.save("2other", [gone], {})
    assert profile.profiled_elsewhere("cuda:1") == gone


def test_profile_share_refuses_what_is_not_a_gpu_here(tmp_path):
    """Refused before anything is measured (no cache written)."""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    r = run_cli("profile", "--share", "cpu@50%", env=env)
    assert r.returncode != 0 and "shares are of a GPU (CUDA MPS), not of the CPU" in r.stderr
    r = run_cli("profile", "--share", "h200@50%", env=env)
    assert r.returncode != 0 and "h200 is not a device of this machine" in r.stderr
    r = run_cli("profile", "--share", "cuda:63@50%", env=env)
    assert r.returncode != 0 and "cuda:63 is not a GPU of this machine" in r.stderr
    assert not (tmp_path / "hetero").exists()


def test_a_profile_measured_on_a_busy_machine_is_flagged():
    from hetero.profiler.machine import busy_warning

    assert busy_warning(0.4, 2) is None and busy_warning(7.9, 16) is None
    assert "load average 2.6 on 2 cores" in busy_warning(2.6, 2)
    assert "--refresh" in busy_warning(12.0, 16)
