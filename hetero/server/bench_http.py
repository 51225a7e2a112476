"""Load a running `hetero-serve` the way `hetero bench` loads the engine, through HTTP.

    python -m hetero.server.bench_http --url http://127.0.0.1:8080 -c 16 -n 32

Closed loop: C streaming clients; whenever one finishes the next request starts, until N are done.
Prompts are the same seeded random token ids as `hetero bench` uses (so the two runs compare the
same work), sent to /v1/completions with `ignore_eos`, so every request has exactly the asked
lengths. TTFT is the time to the first streamed chunk; a chunk is one engine step's text (a step
whose token ends inside a UTF-8 character sends nothing, so ITL is a little coarse). Special
tokens are rendered (`skip_special_tokens: false`): a skipped one sends no chunk either, and the
random weights of a `hetero synth` model often start with them (its Llama-3 vocabulary is mostly
reserved special tokens), which put the first chunk tens of ms after the first token.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import click

from hetero.bench import BenchResult, Timeline
from hetero.gguf_loader import load_gguf
from hetero.models import resolve_model


async def _one(session: aiohttp.ClientSession, url: str, body: dict, line: Timeline) -> None:
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            if raw.startswith(b"data: {"):
                chunk = json.loads(raw[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    line.tokens.append(time.perf_counter())


def _prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # the same prompts as hetero.bench.run_bench
    return [[rng.randrange(1000, vocab_size) for _ in range(length)] for _ in range(n)]


def run_http_bench(
    url: str,
    vocab_size: int,
    num_requests: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    processes: int = 1,
    timeout: float | None = None,
) -> BenchResult:
    """The closed loop from `processes` client processes (each with its share of the clients
    and of the requests): one Python process parsing every event of 64 fast streams is itself a
    bound (~60 us of CPU an event), which real clients, one process each, do not share.
    TimeoutError after `timeout` seconds."""
    processes = max(1, min(processes, concurrency, num_requests))
    prompts = _prompts(vocab_size, num_requests, input_len, seed)
    if processes == 1:
        loop = _closed_loop(url, prompts, concurrency, output_len, input_len)
        return asyncio.run(asyncio.wait_for(loop, timeout))
    import multiprocessing as mp

    shares = [
        (url, prompts[i::processes], len(range(i, concurrency, processes)), output_len)
        for i in range(processes)
    ]
    with mp.get_context("spawn").Pool(processes) as pool:
        parts = pool.starmap_async(_timelines, shares).get(timeout)
    lines = [tl for part, _, _ in parts for tl in part]
    wall = max(end for _, _, end in parts) - min(start for _, start, _ in parts)
    return BenchResult.from_timelines(
        lines, num_requests, concurrency, input_len, output_len, wall,
        output_tokens=num_requests * output_len,
    )  # fmt: skip


def _timelines(url: str, prompts, concurrency: int, output_len: int):
    """One client process's closed loop: its timelines, start and end (perf_counter is the
    system's monotonic clock, shared by the processes)."""
    return asyncio.run(_run_clients(url, prompts, concurrency, output_len))


async def _closed_loop(url, prompts, concurrency, output_len, input_len) -> BenchResult:
    lines, t0, t1 = await _run_clients(url, prompts, concurrency, output_len)
    # ignore_eos: exactly output_len tokens each, however the chunks grouped them
    return BenchResult.from_timelines(
        lines, len(prompts), concurrency, input_len, output_len, t1 - t0,
        output_tokens=len(prompts) * output_len,
    )  # fmt: skip


async def _run_clients(url: str, prompts, concurrency: int, output_len: int):
    num_requests = len(prompts)
    lines: list[Timeline] = []
    pending = list(range(num_requests))
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client() -> None:
            while pending:
                i = pending.pop(0)
                line = Timeline(time.perf_counter())
                lines.append(line)
                body = {
                    "prompt": prompts[i],
                    "max_tokens": output_len,
                    "temperature": 0,
                    "ignore_eos": True,
                    "skip_special_tokens": False,  # every token sends its chunk
                    "stream": True,
                }
                await _one(session, url, body, line)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(concurrency, num_requests))))
        return lines, t0, time.perf_counter()


@click.command()
@click.argument("model", required=False)
@click.option("--url", default="http://127.0.0.1:8080", show_default=True)
@click.option("--num-requests", "-n", type=click.IntRange(1), default=None)
@click.option("--concurrency", "-c", type=click.IntRange(1), default=1, show_default=True)
@click.option("--input-len", type=click.IntRange(1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(1), default=128, show_default=True)
@click.option("--warmup/--no-warmup", default=True, help="one short untimed run first")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--processes",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="client processes sharing the clients (one process parses ~15k events a second)",
)
def main(
    model, url, num_requests, concurrency, input_len, output_len, warmup, seed, processes
) -> None:
    """Throughput and TTFT of the daemon at URL; MODEL (default: the default model) gives the
    vocabulary size for the random prompts."""

    vocab = load_gguf(resolve_model(model)).config.vocab_size
    if warmup:
        run_http_bench(url, vocab, 1, 1, min(input_len, 16), 4, seed=seed + 1)
    n = num_requests or concurrency
    result = run_http_bench(url, vocab, n, concurrency, input_len, output_len, seed, processes)
    click.echo("\n".join(result.lines()))


if __name__ == "__main__":
    main()
