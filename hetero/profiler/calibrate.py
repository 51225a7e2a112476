"""Engine overheads, measured by running the real engine on small random models.

What a step costs besides the matmuls and KV reads (scheduler, metadata, launches, small ops,
Python) is found from the engine itself, as it runs: decode steps (on CUDA replayed from CUDA
graphs, the engine's default) and eager prefill steps (prompt graphs off here: a prefill past
them, and every step under --enforce-eager, pays these). Two models of 2 and 6 layers;
w(...) is what the cost model predicts for a step's matmuls and KV reads alone:

    attn_gbs       = KV bytes the longer context adds / (t[S seqs, long] - t[S seqs, short])
    layer_overhead = ((t[6 layers] - w) - (t[2 layers] - w)) / 4
    step_overhead  = (t[2 layers] - w) - 2 * layer_overhead
    d[L]           = (t[L layers, 8 seqs] - w) - (t[L layers, 1 seq] - w)   7 more sequences
    seq_overhead   = (d[6] - d[2]) / (7 * 4)          a layer and an extra row
    seq_step       = d[2] / 7 - 2 * seq_overhead      an extra sequence, once a step (sampler,
                                                      scheduler, metadata: not per layer)
    eager_*        = the same two lines over the time to first token of a 16-token prompt
    pipeline_hop   = t[6 layers as two CPU stage processes] - t[6 layers] - step_overhead
                     (CPU only: the host's cost of handing a step to the next stage process and
                     back, beyond the second stage's own step; GPU profiles take the CPU's)
    offload_layer  = (t[1 + 5 layers] - t[1 + 1 layers]) / 4 over the time to first token of an
                     OFFLOAD_PROMPT-token prompt, the first layer on the GPU and the others on
                     the CPU in one process with their matmuls streamed to the GPU (GPU only:
                     what such a layer costs besides its priced work: the op-by-op path's small
                     ops and launches, the crossings' waits; the tiny layer's own work is a few
                     hundred us at most)

(A per-row cost measured on the 6-layer model alone and charged per layer made a 32-layer model's
batched decode steps a third too slow on the H200: the sampler's per-sequence work is paid once.)

The models are small (the profile stays quick) but their attention is an 8B's: on a GPU 8 KV
heads of 128 and the context 1536 tokens at 8 sequences, so the longer context reads tens of MB
(a tiny model's KV reads are latency, not bandwidth, and gave a meaningless attn_gbs); on a CPU
32 query heads over 8 KV heads of 128 (Llama-3's, Qwen's grouping), one sequence of 512 tokens.
The tiny model's 4 heads over 2 of 64 misread the CPU both ways: on the 2-core development
machine it read 12.3 GB/s where an 8B's heads read 7.4 (four query heads a KV head: more work a
byte), and a 16-core host's threads split 2 KV heads among them.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import tempfile
from pathlib import Path

import torch

from hetero.bench import run_bench
from hetero.config import RuntimeConfig
from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.factory import LaunchConfig, assemble
from hetero.pipeline.stages import parse_split
from hetero.planner.cost import DeviceCost, kv_token_bytes
from hetero.planner.device import DeviceProfile
from hetero.planner.model_desc import from_gguf
from hetero.synth import write_synthetic
from hetero.synth_shapes import get_shape

SHAPE = "tiny-llama"
# tokens: at least RuntimeConfig's offload_min_tokens, so the CPU layers' matmuls stream
OFFLOAD_PROMPT = 64
GPU_SHAPE = dict(d_model=1024, n_heads=8, n_kv_heads=8, head_dim=128, d_ff=1024)
PROMPT = 16


@dataclasses.dataclass(frozen=True)
class _Setting:
    shape: dict
    attn_seqs: int  # sequences of the long/short context pair
    long_context: int
    num_kv_blocks: int


CPU_SHAPE = dict(n_heads=32, n_kv_heads=8, head_dim=128)  # d_model stays the tiny model's 256
CPU_SETTING = _Setting(CPU_SHAPE, 1, 512, 1024)
GPU_SETTING = _Setting(GPU_SHAPE, 8, 1536, 2048)


def _write(folder: Path, n_layers: int, shape: dict) -> Path:
    shape = dataclasses.replace(get_shape(SHAPE), n_layers=n_layers, **shape)
    return write_synthetic(folder / f"tiny{n_layers}.gguf", shape, "q8_0", progress=False)


# Each time is the median of REPEATS medians (one run's outlier is dropped, and the benchmarks the
# plan is held against report medians too: the least of them priced the 2-core development
# machine's 16-stream decode 1.29x fast). The overheads are differences of such times, a few ms
# on a CPU: one median of 16 steps put its per-layer overhead anywhere in 0.06-0.45 ms.
REPEATS = 3


def _step_s(engine, seqs: int, context: int, tokens: int = 16) -> float:
    """Decode step seconds at `seqs` sequences of `context` prompt tokens."""
    run_bench(engine, seqs, seqs, context, 4, seed=1)  # warm-up (allocations, compilation)
    return statistics.median(
        statistics.median(run_bench(engine, seqs, seqs, context, tokens, seed=2 + r).itl_s)
        for r in range(REPEATS)
    )


def _ttft_s(engine, prompt: int = PROMPT) -> float:
    """Time to the first token of one `prompt`-token prompt (an eager prefill step)."""
    run_bench(engine, 1, 1, prompt, 1, seed=3)  # warm-up (compilation; a split's pinning)
    return statistics.median(
        statistics.median(run_bench(engine, 5, 1, prompt, 1, seed=4 + 10 * r).ttft_s)
        for r in range(REPEATS)
    )


def _config(kv_dtype: str, blocks: int) -> EngineConfig:
    return EngineConfig(
        kv_dtype=kv_dtype,
        num_kv_blocks=blocks,
        enable_prefix_caching=False,
        speculative="off",  # the cost model prices plain decode steps
        cuda_graph_max_tokens=0,  # the 16-token prefill runs eagerly: it measures eager_*
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048),
    )


def _engine(path: Path, device: str, kv_dtype: str, blocks: int, split: str | None = None):
    """The engine on the small model; `split`: as a pipeline of stage processes instead."""
    stages = None if split is None else parse_split(split, 6)
    cfg = _config(kv_dtype, blocks)
    return assemble(path, LaunchConfig(cfg, RuntimeConfig(device=device)), stages)


def offload_ttft_s(path: Path, device: str, kv_dtype: str, blocks: int) -> float:
    """Time to the first token of one OFFLOAD_PROMPT-token prompt with the model's first layer on
    `device` and the rest on the CPU in one process (-ngl 1), prompt steps streaming the CPU
    layers' matmuls to `device` (on the CPU itself in tests: the same code)."""
    rt = RuntimeConfig(device=device, n_gpu_layers=1)
    engine = assemble(path, LaunchConfig(_config(kv_dtype, blocks), rt), split_on=device)
    try:
        return _ttft_s(engine, OFFLOAD_PROMPT)
    finally:
        engine.close()
        del engine
        _release()


def _release() -> None:
    """Free what a closed engine held. On a GPU its model sits in reference cycles (found by
    the collector only): 0.98 GiB of the small models' weights were still allocated after the
    profile on the H200, and the plan's engine, built next in the same process (hetero-serve
    with no cached profile), ran out of its capped memory. The allocator's cache goes back too."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _measure(device: str, kv_dtype: str, s: _Setting, folder: Path, bar) -> tuple[dict, object]:
    t: dict[str, float] = {}
    for n_layers in (2, 6):
        path = _write(folder, n_layers, s.shape)
        engine = _engine(path, device, kv_dtype, s.num_kv_blocks)
        t[f"L{n_layers}"] = _step_s(engine, 1, PROMPT)
        t[f"P{n_layers}"] = _ttft_s(engine)
        t[f"B{n_layers}"] = _step_s(engine, 8, PROMPT)
        if n_layers == 6:
            short = t["L6"] if s.attn_seqs == 1 else t["B6"]
            t["long"] = _step_s(engine, s.attn_seqs, s.long_context) - short
        desc = from_gguf(str(path))
        del engine
        _release()
        if device != "cpu":  # the -ngl 1 split of the same model, in one process
            t[f"O{n_layers}"] = offload_ttft_s(path, device, kv_dtype, s.num_kv_blocks)
        if bar is not None:
            bar.update(1)
    if device == "cpu":  # the same 6 layers as two stage processes: the hand-off's cost
        engine = _engine(path, device, kv_dtype, s.num_kv_blocks, split="cpu=0-2,cpu=3-5")
        try:
            t["H6"] = _step_s(engine, 1, PROMPT, tokens=64)  # three processes: noisier
        finally:
            engine.close()
            del engine
            _release()
        if bar is not None:
            bar.update(1)
    return t, desc


def calibrate(
    profile: DeviceProfile, device: str, kv_dtype: str, bar=None, setting: _Setting | None = None
) -> dict[str, float]:
    """Decode and eager overheads and attention KV GB/s of `device` (the profile's matmul rates
    give the small models' own matmul time). setting: by the device's kind unless given."""
    setting = setting or (CPU_SETTING if profile.is_cpu else GPU_SETTING)
    with tempfile.TemporaryDirectory(prefix="hetero-calibrate-") as tmp:
        t, desc = _measure(device, kv_dtype, setting, Path(tmp), bar)
    extra = setting.long_context - PROMPT
    kv_bytes = setting.attn_seqs * 6 * extra * kv_token_bytes(desc, kv_dtype)
    # A longer context that measured no slower (noise) says nothing: keep the copy bandwidth.
    attn = kv_bytes / t["long"] / 1e9 if t["long"] > 0 else profile.mem_bw_gbs
    w = _work(desc, profile.replace(attn_gbs=attn), kv_dtype)
    layer = max((t["L6"] - w(6, 1)) - (t["L2"] - w(2, 1)), 0.0) / 4
    d = {n: (t[f"B{n}"] - w(n, 8)) - (t[f"L{n}"] - w(n, 1)) for n in (2, 6)}
    seq = max(d[6] - d[2], 0.0) / (7 * 4)
    seq_step = max(d[2] / 7 - 2 * seq, 0.0)
    eager_layer = max((t["P6"] - w(6, 0)) - (t["P2"] - w(2, 0)), 0.0) / 4
    step = max(t["L2"] - w(2, 1) - 2 * layer, 0.0)
    out = dict(
        step_overhead_s=step,
        layer_overhead_s=layer,
        seq_overhead_s=seq,
        seq_step_overhead_s=seq_step,
        attn_gbs=attn,
        eager_step_overhead_s=max(t["P2"] - w(2, 0) - 2 * eager_layer, 0.0),
        eager_layer_overhead_s=eager_layer,
    )
    if "H6" in t:  # two stages' tokens: one more stage's step overhead, and the hand-off
        out["pipeline_hop_s"] = max(t["H6"] - t["L6"] - step, 0.0)
    if "O6" in t:  # four more streamed CPU layers
        out["offload_layer_overhead_s"] = max(t["O6"] - t["O2"], 0.0) / 4
    return out


def _work(desc, profile: DeviceProfile, kv_dtype: str):
    """w(n_layers, m): predicted matmul, KV and head seconds of a decode step of m sequences
    (m = 0: the PROMPT-token prefill) with every overhead zero."""
    bare = profile.replace(
        step_overhead_s=0.0, layer_overhead_s=0.0, seq_overhead_s=0.0, seq_step_overhead_s=0.0,
        eager_step_overhead_s=0.0, eager_layer_overhead_s=0.0,
    )  # fmt: skip
    cost = DeviceCost(desc, bare, engine_weights(profile), kv_dtype, graphs=True, max_num_seqs=8)

    def w(n_layers: int, m: int) -> float:
        if m == 0:
            return sum(cost.prefill_layer_seconds(PROMPT, 0)[:n_layers]) + cost.head_seconds(1)
        return sum(cost.decode_layer_seconds(m, PROMPT)[:n_layers]) + cost.head_seconds(m)

    return w


def engine_weights(profile: DeviceProfile) -> str:
    """The weights mode the engine picks by default (RuntimeConfig weights="auto")."""
    return RuntimeConfig(device="cpu" if profile.is_cpu else "cuda").weights_mode()
