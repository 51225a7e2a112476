"""Command line: `hetero generate | tokenize | info | synth | quantize | bench | profile | plan`
and `hetero-serve`."""

from __future__ import annotations

import json
import sys
import time

import click

from hetero.cli_options import (
    FloatRange,
    cuda_graph_max_tokens_option,
    engine_options,
    kv_dtype_option,
    moe_options,
    runtime_options,
    weights_option,
)
from hetero.config import RuntimeConfig
from hetero.models import resolve_model

MODEL_ARG = click.argument("model", required=False)


def _fail(err: Exception) -> None:
    raise click.ClickException(str(err)) from err


@click.group()
@click.version_option(package_name="hetero")
def main() -> None:
    """hetero: LLM inference for the GPUs (and CPUs) an office owns."""


@main.command()
@MODEL_ARG
@click.option("--prompt", "-p", required=True, help="the prompt text")
@click.option("--chat", is_flag=True, help="wrap the prompt in the model's chat template")
@click.option("--system", default=None, help="system message (with --chat)")
@click.option("--max-tokens", "-n", type=click.IntRange(1), default=128, show_default=True)
@click.option("--temperature", "-t", type=FloatRange(0.0), default=0.0, show_default=True)
@click.option("--seed", type=int, default=None, help="seed for sampling (reproducible output)")
@click.option("--stats/--no-stats", default=True, help="print tok/s to stderr at the end")
@runtime_options
def generate(model, prompt, chat, system, max_tokens, temperature, seed, stats, **rt_opts):
    """Generate text from MODEL (default: SmolLM2-135M-Instruct), streamed to the terminal."""
    from hetero.detokenizer import IncrementalDetokenizer
    from hetero.generate import generate_ids
    from hetero.model.llama import load_model
    from hetero.tokenizer import Tokenizer

    try:
        path = resolve_model(model)
        gm, net = load_model(path, RuntimeConfig(**rt_opts), progress=True)
        tok = Tokenizer.from_gguf(gm.reader)
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = tok.encode(prompt, add_special=not chat)
        detok = IncrementalDetokenizer(tok, skip_special=True)
        t0, n, first = time.perf_counter(), 0, None
        for token in generate_ids(net, ids, max_tokens, temperature, seed, tok.eos_ids):
            first = first or time.perf_counter()
            n += 1
            click.echo(detok.add(token), nl=False)
        click.echo(detok.flush())
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    if stats and n:
        t1 = time.perf_counter()
        decode = (n - 1) / (t1 - first) if n > 1 else 0.0
        click.echo(
            f"[{len(ids)} prompt tokens, {n} generated; first token {first - t0:.3f} s, "
            f"decode {decode:.1f} tok/s]",
            err=True,
        )


@main.command()
@MODEL_ARG
@click.option("--text", required=True, help="text to tokenize")
@click.option("--add-special", is_flag=True, help="add BOS/EOS as the model's metadata says")
def tokenize(model, text, add_special):
    """Print the token ids of TEXT as a JSON list."""
    from hetero.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_gguf(resolve_model(model))
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    click.echo(json.dumps(tok.encode(text, add_special=add_special)))


@main.command()
@MODEL_ARG
def info(model):
    """Show MODEL's configuration and tensor types."""
    from collections import Counter

    from hetero.gguf_loader import load_gguf
    from hetero.model.llama import config_summary

    try:
        gm = load_gguf(resolve_model(model))
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    click.echo(f"{gm.path} ({gm.file_size / 2**20:.1f} MiB)")
    click.echo(config_summary(gm.config))
    types = Counter(t.ggml_type.name for t in gm.tensors.values())
    click.echo("tensors: " + ", ".join(f"{k} x{v}" for k, v in types.most_common()))


@main.command()
@click.argument("out", type=click.Path(dir_okay=False))
@click.option(
    "--shape", required=True, help="llama3-8b, qwen2.5-7b, qwen3-30b-a3b, gpt-oss-20b, ..."
)
@click.option(
    "--quant",
    default="q4_k_m",
    show_default=True,
    help="q4_k_m, q5_k_m, q6_k, q8_0, iq4_xs, mxfp4_moe ...",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--chat",
    default=None,
    help="a real family's chat template and special tokens: qwen2.5, qwen3, llama3.1, "
    "mistral-nemo (default: ChatML)",
)
def synth(out, shape, quant, seed, chat):
    """Write a GGUF (llama family, qwen3moe, gpt-oss) with random finite weights (benchmarks;
    --chat: chat tests)."""
    from hetero.synth import write_synthetic

    t0 = time.perf_counter()
    try:
        path = write_synthetic(out, shape, quant, seed=seed, progress=True, chat=chat)
    except (ValueError, KeyError, OSError) as e:
        _fail(e)
    size = path.stat().st_size / 2**30
    click.echo(f"wrote {path} ({size:.2f} GiB) in {time.perf_counter() - t0:.1f} s")


@main.command()
@click.argument("src", type=click.Path(dir_okay=False))
@click.argument("dst", type=click.Path(dir_okay=False))
@click.option("--type", "qtype", required=True, help="q8_0, q6_k, q5_k_m, q4_k_m, iq4_xs ...")
def quantize(src, dst, qtype):
    """Re-quantize the GGUF model SRC into DST."""
    from hetero.requantize import requantize

    t0 = time.perf_counter()
    try:
        counts = requantize(src, dst, qtype, progress=True)
    except (ValueError, OSError) as e:
        _fail(e)
    summary = ", ".join(f"{k} x{v}" for k, v in counts.items())
    click.echo(f"wrote {dst} in {time.perf_counter() - t0:.1f} s: {summary}")


@main.command()
@MODEL_ARG
@click.option(
    "--num-requests",
    "-n",
    type=click.IntRange(1),
    default=None,
    help="requests in all (default: the concurrency)",
)
@click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(1),
    multiple=True,
    default=(1,),
    show_default=True,
    help="requests in flight (repeat for several runs on one loaded model)",
)
@click.option("--input-len", type=click.IntRange(1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(1), default=128, show_default=True)
@click.option(
    "--warmup/--no-warmup",
    default=True,
    help="an untimed run first at each concurrency, with prompts of the measured length (4 "
    "tokens out): kernels compile at the shapes the run meets",
)
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the random prompts")
@click.option(
    "--workload",
    type=click.Choice(["random", "code-edit", "chat"]),
    multiple=True,
    default=("random",),
    show_default=True,
    help="random token prompts; code-edit: a source file asked back with a rename (much to "
    "copy); chat: open questions (nothing to copy). Repeat for several runs",
)
@click.option(
    "--spec-ab",
    is_flag=True,
    help="each workload and concurrency twice, speculation off then on (--speculative): one "
    "line each with both speeds, the speedup, the acceptance and the step times",
)
@click.option(
    "--spec-oracle",
    type=FloatRange(0.0, 1.0),
    multiple=True,
    help="with --spec-ab, also guess from the plain run's answers, each token right with this "
    "probability (a set acceptance, for models with random weights); repeatable",
)
@engine_options
def bench(
    model, num_requests, concurrency, input_len, output_len, warmup, seed, workload, spec_ab,
    spec_oracle, **options,
):  # fmt: skip
    """Offline throughput and latency: N requests, C at a time."""
    from hetero.bench import run_bench, warm_up
    from hetero.factory import LaunchConfig
    from hetero.launch import build_engine

    try:
        engine = build_engine(model, LaunchConfig.from_options(**options), progress=True)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # RuntimeError: a failed stage
        _fail(e)
    click.echo(engine.describe_kv(), err=True)
    try:
        if spec_ab:
            _spec_ab(
                engine, list(workload), list(concurrency), input_len, output_len, seed, spec_oracle
            )
            return
        for w in workload:
            for c in concurrency:
                if warmup:
                    warm_up(engine, c, input_len, output_len, seed)
                result = run_bench(
                    engine, num_requests or c, c, input_len, output_len, seed=seed, workload=w
                )
                click.echo("\n".join([*result.lines(), result.spec_line(), result.steps_line()]))
    finally:
        engine.close()  # a pipeline's stage processes


def _spec_ab(engine, workloads, concurrencies, input_len, output_len, seed, oracles) -> None:
    from hetero.bench_spec import spec_ab

    try:
        pairs = spec_ab(engine, workloads, concurrencies, input_len, output_len, seed, oracles)
    except ValueError as e:
        _fail(e)
    for pair in pairs:
        click.echo(pair.line())


@main.command()
@click.option("--refresh", is_flag=True, help="measure again even when a cached profile matches")
@click.option(
    "--only",
    multiple=True,
    help="with --refresh: measure only this device again (cpu, cuda:0; repeatable), keeping "
    "the cached profiles of the others",
)
@click.option(
    "--share",
    "shares",
    multiple=True,
    help="also measure a GPU share under CUDA MPS (needs the MPS daemon), e.g. cuda:0@70%:32GB",
)
@click.option("--json", "as_json", is_flag=True, help="print the profiles as JSON")
def profile(refresh, only, shares, as_json):
    """Measure this machine's devices (cached per machine; --refresh measures again)."""
    from hetero.cli_plan import run_profile

    if only and not refresh:
        raise click.UsageError("--only names the devices that --refresh measures again")
    try:
        run_profile(refresh, shares, as_json, only)
    except (ValueError, RuntimeError, OSError) as e:
        _fail(e)


@main.command()
@MODEL_ARG
@click.option(
    "--devices",
    default=None,
    help="comma-separated, in pipeline order: cuda:0, cpu, spec names (rtx4090, h200, ...), "
    "shares (cuda:0@70%:32GB); default: every device here",
)
@click.option("--context", type=click.IntRange(2), default=None, help="tokens per sequence")
@click.option("--concurrency", "-c", type=click.IntRange(1), default=1, show_default=True)
@click.option("--prompt-len", type=click.IntRange(1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(1), default=128, show_default=True)
@kv_dtype_option
@weights_option
@click.option("--use-all-devices", is_flag=True, help="give every device at least one layer")
@click.option(
    "--pipeline",
    is_flag=True,
    help="plan stage processes (a pipeline) even where one process would run them: one GPU "
    "and the CPU run in one process unless this is given (several GPUs always are stages)",
)
@click.option(
    "--offload-min-tokens",
    type=click.IntRange(0),
    default=RuntimeConfig.offload_min_tokens,
    show_default=True,
    help="in one process: prompt steps of at least this many tokens run the CPU's matmuls on "
    "the GPU (0: never), as the engine's option of that name",
)
@click.option(
    "--enforce-eager", is_flag=True, help="plan for an engine without CUDA graphs (as its flag)"
)
@cuda_graph_max_tokens_option
@moe_options
@click.option("--refresh", is_flag=True, help="profile this machine again first")
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False),
    help="write the plan here: JSON (for hetero-serve --plan), or its drawing when the name "
    "ends in .svg",
)
def plan(model, devices, refresh, as_json, output, pipeline, **config):
    """Plan MODEL over devices without loading it: layers, KV and kernels per device, and the
    predicted speed. MODEL: a GGUF path, or synth:SHAPE[:QUANT] for a `hetero synth` model."""
    from hetero.cli_plan import run_plan

    try:
        run_plan(model, devices, refresh, as_json, output, pipeline, **config)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        _fail(e)


@main.command()
@MODEL_ARG
@click.option("--rank", type=click.IntRange(1), required=True, help="this stage's index (from 0)")
@engine_options
def stage(model, rank, **options):
    """Serve one pipeline stage of an engine on another host (README: pipelines)."""
    from hetero.launch import run_remote_stage

    try:
        run_remote_stage(model, rank, options)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)


def serve_main() -> None:
    """`hetero-serve`: the OpenAI-compatible daemon."""
    from hetero.server.app import serve_cli

    serve_cli(standalone_mode=True)


if __name__ == "__main__":
    sys.exit(main())
