"""Restore a long context from the RAM tier vs recompute it: bandwidth and TTFT.

One prompt of --context tokens is computed, its KV blocks are evicted to the host-RAM tier, and
the same prompt is asked again: the re-request restores the prefix (TTFT restore). Then every
tier is emptied and it is asked once more (TTFT recompute). The roofline is the pinned
host-to-device copy bandwidth measured in the same run (on a CPU: a plain memory copy).

    python benchmarks/kv_restore.py MODEL --device cuda --context 32768          # H200, 8B synth
    python benchmarks/kv_restore.py MODEL --device cpu --context 256 --block-size 8   # quick

Targets (issue 8): restore >= 70% of the pinned H2D bandwidth, TTFT restore <= TTFT recompute / 20.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from hetero.config import RuntimeConfig
from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.engine.engine import Engine
from hetero.factory import LaunchConfig
from hetero.launch import build_engine
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams

GiB = 2**30


def copy_bandwidth(device: str, nbytes: int, reps: int = 5) -> float:
    """Bytes/s of a host -> device copy from pinned memory (CPU: memory to memory), best of reps."""
    cuda = torch.device(device).type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def ttft(engine: Engine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first token, and the prompt tokens served by the cache."""
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                first = time.perf_counter() - t0
                cached = out.num_cached_tokens
    if torch.device(engine.executor.info.device).type == "cuda":
        torch.cuda.synchronize()
    return first, cached


def measure(model: str, context: int, device: str, kv_dtype: str, block_size: int) -> dict:
    rng = random.Random(0)
    n_blocks = -(-(context + 64) // block_size)
    probe = EngineConfig(block_size=block_size, kv_dtype=kv_dtype, num_kv_blocks=1, kv_ram_gb=0)
    loaded = load_model(model, RuntimeConfig(device=device))
    engine = build_engine(model, LaunchConfig(probe), loaded=loaded)
    ctx_bytes = n_blocks * engine.executor.pool_size.block_bytes
    cfg = EngineConfig(
        block_size=block_size,
        kv_dtype=kv_dtype,
        num_kv_blocks=n_blocks + 16,
        kv_ram_gb=ctx_bytes * 1.1 / GiB + 0.01,
        # past the model's trained context if need be (a synthetic model's weights are random)
        scheduler=SchedulerConfig(max_model_len=context + 64),
    )
    engine = build_engine(model, LaunchConfig(cfg), loaded=loaded)
    vocab = engine.model_config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(context)]
    ttft(engine, "warmup", [rng.randrange(vocab) for _ in range(min(context, 512))])
    first, _ = ttft(engine, "compute", prompt)
    kv, bm = engine.kv_tiers, engine.block_manager
    t0 = time.perf_counter()
    blocks = kv.offload_all(bm)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    offload_s = time.perf_counter() - t0
    st = kv.tiers.stats
    moved0, secs0 = st.bytes_moved.get("ram->device", 0), st.restore_s
    restore_ttft, cached = ttft(engine, "restore", prompt)
    restored = st.bytes_moved.get("ram->device", 0) - moved0
    restore_s = st.restore_s - secs0
    bm.reset_prefix_cache()
    kv.tiers.drop_ram()
    recompute_ttft, cold = ttft(engine, "recompute", prompt)
    bw = copy_bandwidth(device, min(GiB, max(restored, 1 << 20)))
    return {
        "device": device,
        "context": context,
        "kv_dtype": kv_dtype,
        "blocks_evicted": blocks,
        "block_bytes": engine.executor.pool_size.block_bytes,
        "first_compute_ttft_s": first,
        "offload_s": offload_s,
        "restored_bytes": restored,
        "restore_s": restore_s,
        "restore_gbps": restored / restore_s / 1e9 if restore_s else 0.0,
        "copy_gbps": bw / 1e9,
        "cached_tokens_restore": cached,
        "cached_tokens_recompute": cold,
        "ttft_restore_s": restore_ttft,
        "ttft_recompute_s": recompute_ttft,
    }


def report(r: dict) -> list[str]:
    share = r["restore_gbps"] / r["copy_gbps"] if r["copy_gbps"] else 0.0
    ratio = r["ttft_recompute_s"] / r["ttft_restore_s"] if r["ttft_restore_s"] else 0.0
    return [
        f"{r['context']} tokens, {r['kv_dtype']} KV on {r['device']}: "
        f"{r['restored_bytes'] / 2**20:.1f} MiB restored ({r['blocks_evicted']} blocks evicted)",
        f"restore {r['restore_gbps']:.2f} GB/s in {r['restore_s'] * 1e3:.1f} ms; "
        f"pinned H2D copy {r['copy_gbps']:.2f} GB/s -> {share:.0%} (target >= 70%)",
        f"TTFT restore {r['ttft_restore_s'] * 1e3:.1f} ms ({r['cached_tokens_restore']} cached) vs "
        f"recompute {r['ttft_recompute_s'] * 1e3:.1f} ms: {ratio:.1f}x faster (target >= 20x)",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--kv-dtype", default="fp8")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", help="also write the numbers to this file")
    a = ap.parse_args()
    r = measure(a.model, a.context, a.device, a.kv_dtype, a.block_size)
    print("\n".join(report(r)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
