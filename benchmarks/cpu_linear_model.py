"""Part 4 of benchmarks/cpu_linear.py: the real model with its linears swapped for each scheme.

Last-position logit error against the float32 path, top-1 agreement over a prompt, greedy
tokens equal to float32's, and greedy-decode time per token with the part spent in the linears.
`prompt_logits` is also what the qdot accuracy figures in BENCHMARKS.md were taken with.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from cpu_linear import FUSED, PROMPT, SPLIT, median_spread, model_tensors, pack_model

from hetero.kernels.cpu_linear import packed_linear as _packed_linear


def linear_modules(model) -> tuple[dict, list]:
    """The model's layout (FUSED or SPLIT) and its linear modules in model order."""
    layout = FUSED if hasattr(model.blocks[0].attn, "wqkv") else SPLIT
    mods = [
        getattr(getattr(block, path.split(".")[0]), path.split(".")[1])
        for block in model.blocks
        for path in layout
    ]
    return layout, mods + [model.lm_head]


LINEAR_SECONDS = [0.0]  # time spent in the patched linears since the last reset


def _forward(x: torch.Tensor, p, bias: torch.Tensor | None) -> torch.Tensor:
    start = time.perf_counter()
    y = _packed_linear(x, p)
    LINEAR_SECONDS[0] += time.perf_counter() - start
    return y if bias is None else y + bias


def patch(model, packs: list) -> None:
    """Route the model's linears through packed_linear (fp32 too, so that its time is counted;
    its logits must equal the model's own dense path)."""
    for mod, p in zip(linear_modules(model)[1], packs, strict=True):
        mod.forward = functools.partial(_forward, p=p, bias=mod.bias)


def prompt_logits(model, ids: list[int]) -> torch.Tensor:
    from hetero.model.contiguous_kv import ContiguousKV
    from hetero.model.forward_batch import ForwardBatch

    kv = ContiguousKV(model.config, len(ids), torch.float32)
    kv.begin(len(ids))
    n = len(ids)
    batch = ForwardBatch(torch.arange(n), torch.arange(n), kv)
    return model(torch.tensor(ids), batch)  # [T, V]


def decode(model, ids: list[int], n_new: int) -> tuple[list[int], float, float]:
    """Greedy decode: the tokens, and over the decode steps (prefill excluded) the median step
    time and the median time in linears per step."""
    from hetero.generate import generate_ids

    steps, linear, out, last = [], [], [], time.perf_counter()
    for i, token in enumerate(generate_ids(model, ids, n_new)):
        now = time.perf_counter()
        if i:
            steps.append(now - last)
            linear.append(LINEAR_SECONDS[0])
        out.append(token)
        LINEAR_SECONDS[0] = 0.0
        last = time.perf_counter()
    return out, statistics.median(steps), statistics.median(linear)


def model_report(path: Path, configs: dict, n_new: int, rounds: int) -> None:
    from hetero.config import RuntimeConfig
    from hetero.model.llama import load_model
    from hetero.tokenizer import Tokenizer

    torch.set_num_threads(2)
    _, model = load_model(path, RuntimeConfig(weights="dense"))  # the float32 reference path
    tensors = model_tensors(path, linear_modules(model)[0])
    ids = Tokenizer.from_gguf(path).encode(PROMPT)
    ref = prompt_logits(model, ids)
    print(f"\n== real model, {len(ids)}-token prompt, 2 threads: logits vs float32, decode ==")
    print(
        f"{'config':18}{'max|dl| last':>13}{'max|dl| all':>12}{'rms dl':>8}{'top1':>7}"
        f"{'greedy':>8}{'tok/s':>7}{'step ms':>8}{'linears':>8}{'spread':>7}"
    )
    packs = {name: pack_model(tensors, scheme_of) for name, scheme_of in configs.items()}
    rows, steps, linears = {}, defaultdict(list), defaultdict(list)
    ref_tokens: list[int] = []  # fp32's, the first config
    for r in range(rounds):  # configs take turns, so a busy spell of the machine hits them alike
        for name in configs:
            patch(model, packs[name])
            if r == 0:
                got = prompt_logits(model, ids)
                d = (got - ref).abs()
                agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
                rows[name] = (d[-1].max(), d.max(), d.pow(2).mean().sqrt(), agree)
            tokens, step, linear = decode(model, ids, n_new)
            ref_tokens = ref_tokens or tokens
            same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), n_new)
            rows[name] += (same,) if r == 0 else ()
            steps[name].append(step)
            linears[name].append(linear)
    for name, (last, worst, rms, agree, same) in rows.items():
        step, spread = median_spread(steps[name])
        print(
            f"{name:18}{last:13.4f}{worst:12.4f}{rms:8.4f}{agree:7.3f}{same:>5}/{n_new:<2}"
            f"{1 / step:7.1f}{step * 1e3:8.1f}{statistics.median(linears[name]) * 1e3:8.1f}"
            f"{spread * 100:6.0f}%"
        )
    print(
        f"(reference last-position logits: std {ref[-1].std():.2f}, max {ref[-1].max():.2f}; "
        "top1 = argmax agreement over the prompt's positions; greedy = decoded tokens equal to "
        "fp32's before the first difference; tok/s, step ms = median over rounds of the median "
        "decode step, whole model; linears = ms of it in the linears; spread over rounds)"
    )
