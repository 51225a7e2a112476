"""FP8 KV against fp16 KV (and fp32) on a real model: next-token logit error and greedy agreement.

Teacher-forced: the fp16 path's greedy continuation is fed to every KV dtype token by token, so
each step's logits are compared on the same context; greedy agreement is counted separately by
free-running each dtype.

    python benchmarks/kv_fp8.py [MODEL] [--tokens 300]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hetero.config import RuntimeConfig
from hetero.model.llama import load_model
from hetero.models import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support: a test helper
from tests.support.one_sequence import OneSequence  # noqa: E402

PROMPTS = [
    "The history of the river begins",
    "def quicksort(xs):\n",
    "<|im_start|>user\nExplain what a KV cache is.<|im_end|>\n<|im_start|>assistant\n",
    "1, 1, 2, 3, 5, 8,",
]


def greedy(model, kv_dtype, prompt, n) -> list[int]:
    seq = OneSequence(model, kv_dtype, len(prompt) + n)
    out, nxt = [], prompt
    for _ in range(n):
        tok = int(seq.logits(nxt).argmax())
        out.append(tok)
        nxt = [tok]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=300)
    args = ap.parse_args()
    gm, model = load_model(resolve_model(args.model), RuntimeConfig())
    from hetero.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gm.reader)
    agree, total, errs = 0, 0, {"fp8": [], "bf16": []}
    for text in PROMPTS:
        prompt = tok.encode(text, add_special=True)
        ref = greedy(model, "fp16", prompt, args.tokens)
        got = greedy(model, "fp8", prompt, args.tokens)
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
        agree += sum(a == b for a, b in zip(ref, got))
        total += len(ref)
        seqs = {d: OneSequence(model, d, len(prompt) + args.tokens) for d in ("fp16", *errs)}
        feeds = [prompt] + [[t] for t in ref[:-1]]
        for feed in feeds:
            base = seqs["fp16"].logits(feed)
            for d in errs:
                errs[d].append((seqs[d].logits(feed) - base).abs().max().item())
        print(f"{text[:30]!r}: fp8 greedy equals fp16 for the first {first} of {len(ref)} tokens")
    print(f"greedy agreement fp8 vs fp16 (same position): {agree}/{total} = {agree / total:.1%}")
    for d, e in errs.items():
        e = torch.tensor(e)
        print(
            f"{d} vs fp16 max |logit error| per step over {len(e)} teacher-forced steps: "
            f"mean {e.mean():.4f}, p99 {e.quantile(0.99):.4f}, max {e.max():.4f}"
        )


if __name__ == "__main__":
    main()
