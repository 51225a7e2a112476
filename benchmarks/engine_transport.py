"""What one engine step's message costs between the engine process and the server process.

    python benchmarks/engine_transport.py [--steps 2000]

A child process plays the engine: per step it packs B StepOutputs (one new token each, as in a
decode step; optionally with logprobs) and sends them over a multiprocessing pipe, the way
core_process.py does; the parent unpickles and rebuilds StepOutputs, as core_client.py does.
Printed per batch size: microseconds per step end to end (the child's send to the parent's last
StepOutput, averaged over a stream of steps) and the message size. Compare with an engine step
(milliseconds on a GPU at these batch sizes) to see what the process boundary adds.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time

import click

from hetero.engine.output import StepOutput, TokenLogprob
from hetero.frontdoor.wire import dumps, pack_outputs


def _outputs(batch: int, step: int, logprobs: bool) -> list[StepOutput]:
    rid = "cmpl-0123456789abcdef0123456789abcdef/{}"
    lp = [TokenLogprob(step, -0.5, [(step, -0.5), (7, -1.5)])] if logprobs else None
    return [StepOutput(rid.format(i), [step], lp, False, None, 128, 0) for i in range(batch)]


def _engine(conn, batch: int, steps: int, logprobs: bool) -> None:
    for s in range(steps):
        conn.send_bytes(dumps(("step", pack_outputs(_outputs(batch, s, logprobs)), [])))
    conn.send_bytes(dumps(("end",)))


def measure(batch: int, steps: int, logprobs: bool) -> tuple[float, int]:
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_engine, args=(w, batch, steps, logprobs))
    p.start()
    w.close()
    first = r.recv_bytes()  # the child is up: time from here
    size = len(first)
    t0 = time.perf_counter()
    n = 0
    while True:
        msg = pickle.loads(r.recv_bytes())
        if msg[0] == "end":
            break
        outs = [StepOutput(*t) for t in msg[1]]
        n += len(outs) > 0
    dt = time.perf_counter() - t0
    p.join()
    return dt / max(n, 1) * 1e6, size


@click.command()
@click.option("--steps", type=int, default=2000, show_default=True)
def main(steps: int) -> None:
    click.echo(f"{'batch':>6} {'logprobs':>9} {'us/step':>8} {'bytes':>7}")
    for logprobs in (False, True):
        for batch in (1, 16, 64, 256):
            us, size = measure(batch, steps, logprobs)
            click.echo(f"{batch:>6} {str(logprobs):>9} {us:>8.1f} {size:>7}")


if __name__ == "__main__":
    main()
