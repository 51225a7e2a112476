"""Where one engine decode step goes on the CPU: step time, and each qdot linear's share.

    python benchmarks/cpu_step.py [MODEL] -c 16 [--steps 20] [--profile 25]

C requests of --input-len random tokens are prefilled in one step, a few decode steps warm up,
then --steps decode steps are timed. The qdot linears (kernels/cpu_qdot.py) and the native paged
attention are timed per call around their C entry points; the rest of the step is torch ops and
Python. Prints the step time, the decode rate C / step, and per linear shape (N x K) its ms per
step and its rate in GFLOP/s (2 N K T per call).
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import io
import pstats
import time

import click
from click.core import ParameterSource

from hetero.cli_options import engine_options


@contextlib.contextmanager
def profiled(top: int, what: str, sorts: tuple[str, ...] = ("tottime",)):
    """cProfile around the block when top > 0: the `top` functions of most own time (a native
    call's time is its Python caller's own; or by each of `sorts`), printed after it."""
    if not top:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        for key in sorts:
            click.echo(f"-- profile: {what}" + (f", by {key}" if len(sorts) > 1 else ""))
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
            click.echo("\n".join(line[:150] for line in out.getvalue().splitlines()[6:]))


@contextlib.contextmanager
def torch_ops(top: int):
    """torch.profiler around the block when top > 0: the `top` ops by total CPU time (and their
    CUDA time where a GPU ran), printed after it."""
    if not top:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        yield
    averages = prof.key_averages()
    sorts = ["cpu_time_total"] + (["cuda_time_total"] if torch.cuda.is_available() else [])
    for key in sorts:
        click.echo(f"-- torch ops: prefill, by {key}")
        click.echo(averages.table(sort_by=key, row_limit=top, max_name_column_width=50))


@click.command()
@click.pass_context
@click.argument("model", required=False)
@click.option("--concurrency", "-c", type=click.IntRange(1), default=16, show_default=True)
@click.option("--input-len", type=click.IntRange(1), default=64, show_default=True)
@click.option("--steps", type=click.IntRange(1), default=20, show_default=True)
@click.option("--profile", type=click.IntRange(0), default=0, help="print the N functions of "
              "most own time (cProfile) of the prefill and of the decode steps")  # fmt: skip
@click.option("--warm-prefill/--no-warm-prefill", default=False, help="run (and drop) two "
              "prefills of the same shape first, so the timed one finds kernels compiled and "
              "buffers made")  # fmt: skip
@click.option(
    "--ops",
    type=click.IntRange(0),
    default=0,
    help="print the N torch ops of most "
    "time in the prefill (torch.profiler: CPU time, and CUDA time where a GPU runs)",
)
@engine_options
def main(ctx, model, concurrency, input_len, steps, profile, warm_prefill, ops,
         **options) -> None:  # fmt: skip
    from hetero.bench import make_prompts
    from hetero.factory import LaunchConfig
    from hetero.kernels import cpu_block, cpu_qdot, native
    from hetero.launch import build_engine
    from hetero.models import resolve_model
    from hetero.sampling import SamplingParams

    spent: dict = collections.defaultdict(lambda: [0.0, 0])

    def timed(fn, key):
        """fn, its seconds and calls added to spent[key(*args, **kw)]."""

        def call(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            entry = spent[key(*args, **kw)]
            entry[0] += time.perf_counter() - t
            entry[1] += 1
            return out

        return call

    # the model calls the linear with keywords (layers.py)
    linear_key = lambda x, *a, **kw: ("linear", kw["n"], kw["k"], x.shape[0])  # noqa: E731
    cpu_qdot.linear_ptrs = timed(cpu_qdot.linear_ptrs, linear_key)
    lib = native.load()
    if lib is not None:
        lib.native_paged_attention = timed(lib.native_paged_attention, lambda *a: ("attention",))
    # a whole block in one native call (its linears and attention inside)
    block_key = lambda self, x, *a: ("block", x.shape[0])  # noqa: E731
    cpu_block.DenseBlock.__call__ = timed(cpu_block.DenseBlock.__call__, block_key)
    # a split's prompt steps: the CPU layers' matmuls on the GPU (execution/offload.py), each
    # phase's wall time (to_host holds the wait for the GPU's work)
    from hetero.execution import offload

    for name in ("__call__", "feed_forward", "_to_device", "_on_device", "_to_host", "_take"):
        fn = getattr(offload.StreamedMatmuls, name)
        setattr(offload.StreamedMatmuls, name, timed(fn, lambda *a, _n=name, **kw: ("offload", _n)))
    if ctx.get_parameter_source("speculative") != ParameterSource.COMMANDLINE:
        options["speculative"] = "off"  # a plain decode step (n-gram guesses change its rows)
    engine = build_engine(str(resolve_model(model)), LaunchConfig.from_options(**options))
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for seed in (1, 2) if warm_prefill else ():
        warm = make_prompts(engine, "random", concurrency, input_len, seed)
        for i, p in enumerate(warm):
            engine.add_request(f"w{seed}.{i}", p, params)
        t0 = time.perf_counter()
        engine.step()
        click.echo(f"warm-up prefill {seed} (not profiled): {time.perf_counter() - t0:.3f} s")
        for i in range(len(warm)):
            engine.abort(f"w{seed}.{i}")
        spent.clear()
    prompts = make_prompts(engine, "random", concurrency, input_len, 0)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    t0 = time.perf_counter()
    with profiled(profile, "prefill"), torch_ops(ops):
        engine.step()
    click.echo(f"prefill of {concurrency} x {input_len} tokens: {time.perf_counter() - t0:.3f} s")
    report(spent, 1, "prefill")
    for _ in range(3):
        engine.step()
    spent.clear()
    t0 = time.perf_counter()
    with profiled(profile, "decode"):
        for _ in range(steps):
            engine.step()
    step = (time.perf_counter() - t0) / steps
    click.echo(f"decode step {step * 1e3:.1f} ms: {concurrency / step:.1f} tok/s")
    report(spent, steps, "step")
    engine.close()


def report(spent: dict, steps: int, what: str) -> None:
    """The timed native calls' ms per `what`, slowest first."""
    for key, (s, n) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
        if key[0] == "block":
            ms = s / steps * 1e3
            click.echo(f"  native blocks T={key[1]}: {ms:.2f} ms per {what} ({n // steps} calls)")
        elif key[0] == "attention":
            ms = s / steps * 1e3
            click.echo(f"  paged attention: {ms:.2f} ms per {what} ({n // steps} calls)")
        elif key[0] == "offload":
            ms = s / steps * 1e3
            click.echo(f"  streamed matmuls {key[1]}: {ms:.2f} ms per {what} ({n // steps} calls)")
        else:
            _, n_out, k, t = key
            rate = 2 * n_out * k * t * n / s / 1e9
            click.echo(
                f"  linear {n_out}x{k} T={t}: {s / steps * 1e3:.2f} ms per {what}, "
                f"{rate:.1f} GFLOP/s"
            )


if __name__ == "__main__":
    main()
