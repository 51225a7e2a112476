"""The daemon's HTTP path against the offline engine: same requests, same engine options.

    python benchmarks/http_vs_offline.py MODEL --device cuda -c 1,16,64

For each concurrency C the offline engine (`hetero bench`'s closed loop) runs first, in a child
process that then exits (its GPU memory with it): a calibration run sizes N, a multiple of C, so
that the timed run lasts about --seconds. Then `hetero-serve` starts with the same engine options
(once per --modes entry: the engine in its own process, or on a thread) and `bench_http` sends the
same N requests (the same seeded random prompts, a seed per C so no run hits another's prefixes)
with C streaming clients. One row per C and mode: both aggregate output rates, their ratio, and
median TTFT on both sides (closed loop: TTFT includes the wait for a free slot).

`--stream-intervals auto,0` starts each mode once per `--stream-interval-ms` value (a row each);
`--client-processes P` spreads the HTTP clients over P processes (one Python process parsing
every event of 64 fast streams is itself a bound that real clients do not share).

Every step is bounded: the daemon's start (--start-timeout) and each timed run (ten times its
expected length, at least two minutes).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import click
from click.core import ParameterSource

from hetero.cli_options import engine_options

ROOT = Path(__file__).resolve().parents[1]
SIDE_KEYS = ("concurrency", "seconds", "input_len", "output_len", "modes", "side", "out", "model")
SIDE_KEYS += ("start_timeout", "port", "client_processes", "stream_intervals")


def _seed(c: int) -> int:
    return 1000 * c  # timed prompts; +1 calibration, +2 warm-up


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


STEP_KEYS = ("steps", "busy_s", "decode_steps", "decode_s", "graphed")


def stats_counters(stats) -> dict:
    """The engine's step counters (EngineStats), as /metrics reports them."""
    values = (stats.steps, stats.busy_s, stats.decode[0], stats.decode[2], stats.graphed)
    return dict(zip(STEP_KEYS, values))


def metrics_counters(url: str) -> dict:
    from hetero.server.metrics import parse_metrics

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        m = parse_metrics(r.read().decode())
    names = (
        "steps_total", "busy_seconds_total", "decode_steps_total", "decode_seconds_total",
        "graph_steps_total",
    )  # fmt: skip
    return {k: m[f"hetero_engine_{n}"] for k, n in zip(STEP_KEYS, names)}


def step_summary(before: dict, after: dict, wall_s: float) -> dict:
    """Where a timed run's wall time went in the engine: the share spent in steps, the steps
    that ran prompt tokens against the decode-only ones, and how many steps missed the CUDA
    graphs (eager: every step on a CPU)."""
    d = {k: after[k] - before[k] for k in STEP_KEYS}
    prompt_steps = d["steps"] - d["decode_steps"]
    return {
        "busy": d["busy_s"] / wall_s,
        "decode_steps": int(d["decode_steps"]),
        "decode_ms": 1e3 * d["decode_s"] / max(d["decode_steps"], 1),
        "prompt_steps": int(prompt_steps),
        "prompt_ms": 1e3 * (d["busy_s"] - d["decode_s"]) / max(prompt_steps, 1),
        "eager_steps": int(d["steps"] - d["graphed"]),
    }


def offline_side(model: str, cs: list[int], seconds: float, inp: int, outp: int, options) -> dict:
    """Per C: N, output tok/s and median TTFT of the offline engine (run in a child process)."""
    from hetero.bench import run_bench
    from hetero.factory import LaunchConfig
    from hetero.launch import build_engine

    engine = build_engine(model, LaunchConfig.from_options(**options))
    out = {}
    try:
        run_bench(engine, 1, 1, min(inp, 16), 4, seed=1)
        for c in cs:
            cal = run_bench(engine, 2 * c, c, inp, outp, seed=_seed(c) + 1)
            wave = cal.wall_s / 2
            n = c * max(4, round(seconds / wave))
            before = stats_counters(engine.stats)
            r = run_bench(engine, n, c, inp, outp, seed=_seed(c))
            steps = step_summary(before, stats_counters(engine.stats), r.wall_s)
            out[c] = {"n": n, "tok_s": r.output_tok_s, "ttft_ms": _median_ms(r.ttft_s), **steps}
            print(f"offline C={c}: N={n} {r.output_tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        engine.close()
    return out


def serve_flags(ctx: click.Context) -> list[str]:
    """The engine options given on this command line, as flags of hetero-serve."""
    flags: list[str] = []
    for p in ctx.command.params:
        if p.name in SIDE_KEYS or ctx.get_parameter_source(p.name) != ParameterSource.COMMANDLINE:
            continue
        value = ctx.params[p.name]
        if isinstance(p, click.Option) and p.is_flag:
            if value:
                flags.append(p.opts[0])
            elif p.secondary_opts:
                flags.append(p.secondary_opts[0])
        else:
            flags += [p.opts[0], str(value)]
    return flags


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except OSError as e:
        return getattr(e, "code", 0) or 0


def start_daemon(model: str, flags: list[str], mode: str, port: int, timeout: float):
    log = tempfile.NamedTemporaryFile(prefix=f"serve-{mode}-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "hetero.server", model, *flags, f"--{mode}", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"hetero-serve exited ({proc.returncode}); see {log.name}")
        if _get(f"http://127.0.0.1:{port}/health") == 200:
            return proc, log.name
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"hetero-serve not ready within {timeout:.0f} s; see {log.name}")


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def http_side(
    url: str, vocab: int, cs: list[int], offline: dict, inp: int, outp: int, procs: int
) -> dict:
    from hetero.server.bench_http import run_http_bench

    out = {}
    run_http_bench(url, vocab, 1, 1, min(inp, 16), 4, seed=2, timeout=120)
    for c in cs:
        n = offline[c]["n"]
        bound = max(120.0, 10 * n * outp / offline[c]["tok_s"])
        run_http_bench(url, vocab, c, c, inp, 8, _seed(c) + 2, procs, bound)  # warm-up
        before = metrics_counters(url)
        r = run_http_bench(url, vocab, n, c, inp, outp, _seed(c), procs, bound)
        steps = step_summary(before, metrics_counters(url), r.wall_s)
        out[c] = {"tok_s": r.output_tok_s, "ttft_ms": _median_ms(r.ttft_s), **steps}
        print(f"HTTP C={c}: {r.output_tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def run_offline_child(ctx: click.Context, model: str, budget: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    args = [str(Path(__file__).resolve()), model, "--side", "offline", "--out", path]
    args += serve_flags(ctx)
    args += ["-c", ctx.params["concurrency"], "--seconds", str(ctx.params["seconds"])]
    args += ["--input-len", str(ctx.params["input_len"])]
    args += ["--output-len", str(ctx.params["output_len"])]
    subprocess.run([sys.executable, *args], check=True, timeout=budget, cwd=ROOT)
    return {int(k): v for k, v in json.loads(Path(path).read_text()).items()}


@click.command()
@click.argument("model")
@click.option("--concurrency", "-c", default="1,16,64", show_default=True)
@click.option("--seconds", type=float, default=15.0, show_default=True, help="per timed run")
@click.option("--input-len", type=int, default=128, show_default=True)
@click.option("--output-len", type=int, default=128, show_default=True)
@click.option(
    "--modes",
    default="engine-process,no-engine-process",
    show_default=True,
    help="hetero-serve runs to compare: engine-process, no-engine-process",
)
@click.option("--start-timeout", type=float, default=300.0, show_default=True)
@click.option("--port", type=int, default=18080, show_default=True)
@click.option(
    "--stream-intervals",
    default="auto",
    show_default=True,
    help="hetero-serve --stream-interval-ms values to run each mode with (comma-separated)",
)
@click.option(
    "--client-processes",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="processes the HTTP clients are spread over (bench_http --processes)",
)
@click.option("--side", type=click.Choice(["both", "offline"]), default="both", hidden=True)
@click.option("--out", default=None, hidden=True)
@engine_options
@click.pass_context
def main(ctx, model, concurrency, seconds, input_len, output_len, modes, start_timeout, port,
         stream_intervals, client_processes, side, out, **options) -> None:  # fmt: skip
    cs = [int(c) for c in concurrency.split(",")]
    model = str(Path(model).resolve())  # the daemon and the offline side run from the repository
    if side == "offline":
        result = offline_side(model, cs, seconds, input_len, output_len, options)
        Path(out).write_text(json.dumps(result))
        return
    from hetero.gguf_loader import load_gguf

    vocab = load_gguf(model).config.vocab_size
    offline = run_offline_child(ctx, model, budget=start_timeout + 20 * seconds * len(cs))
    rows = []
    for mode in modes.split(","):
        for interval in stream_intervals.split(","):
            flags = [*serve_flags(ctx), "--stream-interval-ms", interval]
            proc, log = start_daemon(model, flags, mode, port, start_timeout)
            try:
                url = f"http://127.0.0.1:{port}"
                args = (cs, offline, input_len, output_len, client_processes)
                http = http_side(url, vocab, *args)
            finally:
                stop_daemon(proc)
            os.unlink(log)
            label = mode if interval == "auto" else f"{mode}@{interval}ms"
            rows += [(c, label, offline[c], http[c]) for c in cs]
    click.echo(f"{input_len} in / {output_len} out, ~{seconds:.0f} s per timed run")
    click.echo(f"{'C':>4} {'N':>6} {'mode':>22} {'offline tok/s':>14} {'HTTP tok/s':>11} "
               f"{'ratio':>6} {'TTFT off ms':>12} {'TTFT HTTP ms':>13}")  # fmt: skip
    for c, mode, off, h in rows:
        click.echo(
            f"{c:>4} {off['n']:>6} {mode:>22} {off['tok_s']:>14.1f} {h['tok_s']:>11.1f} "
            f"{h['tok_s'] / off['tok_s']:>6.1%} {off['ttft_ms']:>12.1f} {h['ttft_ms']:>13.1f}"
        )
    click.echo("engine steps in the timed runs (offline / HTTP): share of the wall in steps; "
               "decode-only steps, ms each; steps with prompt tokens, ms each; steps that ran "
               "eagerly (not through the CUDA graphs)")  # fmt: skip
    for c, mode, off, h in rows:
        cells = [
            f"{x['busy']:.0%} | {x['decode_steps']} x {x['decode_ms']:.2f} ms | "
            f"{x['prompt_steps']} x {x['prompt_ms']:.2f} ms | {x['eager_steps']} eager"
            for x in (off, h)
        ]
        click.echo(f"{c:>4} {mode:>22}  offline {cells[0]}  /  HTTP {cells[1]}")


if __name__ == "__main__":
    main()
