"""Command-line options shared by `hetero generate`, `hetero bench` and `hetero-serve`.

Each option's name is the field name of the config it sets (RuntimeConfig, EngineConfig,
SchedulerConfig, PipelineConfig), so `LaunchConfig.from_options(**options)` sorts them without a
table; choices and defaults are read from those configs, so each is declared once.
"""

from __future__ import annotations

import math

import click

from hetero.config import WEIGHTS_MODES, PipelineConfig, RuntimeConfig
from hetero.engine.config import (
    KV_DTYPES,
    OVERLAP_MODES,
    SPECULATIVE_MODES,
    EngineConfig,
    SchedulerConfig,
)


class FloatRange(click.FloatRange):
    """click's FloatRange that also refuses nan and inf (click lets `nan` through any range)."""

    def convert(self, value, param, ctx):
        out = super().convert(value, param, ctx)
        if not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return out


# also on `hetero plan`, which prices prefill steps as the engine runs them
cuda_graph_max_tokens_option = click.option(
    "--cuda-graph-max-tokens",
    type=click.IntRange(0),
    default=EngineConfig.cuda_graph_max_tokens,
    show_default=True,
    help="steps with prompt tokens replay CUDA graphs too, up to this many tokens (short "
    "prompts beside running decodes, a prompt of up to this length); 0: decode steps only",
)


class WeightsType(click.ParamType):
    """A weights mode for every device, or DEVICE=MODE pairs (cuda:0=quant,cpu=qdot)."""

    name = "MODE|DEVICE=MODE,..."
    choices = WEIGHTS_MODES

    def convert(self, value, param, ctx) -> str:
        try:
            RuntimeConfig(weights=value)  # the config's own check, one rule
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


def runtime_options(f):
    rt = RuntimeConfig
    f = click.option(
        "--device",
        default=rt.device,
        show_default=True,
        help="auto (the first GPU where there is one, else the CPU), cpu, cuda, cuda:1 ...",
    )(f)
    f = click.option(
        "--n-gpu-layers",
        "-ngl",
        type=click.IntRange(0),
        default=rt.n_gpu_layers,
        help="with a GPU device: its first N layers there, the rest on the CPU, in one process "
        "(default: all there, or the planner's split when the model does not fit the card; "
        "N past the model's layers: all there, as llama.cpp's -ngl 99)",
    )(f)
    f = click.option(
        "--offload-min-tokens",
        type=click.IntRange(0),
        default=rt.offload_min_tokens,
        show_default=True,
        help="with layers, or experts (--cpu-moe), on the CPU beside a GPU: steps of at least "
        "this many tokens run those layers' matmuls on the GPU, their weights streamed over PCIe "
        "(experts: where the step gives each 8 rows on average; 0: never)",
    )(f)
    f = click.option(
        "--dtype",
        default=rt.dtype,
        show_default=True,
        help="activations: auto (fp32 on CPU, bf16 on GPU), fp32, bf16, fp16",
    )(f)
    f = weights_option(f)
    threads = click.option(
        "--threads",
        type=click.IntRange(0),
        default=rt.threads,
        help="CPU threads (0: the physical cores, one left to the server from 4 cores on)",
    )
    f = threads(f)
    return moe_options(f)


# also on `hetero plan`, which prices the experts in RAM
def moe_options(f):
    f = click.option(
        "--n-cpu-moe",
        type=click.IntRange(0),
        default=RuntimeConfig.n_cpu_moe,
        show_default=True,
        help="mixture-of-experts models: keep the experts of the first N layers in system RAM, "
        "multiplied on the CPU (the rest on --device)",
    )(f)
    return click.option(
        "--cpu-moe",
        is_flag=True,
        default=RuntimeConfig.cpu_moe,
        help="mixture-of-experts models: keep every layer's experts in system RAM, multiplied "
        "on the CPU (attention, the router and the rest on --device)",
    )(f)


weights_option = click.option(
    "--weights",
    type=WeightsType(),
    default=RuntimeConfig.weights,
    show_default=True,
    help=f"one of {', '.join(WEIGHTS_MODES)}, or per device (cuda:0=quant,cpu=qdot). auto: "
    "quant on a GPU (GGUF blocks resident, Triton kernels), qdot on a CPU (GGUF blocks times "
    "int8 activations, native code; fp16 where it cannot be built); dense: exact dequantized "
    "weights; fp16/int4/int8/bf16: CPU packings; quant on a CPU is the test reference (refused)",
)

kv_dtype_option = click.option(
    "--kv-dtype",
    type=click.Choice(KV_DTYPES),
    default=EngineConfig.kv_dtype,
    show_default=True,
    help="KV cache storage (fp8: e4m3 with per-token-head scales; auto: fp8 on GPUs with fp8 "
    "hardware, fp16 elsewhere)",
)


def pipeline_options(f):
    pc = PipelineConfig
    opts = [
        click.option(
            "--devices",
            default=None,
            help="the devices to plan over: one GPU (or its memory capped, cuda:0@100%:8GB) and "
            "the CPU run in one process, the GPU's first layers as the planner splits them; "
            "several GPUs, or cpu,cpu, run as pipeline stages (an even split where one repeats)",
        ),
        click.option(
            "--split",
            default=None,
            help="explicit pipeline stages DEVICE=FIRST-LAST, e.g. cuda:0=0-19,cpu=20-31",
        ),
        click.option(
            "--plan", type=click.Path(dir_okay=False), default=None, help="a saved plan (JSON)"
        ),
        click.option(
            "--micro-batches",
            type=click.IntRange(0),
            default=pc.micro_batches,
            show_default=True,
            help="pipeline micro-batches in flight (0: one per stage)",
        ),
        click.option(
            "--stage-timeout",
            type=FloatRange(0.0, min_open=True),
            default=pc.stage_timeout,
            show_default=True,
            help="seconds a pipeline step may take before the pipeline counts as stuck",
        ),
        click.option(
            "--max-restarts",
            type=click.IntRange(0),
            default=pc.max_restarts,
            show_default=True,
            help="restarts of a failed pipeline before the engine gives up",
        ),
        click.option(
            "--dist-init",
            default=None,
            help="the stages' rendezvous tcp://HOST:PORT (for stages on other hosts)",
        ),
        click.option(
            "--remote-stages",
            default=None,
            help="stage ranks started elsewhere with `hetero stage`, e.g. 1",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def engine_options(f):
    f = runtime_options(f)
    f = pipeline_options(f)
    ec, sc = EngineConfig, SchedulerConfig
    opts = [
        kv_dtype_option,
        click.option(
            "--kv-memory-fraction",
            type=FloatRange(0.0, 1.0, min_open=True),
            default=ec.kv_memory_fraction,
            show_default=True,
            help="share of the memory free after the weights that the KV cache takes",
        ),
        click.option(
            "--num-kv-blocks", type=click.IntRange(1), default=None, help="cap on KV blocks"
        ),
        click.option(
            "--block-size", type=click.IntRange(1), default=ec.block_size, show_default=True
        ),
        click.option(
            "--max-num-seqs", type=click.IntRange(1), default=sc.max_num_seqs, show_default=True
        ),
        click.option(
            "--max-num-batched-tokens",
            type=click.IntRange(1),
            default=sc.max_num_batched_tokens,
            show_default=True,
            help="token budget of one step (decodes + prefill chunks)",
        ),
        click.option(
            "--long-prefill-token-threshold",
            type=click.IntRange(0),
            default=sc.long_prefill_token_threshold,
            show_default=True,
            help="the most tokens one prompt may take in one step (0: no cap but the budget)",
        ),
        click.option(
            "--max-model-len", type=click.IntRange(2), default=None, help="default: the model's"
        ),
        click.option(
            "--admit-wait-ms",
            type=FloatRange(0.0),
            default=sc.admit_wait_ms,
            show_default=True,
            help="while decodes run, new prompts wait up to this long for others, to be "
            "prefilled in one step (past --cuda-graph-max-tokens a step runs eagerly); 0: at "
            "once",
        ),
        click.option(
            "--enable-prefix-caching/--no-enable-prefix-caching",
            default=ec.enable_prefix_caching,
            show_default=True,
        ),
        click.option(
            "--enforce-eager",
            is_flag=True,
            help="no CUDA graphs: decode steps run eagerly (graphs are captured at start on GPU)",
        ),
        cuda_graph_max_tokens_option,
        click.option(
            "--overlap-schedule",
            type=click.Choice(OVERLAP_MODES),
            default=ec.overlap_schedule,
            show_default=True,
            help="submit the next step before this one's tokens reach the host, hiding the "
            "host's work behind the device's (a request that stops wastes one row of the next "
            "step; with n-gram speculation, while no request has a guess); auto: on a GPU "
            "without a draft model; on: anywhere",
        ),
        click.option(
            "--kv-ram-gb",
            type=FloatRange(0.0),
            default=None,
            help="host-RAM tier for evicted KV blocks, GiB (default with a GPU: half the free "
            "RAM, at most 16, leaving 8 free; 0 on a CPU, whose KV pool is in RAM already)",
        ),
        click.option(
            "--kv-disk-dir",
            type=click.Path(file_okay=False),
            default=None,
            help="disk tier for KV blocks evicted from RAM, kept across restarts",
        ),
        click.option(
            "--kv-disk-gb",
            type=FloatRange(0.0, min_open=True),
            default=None,
            help="cap of the disk tier, GiB (default: half the free space there)",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return speculative_options(f)


def speculative_options(f):
    opts = [
        click.option(
            "--speculative",
            type=click.Choice(SPECULATIVE_MODES),
            default=EngineConfig.speculative,
            show_default=True,
            help="guess tokens and verify them in one pass: ngram (prompt lookup; a request "
            "that gets its guesses rejected stops guessing), draft (--draft-model), off; auto: "
            "ngram while few requests decode",
        ),
        click.option(
            "--num-speculative-tokens",
            type=click.IntRange(1, 64),
            default=EngineConfig.num_speculative_tokens,
            show_default=True,
            help="the most tokens guessed per request and step",
        ),
        click.option(
            "--draft-model",
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            help="small GGUF with the model's vocabulary, for --speculative draft",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f
