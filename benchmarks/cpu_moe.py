"""Decode of a mixture-of-experts model on the CPU: experts on the qdot kernels against the
torch reference expert path (dequantize per call), and llama.cpp on the same file.

    python benchmarks/cpu_moe.py --peer-python /path/to/venv/bin/python --threads 2 \
        [--prompt-tokens 128] [--no-reference] [--torch-layer]

The file is a small Qwen3-MoE-shaped synth (`hetero synth`'s writer: 8 layers, width 1024, 32
experts of width 512, 8 a token, Q4_K_M), unless --file names one. Each round measures the sides
in turns, in reverse order every other round (hetero with qdot experts, hetero with reference
experts, llama.cpp through llama-cpp-python in another interpreter; --torch-layer adds the qdot
experts' layer as torch ops around the grouped calls, the path before the one native call), so
load drift on a shared machine hits all of them; medians and min-max over the rounds, and each
median against llama.cpp's. The reference side is the same engine with the experts' qdot path
switched off (model/moe.py's runs_on_qdot): its dense layers still run qdot. --prompt-tokens
adds a prompt of that many tokens (its tokens / the time to the first token), where the
experts' grouped matmul reads each chosen expert's blocks once for all the prompt's tokens it
holds.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
from pathlib import Path

from hetero.synth_shapes import ModelShape

SHAPE = ModelShape(
    arch="qwen3moe", n_layers=8, d_model=1024, n_heads=16, n_kv_heads=4, head_dim=64, d_ff=3072,
    n_experts=32, n_experts_used=8, d_ff_expert=512, vocab_size=32768, context_length=4096,
    tied_embeddings=False, qk_norm=True, rope_theta=1000000.0, norm_eps=1e-6,
)  # fmt: skip


class Hetero:
    """The offline engine on the CPU (qdot weights, no speculation); run() as the peer's."""

    def __init__(self, path: Path, threads: int, max_len: int):
        from hetero.config import RuntimeConfig
        from hetero.engine.config import EngineConfig, SchedulerConfig
        from hetero.launch import LaunchConfig, build_engine
        from hetero.model.llama import load_model

        sched = SchedulerConfig(max_model_len=max_len)
        cfg = EngineConfig(speculative="off", enable_prefix_caching=False, scheduler=sched)
        loaded = load_model(path, RuntimeConfig(device="cpu", threads=threads))
        self.engine = build_engine(None, LaunchConfig(cfg), loaded=loaded)
        self.model, self.n = loaded[1], 0

    run = None  # cpu_vs_llamacpp.Hetero.run, set in main()

    def torch_layer(self) -> Hetero:
        """The experts' layer as torch around the grouped calls (the router's module, then
        kernels/cpu_moe_layer.py's moe_layer_ref): the path before the one native call."""
        from hetero.kernels.cpu_moe_layer import moe_layer_ref
        from hetero.model.moe import SparseMoE

        for m in self.model.modules():
            if isinstance(m, SparseMoE):
                q = m.experts.qdot
                m._routed = None
                q.forward = lambda h, ids, w, layer=q.layer: moe_layer_ref(layer, h, ids, w)[0]
        return self


def _peer_module():
    spec = importlib.util.spec_from_file_location(
        "cpu_vs_llamacpp", Path(__file__).with_name("cpu_vs_llamacpp.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", default="", help="a MoE GGUF (default: the synth above)")
    ap.add_argument("--peer-python", default="", help="an interpreter with llama_cpp")
    ap.add_argument("--threads", type=int, default=0, help="0: hetero's default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="also a prompt of this many")
    ap.add_argument("--no-reference", action="store_true", help="skip the reference experts")
    ap.add_argument("--torch-layer", action="store_true", help="also the layer in torch")
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "hetero" / "bench"))
    args = ap.parse_args()
    path = Path(args.file) if args.file else Path(args.workdir) / "qwen3moe-small-q4_k_m.gguf"
    sides, threads = _sides(path, args)
    tests = {"decode": (16, args.decode_tokens)}
    if args.prompt_tokens:
        tests[f"prompt {args.prompt_tokens}"] = (args.prompt_tokens, 0)
    results = {(test, name): [] for test in tests for name in sides}
    for r in range(args.repeats + 1):  # round 0 warms up and is not counted
        load0 = os.getloadavg()[0]
        line = []
        order = list(sides.items())[:: -1 if r % 2 else 1]  # who runs after whom alternates
        for test, (prompt, decode) in tests.items():
            for name, side in order:
                tps = side.run(prompt, decode, 100 * r)
                line.append(f"{test} {name} {tps:.1f}")
                if r:
                    results[test, name].append(tps)
        print(f"round {r}: {', '.join(line)} tok/s (load {load0:.1f})", flush=True)
    print(f"\n{path.name}, {threads} threads, decode {args.decode_tokens} tokens, 1 stream")
    print("| test | side | median tok/s | min-max | vs llama.cpp |\n|---|---|---|---|---|")
    for (test, name), v in results.items():
        peer = results.get((test, "llama.cpp"))
        ratio = f"{statistics.median(v) / statistics.median(peer):.2f}x" if peer else ""
        spread = f"{min(v):.1f}-{max(v):.1f}"
        print(f"| {test} | {name} | {statistics.median(v):.1f} | {spread} | {ratio} |")


def _sides(path: Path, args) -> tuple[dict, int]:
    """hetero with qdot experts, with the reference experts (unless --no-reference), and
    llama.cpp where --peer-python names an interpreter; the file written first if missing."""
    from hetero.kernels import cpu_threads
    from hetero.model import moe
    from hetero.synth import write_synthetic

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(path, SHAPE, "q4_k_m", progress=False)
    threads = args.threads or cpu_threads.default_threads()
    bench = _peer_module()
    Hetero.run = bench.Hetero.run
    sides = {"qdot experts": Hetero(path, threads, 1024)}
    if args.torch_layer:
        sides["qdot experts, torch layer"] = Hetero(path, threads, 1024).torch_layer()
    if not args.no_reference:
        on_qdot = moe.runs_on_qdot
        moe.runs_on_qdot = lambda rt, weights: False  # the reference expert path, to compare
        sides["reference experts"] = Hetero(path, threads, 1024)
        moe.runs_on_qdot = on_qdot
    if args.peer_python:
        sides["llama.cpp"] = bench.PeerBindings(args.peer_python, path, threads)
    return sides, threads


if __name__ == "__main__":
    main()
