"""The device profiles `hetero plan` reads: the CPU measured for real and cached, `hetero
profile` (--json, --refresh --only, --share), GPUs measured in a child process, a device gone
since, damaged caches, a busy machine."""

from __future__ import annotations

import json

import pytest

from hetero.planner.model_desc import rate_key
from hetero.planner.plan import PlanConfig, PlanError, plan
from hetero.planner.specs import load_spec
from hetero.profiler.machine import ThisMachine
from hetero.profiler.measure import CPU_CURVE_T, QDOT_TYPES
from tests.support.hetero_cli import run_cli


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
