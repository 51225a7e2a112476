"""Plans and profiles as text tables for the terminal."""

from __future__ import annotations

from hetero.planner.device import DeviceProfile
from hetero.planner.plan import Plan

GB = 1e9


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [
        fmt.format(*r) for r in rows
    ]


def _stage_row(s) -> list[str]:
    return [
        s.device,
        f"{s.layer_start}-{s.layer_end - 1} ({s.n_layers})",
        s.weights + (f" ({s.weights_reason})" if s.weights_reason else ""),
        f"{s.weight_bytes / GB:.2f}",
        str(s.num_kv_blocks),
        f"{s.kv_bytes / GB:.2f}",
        f"{s.kernels.get('qlinear', '?')}, kv {s.kv_dtype}",
        f"{s.predicted_step_s * 1e3:.1f}",
    ]


def format_plan(p: Plan) -> str:
    header = [
        "device",
        "layers",
        "weights",
        "weight GB",
        "KV blocks",
        "KV GB",
        "kernels",
        "step ms",
    ]
    rows = [_stage_row(s) for s in p.stages]
    lines = [f"plan for {p.model} ({p.n_layers} layers)", *_table(header, rows)]
    if len(p.stages) > 1:
        lines.append(
            "runs in one process: each stage's layers in turn (prompt steps stream the CPU's "
            "matmuls to the GPU)"
            if p.in_process
            else f"runs as a pipeline of {len(p.stages)} stage processes"
        )
    lines += [
        f"single stream: {p.single_stream_tok_s:.1f} tok/s",
        f"concurrency {p.concurrency}: {p.aggregate_tok_s:.1f} tok/s aggregate "
        f"({p.microbatches} micro-batch{'es' if p.microbatches > 1 else ''} in flight)",
        f"TTFT for {p.prompt_len} prompt tokens: {p.ttft_s * 1e3:.0f} ms alone, "
        f"{p.ttft_burst_s * 1e3:.0f} ms on average for {p.concurrency} arriving together",
        f"KV: {p.num_kv_blocks * p.block_size} tokens; max context at concurrency "
        f"{p.concurrency}: {p.max_context}; max concurrency at context {p.context}: "
        f"{p.max_concurrency}",
    ]
    if p.expert_bytes:
        lines.append(_experts_line(p))
    if p.unused_devices:
        lines.append(f"unused: {', '.join(p.unused_devices)}")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def _experts_line(p: Plan) -> str:
    """Where a mixture-of-experts model's experts are: in RAM for the first layers, or with
    their layers."""
    on_gpu = (p.expert_bytes - p.expert_ram_bytes) / GB
    n, total = p.experts_in_ram, p.n_layers
    if n == 0:
        return f"experts: with their layers ({on_gpu:.2f} GB)"
    ram = f"in RAM on {p.expert_device} ({p.expert_ram_bytes / GB:.2f} GB)"
    if n == total:
        return f"experts: every layer's {ram}; the rest of the model on the GPUs"
    rest = f"layers {n}-{total - 1} with their layers ({on_gpu:.2f} GB)"
    return f"experts: layers 0-{n - 1} {ram}, {rest}"


def format_profiles(profiles: list[DeviceProfile]) -> str:
    header = ["device", "name", "bus", "cc", "mem GB (free)", "copy GB/s", "TFLOP/s"]
    header += ["decode GB/s", "prefill TFLOP/s"]
    rows = []
    for d in profiles:
        kinds = [(k, r) for k, r in sorted(d.matmul.items()) if k.count(":") < 2]
        decode = ", ".join(f"{k} {r.decode_gbs:.3g}" for k, r in kinds)
        prefill = ", ".join(f"{k} {r.prefill_tflops:.3g}" for k, r in kinds)
        rows.append(
            [
                d.id,
                d.name,
                d.bus_id or "-",
                d.compute_capability or "-",
                f"{d.memory_total / GB:.1f} ({d.usable_memory / GB:.1f})",
                f"{d.mem_bw_gbs:.0f}",
                f"{d.bf16_tflops:.2f}",
                decode,
                prefill,
            ]
        )
    lines = _table(header, rows)
    for d in profiles:
        lines.append(
            f"{d.id}: step overhead {d.step_overhead_s * 1e3:.2f} ms, per layer "
            f"{d.layer_overhead_s * 1e3:.3f} ms (+{d.seq_overhead_s * 1e6:.1f} us a sequence), "
            f"{d.seq_step_overhead_s * 1e6:.1f} us a sequence once a step; "
            f"eager {d.eager_step_overhead_s * 1e3:.2f} ms + {d.eager_layer_overhead_s * 1e3:.3f} "
            "ms a layer; "
            f"attention {d.attn_gbs:.3g} GB/s of KV, host links {d.h2d_gbs:.1f}/{d.d2h_gbs:.1f} "
            f"GB/s, fp8 KV {'yes' if d.fp8_kv else 'no'}"
            + (
                f"; a streamed CPU layer's overhead {d.offload_layer_overhead_s * 1e3:.2f} ms"
                if d.offload_layer_overhead_s
                else ""
            )
            + f" [{d.source}]"
        )
    return "\n".join(lines)
