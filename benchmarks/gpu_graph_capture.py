"""Capture the decode CUDA graphs of a small synthetic model per quant mix; print any failure.

    python benchmarks/gpu_graph_capture.py [--quants q6_k,q4_k_m,q5_k_m,q8_0] [--shape tiny-llama]

The engine logs a failed capture and runs eagerly; this calls `DecodeGraphs.capture` directly,
so the exception arrives whole: its traceback names the op that ran a host sync, a host-to-device
copy or an allocation inside the capture. Per mix it prints the tensor types of the file, the
kernels chosen, then `captured` (and a replay's agreement with an eager step) or the traceback.
Each mix runs in a process of its own: a failed capture can leave the CUDA context unusable.
`--host-shifts` puts back the old 2-bit unpacking (shifts copied from a host list) to show that
it alone broke the Q6_K capture (the Q6_K token embedding dequantizes inside the step).
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import traceback
from collections import Counter
from pathlib import Path

import torch


def _host_shift_crumbs(qs: torch.Tensor) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).view(4, 1)
    return (qs.contiguous().unsqueeze(-2) >> shifts) & 0x03


def _capture(quant: str, shape: str, max_batch: int, host_shifts: bool) -> None:
    from hetero.config import RuntimeConfig
    from hetero.execution.cuda_graph import DecodeGraphs
    from hetero.kernels.registry import chosen
    from hetero.llm import LLM
    from hetero.model.llama import load_model
    from hetero.synth import write_synthetic

    if host_shifts:
        import hetero.quant.kquants as kq

        kq.crumbs = _host_shift_crumbs
    with tempfile.TemporaryDirectory() as tmp:
        path = write_synthetic(Path(tmp) / f"{quant}.gguf", shape, quant, progress=False)
        gm, model = load_model(path, RuntimeConfig(device="cuda"))
        types = Counter(t.ggml_type.name for t in gm.tensors.values())
        print(f"[{quant}] tensors: " + ", ".join(f"{k} x{v}" for k, v in types.most_common()))
        print(f"[{quant}] kernels: {chosen(torch.device('cuda'))}", flush=True)
        # The file's path (its tokenizer, and no lookup of an installed default model)
        llm = LLM(
            str(path), loaded=(gm, model), kv_dtype="fp16", num_kv_blocks=64, block_size=16,
            max_model_len=256, max_num_seqs=max_batch, enforce_eager=True, device="cuda",
        )  # fmt: skip
    graphs = DecodeGraphs(model, llm.engine.executor.pool, max_batch, 256)
    try:
        graphs.capture()
    except Exception:  # the point of the script: show whatever it is, with its traceback
        print(f"[{quant}] CAPTURE FAILED", flush=True)
        traceback.print_exc()
        return
    eager = graphs._forward(1).clone()  # static buffers as capture left them (padding rows)
    graphs.graphs[1, False].replay()
    torch.cuda.synchronize()
    diff = (graphs.outputs[1, False].float() - eager.float()).abs().max().item()
    print(f"[{quant}] captured buckets {graphs.buckets}; replay vs eager max |diff| {diff:.3g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quants", default="q6_k,q4_k_m,q5_k_m,q8_0")
    ap.add_argument("--shape", default="tiny-llama")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--host-shifts", action="store_true", help="the old 2-bit unpacking")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    ctx = multiprocessing.get_context("spawn")
    for quant in args.quants.split(","):
        p = ctx.Process(
            target=_capture, args=(quant.strip(), args.shape, args.max_batch, args.host_shifts)
        )
        p.start()
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
            print(f"[{quant}] timed out after 300 s")
        elif p.exitcode:
            print(f"[{quant}] process exited with code {p.exitcode}")


if __name__ == "__main__":
    main()
