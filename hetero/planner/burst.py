"""Time to first token of C prompts arriving together, through the pipeline's micro-batches.

The pipeline engine (hetero/engine/microbatch.py) seats the arrivals in G groups of
ceil(C / G) and keeps one step of each group in flight: a group's next step is scheduled when its
last one has come back. A step of up to `budget` prompt tokens (its group's prompts packed in
order, the last one split) passes the stages in order, and each stage takes the steps that reach
it first to last. So group 1's first chunk runs on stage 1 while group 0's runs on stage 2, and
the burst's prefill is pipelined, not the sum of every stage's whole share of it.

A prompt's first token comes when the step holding its last token leaves the last stage. What
`hetero bench` reports, and the plan predicts, is the mean of those times over the C prompts.
"""

from __future__ import annotations

from collections.abc import Callable

# (stage, new tokens, tokens cached before them, prompts in the step) -> seconds on that stage
ChunkSeconds = Callable[[int, int, int, int], float]


def prompt_chunks(prompts: int, prompt_len: int, budget: int) -> list[tuple[int, int, int, int]]:
    """The steps of `prompts` prompts packed in order, up to `budget` tokens each: (tokens,
    tokens cached before them when the step holds one prompt, prompts touched, prompts finished)."""
    out, done, total = [], 0, prompts * prompt_len
    while done < total:
        n = min(budget, total - done)
        first, last = done // prompt_len, (done + n - 1) // prompt_len
        finished = (done + n) // prompt_len - done // prompt_len
        cached = done - first * prompt_len if first == last else 0
        out.append((n, cached, last - first + 1, finished))
        done += n
    return out


def burst_first_tokens(
    n_stages: int, groups: int, concurrency: int, prompt_len: int, budget: int,
    chunk_s: ChunkSeconds,
) -> list[float]:  # fmt: skip
    """Each prompt's time to its first token (seconds from the arrival), in finishing order."""
    seats = -(-concurrency // groups)
    sizes = [min(seats, concurrency - g * seats) for g in range(groups)]
    plans = [prompt_chunks(s, prompt_len, max(1, budget)) for s in sizes if s > 0]
    ready = [0.0] * len(plans)  # when each group's next step may start
    nxt = [0] * len(plans)
    free = [0.0] * n_stages  # when each stage is next idle
    firsts: list[float] = []
    while True:
        live = [g for g in range(len(plans)) if nxt[g] < len(plans[g])]
        if not live:
            return firsts
        g = min(live, key=lambda g: (ready[g], g))
        n, cached, rows, finished = plans[g][nxt[g]]
        t = ready[g]
        for i in range(n_stages):
            t = max(t, free[i]) + chunk_s(i, n, cached, rows)
            free[i] = t
        ready[g], nxt[g] = t, nxt[g] + 1
        firsts += [t] * finished
