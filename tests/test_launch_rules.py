"""Each rule lives once: the same flags resolve alike on one device, in a pipeline's stages, in the
planner and on the command line.

The KV dtype a device stores and the weights mode it runs are resolved by the local executor
(one device), by every pipeline stage (for its own device) and by the planner (for a profile);
these tests run all three on the same flags and compare what each reports, so a rule copied
into one path and changed there fails here.
"""

from __future__ import annotations

import click
import pytest

from hetero.cli import bench, plan
from hetero.config import WEIGHTS_MODES
from hetero.engine.config import KV_DTYPES, kv_dtype_rule
from hetero.factory import LaunchConfig
from hetero.launch import build_engine
from hetero.planner.model_desc import describe
from hetero.planner.placement import kv_dtype_for
from hetero.planner.plan import PlanConfig
from hetero.planner.plan import plan as make_plan
from hetero.planner.specs import load_spec
from hetero.server.app import serve_cli

FLAGS = [  # (kv_dtype, weights): the defaults, and explicit choices of each
    ("auto", "auto"),
    ("fp16", "fp16"),
    ("fp32", "dense"),
    ("fp8", "auto"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hetero.synth import write_synthetic

    folder = tmp_path_factory.mktemp("rules")
    return write_synthetic(folder / "tiny.gguf", "tiny-llama", "q8_0", progress=False)


def resolved(launch: LaunchConfig, path) -> list[tuple[str, str]]:
    """(KV dtype, weights mode) per stage, as the running engine's executor reports them."""
    engine = build_engine(str(path), launch)
    try:
        if hasattr(engine.executor, "pipeline"):
            return [(r["kv_dtype"], r["weights"]) for r in engine.executor.pipeline.reports]
        return [(engine.executor.info.kv_dtype, engine.executor.info.weights)]
    finally:
        engine.close()


@pytest.mark.parametrize("kv, weights", FLAGS)
def test_one_device_and_pipeline_stages_resolve_flags_alike(tiny, kv, weights):
    opts = dict(kv_dtype=kv, weights=weights, num_kv_blocks=32, speculative="off", threads=1)
    one = resolved(LaunchConfig.from_options(**opts), tiny)
    two = resolved(LaunchConfig.from_options(**opts, split="cpu=0-1,cpu=2-3"), tiny)
    assert two == one * 2
    # and the planner, for this machine's CPU, plans what the engine then runs
    (kv_got, weights_got) = one[0]
    cpu = load_spec("desktop-ddr5").replace(id="cpu", matmul={})
    launch = LaunchConfig.from_options(**opts)
    cfg = PlanConfig(engine=launch.engine, weights=launch.runtime.weights)
    stage = make_plan(describe(str(tiny)), [cpu], cfg).stages[0]
    assert stage.kv_dtype == kv_got
    if weights != "auto":  # auto: the planner picks by measured speed among exact modes
        assert stage.weights == weights_got


@pytest.mark.parametrize("asked", KV_DTYPES)
@pytest.mark.parametrize("spec", ["rtx3090", "rtx4090", "h200", "desktop-ddr5"])
def test_the_planner_and_the_engine_share_one_kv_rule(asked, spec):
    """What the planner plans for a device is the engine's rule for that device's hardware (a
    GPU without e4m3 hardware stores fp16 when fp8 is asked; auto is fp8 only with it)."""
    dev = load_spec(spec)
    assert kv_dtype_for(dev, asked) == kv_dtype_rule(asked, dev.is_cpu, dev.fp8_kv)
    if not dev.is_cpu and not dev.fp8_kv:
        assert kv_dtype_for(dev, asked) != "fp8"


def _choices(command: click.Command, name: str) -> tuple[str, ...]:
    (opt,) = [p for p in command.params if p.name == name]
    return tuple(opt.type.choices)


@pytest.mark.parametrize("command", [bench, plan, serve_cli], ids=["bench", "plan", "serve"])
def test_command_line_choices_are_the_configs_own(command):
    assert _choices(command, "kv_dtype") == KV_DTYPES
    assert _choices(command, "weights") == WEIGHTS_MODES
