"""End to end on the GPU: greedy SmolLM2 with the Triton kernels and CUDA graphs against the GPU
reference path (every op forced to its torch reference, eager), and both against the CPU fp32
path: tokens equal, and the largest logprob error of the chosen tokens.

    python benchmarks/gpu_check_smollm2.py [--kv-dtype fp16] [--tokens 32]
"""

from __future__ import annotations

import argparse

import torch

from hetero.kernels import ops
from hetero.kernels.registry import chosen, forcing
from hetero.llm import LLM
from hetero.sampling import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers:",
]


def run(device: str, kv_dtype: str, tokens: int, eager: bool) -> list[tuple[list, list]]:
    weights = "quant" if device.startswith("cuda") else "dense"
    llm = LLM(device=device, weights=weights, kv_dtype=kv_dtype, enforce_eager=eager,
              num_kv_blocks=256)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def compare(name: str, got, want) -> None:
    same = sum(a[0] == b[0] for a, b in zip(got, want))
    errs = []
    for (ta, la), (tb, lb) in zip(got, want):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        if n:
            errs.append((torch.tensor(la[:n]) - torch.tensor(lb[:n])).abs().max().item())
    print(f"{name}: {same}/{len(got)} outputs equal; max logprob error over the shared prefix "
          f"{max(errs, default=0.0):.2e}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-dtype", default="fp16", choices=["fp8", "fp16", "bf16"])
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    print("kernels on cuda:", chosen("cuda"))
    fast = run("cuda", args.kv_dtype, args.tokens, eager=False)
    with forcing({op: "torch" for op in ops()}):
        ref = run("cuda", args.kv_dtype, args.tokens, eager=True)
    cpu = run("cpu", "fp32", args.tokens, eager=True)
    compare("GPU Triton + graphs vs GPU reference", fast, ref)
    compare("GPU Triton + graphs vs CPU fp32", fast, cpu)
    compare("GPU reference vs CPU fp32", ref, cpu)
    for toks, _ in fast[:2]:
        print("  ", toks[:16])


if __name__ == "__main__":
    main()
