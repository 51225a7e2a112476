"""Engine overheads, measured by running the real engine on tiny random models.

What a decode step costs besides streaming weights (scheduler, metadata, launches, small ops,
Python) is found from the engine itself: decode steps of a tiny llama (width 256) with 2 and 6
layers, 1 and 8 sequences, short and long context. Four step times give four numbers:

    layer_overhead = (t[6 layers] - t[2 layers]) / 4 - matmuls of one tiny layer
    seq_overhead   = (t[8 seqs] - t[1 seq]) / (7 * 6)     per layer and extra sequence
    attn_gbs       = KV bytes of the longer context / (t[long] - t[short])
    step_overhead  = t[2 layers] - 2 * layer_overhead - the two layers' matmuls

The tiny models are written with `hetero synth` into a temporary folder (a few MB, ~1 s each).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from hetero.planner.device import DeviceProfile

SHAPE = "tiny-llama"
LONG_CONTEXT = 512
SHORT_CONTEXT = 16


def _write(folder: Path, n_layers: int) -> Path:
    from hetero.synth import write_synthetic
    from hetero.synth_shapes import get_shape

    shape = dataclasses.replace(get_shape(SHAPE), n_layers=n_layers)
    return write_synthetic(folder / f"tiny{n_layers}.gguf", shape, "q8_0", progress=False)


def _step_s(engine, seqs: int, context: int) -> float:
    """Median decode step seconds at `seqs` sequences of `context` prompt tokens."""
    from hetero.bench import run_bench

    run_bench(engine, seqs, seqs, context, 4, seed=1)  # warm-up (allocations, compilation)
    result = run_bench(engine, seqs, seqs, context, 16, seed=2)
    s = sorted(result.itl_s)
    return s[len(s) // 2]


def _engine(path: Path, device: str, kv_dtype: str):
    from hetero.config import RuntimeConfig
    from hetero.engine.config import EngineConfig, SchedulerConfig
    from hetero.engine.engine import Engine

    cfg = EngineConfig(
        kv_dtype=kv_dtype,
        num_kv_blocks=1024,
        enable_prefix_caching=False,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048),
    )
    return Engine(str(path), cfg, RuntimeConfig(device=device))


def calibrate(profile: DeviceProfile, device: str, kv_dtype: str, bar=None) -> dict[str, float]:
    """step/layer/seq overheads and attention KV GB/s of `device` (profile gives the matmul
    rates the tiny layers' own matmul time is estimated from)."""
    from hetero.planner.cost import DeviceCost, kv_token_bytes
    from hetero.planner.model_desc import from_gguf

    with tempfile.TemporaryDirectory(prefix="hetero-calibrate-") as tmp:
        t: dict[str, float] = {}
        for n_layers in (2, 6):
            path = _write(Path(tmp), n_layers)
            engine = _engine(path, device, kv_dtype)
            t[f"L{n_layers}"] = _step_s(engine, 1, SHORT_CONTEXT)
            if n_layers == 6:
                t["B8"] = _step_s(engine, 8, SHORT_CONTEXT)
                t["long"] = _step_s(engine, 1, LONG_CONTEXT)
            desc = from_gguf(str(path))
            del engine
            if bar is not None:
                bar.update(1)
    cost = DeviceCost(desc, profile, engine_weights(profile), kv_dtype)
    mm = cost.decode_layer_seconds(1, 0)[0] - profile.layer_overhead_s - profile.seq_overhead_s
    layer = max((t["L6"] - t["L2"]) / 4 - mm, 0.0)
    seq = max((t["B8"] - t["L6"]) / (7 * 6), 0.0)
    kv_bytes = 6 * (LONG_CONTEXT - SHORT_CONTEXT) * kv_token_bytes(desc, kv_dtype)
    # A longer context that measured no slower (noise) says nothing: keep the copy bandwidth.
    longer = t["long"] - t["L6"]
    attn = kv_bytes / longer / 1e9 if longer > 0 else profile.mem_bw_gbs
    step = max(t["L2"] - 2 * (layer + mm) - cost.head_seconds(1), 0.0)
    return dict(step_overhead_s=step, layer_overhead_s=layer, seq_overhead_s=seq, attn_gbs=attn)


def engine_weights(profile: DeviceProfile) -> str:
    """The weights mode the engine picks by default (RuntimeConfig weights="auto")."""
    from hetero.config import RuntimeConfig

    return RuntimeConfig(device="cpu" if profile.is_cpu else "cuda").weights_mode()
