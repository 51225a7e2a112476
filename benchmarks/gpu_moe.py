"""The grouped MoE matmul (kernels/triton_moe.py) on the GPU: time per call against the device's
copy bandwidth, at a real model's expert shapes.

    python benchmarks/gpu_moe.py [--shape qwen3-30b-a3b|gpt-oss-20b] [--quant q4_k_m|mxfp4_moe]
                                 [--tokens 1,2,8,32,128,512] [--layers 8]
                                 [--block-n 0,32,16] [--gemv-max-slots 16,32,64]
                                 [--int-gemv off,128x4,64x8,256x2x128]
                                 [--mm-configs 64x128x4,32x128x4,64x256x8x3]
                                 [--gemv-sorted 0,256] [--gluon 0,64,128,256]

One MoE layer's expert tensors (gate|up joined as the model loads them: [E, 2F, C]; down:
[E, C, F]) in the types `hetero synth` gives them, random blocks, copied `--layers` times so
the weights streamed per step exceed the L2 as a model's layers do. Per T: random routings of T
tokens to k experts each; the gate|up and down calls of one layer, replayed from a CUDA graph
(device time), in us; the bytes of the experts the tokens touched, GB/s and its share of the
measured copy bandwidth (a 4 GiB device-to-device copy). Decode (T = 1) reads k of E experts:
its roofline is those bytes over the copy bandwidth. `--int-gemv` sweeps the integer Stream-K
GEMV of the decode slots (triton_moe.GEMV_INT): BN x programs an SM [x codes a unit], or off
(the float GEMV, whose rows a program --block-n sweeps). `--mm-configs` sweeps the sorted blocks'
kernel (more slots than the GEMV takes): rows a program x codes a step x warps [x stages].
`--gemv-sorted N` runs up to N slots through the GEMVs with the slots sorted by expert
(triton_moe.GEMV_SORTED_SLOTS; 0: off). `--gluon BN[xWARPS]` runs the sorted blocks of Q4_K,
Q4_0, Q4_1 and Q6_K through the Gluon kernel with BN rows a program (triton_moe.MM_GLUON,
GLUON_BN, GLUON_WARPS; 0: the Triton kernel), and checks its output against
the Triton kernel's (max error over the largest value).
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import torch

from hetero.kernels import triton_moe as tm
from hetero.kernels.streamk import StreamKConfig
from hetero.quant import get_quant, random_blocks
from hetero.synth import tensor_specs
from hetero.synth_shapes import get_shape


def copy_gbs(device: torch.device) -> float:
    """Device-to-device copy bandwidth, bytes read plus written (GB/s)."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        b.copy_(a)
    stop.record()
    torch.cuda.synchronize()
    return 5 * 2 * a.numel() / (start.elapsed_time(stop) / 1e3) / 1e9


def layer_experts(shape: str, quant: str, device: torch.device, copies: int, rng):
    """[(name, ggml type, (E, N, K), [packed copies], bytes)] of layer 0's expert tensors, gate
    and up joined into one [E, 2F, K] tensor where they share a type, as the model loads them
    (model/moe.py)."""
    specs = [s for s in tensor_specs(shape, quant) if s.name.startswith("blk.0.")]
    specs = {s.name.split(".")[2]: s for s in specs if len(s.shape) == 3}
    gate, up = specs.pop("ffn_gate_exps"), specs.pop("ffn_up_exps")
    parts = [[gate, up]] if gate.qtype == up.qtype else [[gate], [up]]
    out = []
    for group in [*parts, *([s] for s in specs.values())]:
        qt = get_quant(group[0].qtype)
        e, k = group[0].shape[0], group[0].shape[2]
        n = sum(s.shape[1] for s in group)
        packs = []
        for _ in range(copies):
            blocks = random_blocks(group[0].qtype, e * n * k // qt.block_size, rng)
            raw = torch.from_numpy(blocks).reshape(e, n, -1).to(device)
            packs.append(tm.prepare_moe(raw, int(qt.ggml_type), (e, n, k)))
        name = "|".join(s.name.split(".")[2] for s in group)
        out.append((name, int(qt.ggml_type), (e, n, k), packs, sum(s.nbytes for s in group)))
    return out


def int_config(text: str) -> StreamKConfig | None:
    """ "off" -> None; "BNxC[xSTEP]" -> the row-a-thread config (BN / 32 warps)."""
    if text == "off":
        return None
    bn, ctas, *step = (int(v) for v in text.split("x"))
    return StreamKConfig(
        bn=bn, step=step[0] if step else 256, ctas_per_sm=ctas, warps=bn // 32, rows=True
    )


def routing(t: int, k: int, e: int, device: torch.device, gen) -> torch.Tensor:
    return torch.rand(t, e, generator=gen).topk(k, dim=-1).indices.to(device)


def time_layer(experts, ids, c: int, device, copies: int) -> float:
    """us of one layer's gate, up and down calls (graph replays over the weight copies)."""
    t, k = ids.shape
    x = torch.randn(t, c, device=device, dtype=torch.bfloat16)
    f = next(shape[2] for name, _, shape, *_ in experts if name.startswith("ffn_down"))
    a = torch.randn(t * k, f, device=device, dtype=torch.bfloat16)

    def step():
        for i in range(copies):
            for name, qt, shape, packs, _ in experts:
                inp = a if name.startswith("ffn_down") else x
                tm.moe_matmul_triton(inp, packs[i], qt, shape, ids)

    step()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(10):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / 10 / copies


def check_gluon(experts, ids, c: int, device) -> str:
    """The Gluon kernel's outputs against the Triton kernel's on the same inputs: the largest
    error over the largest value, per expert tensor."""
    t, k = ids.shape
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(t, c, device=device, dtype=torch.bfloat16, generator=g)
    out = []
    for name, qt, shape, packs, _ in experts:
        inp = torch.randn(t * k, shape[2], device=device, dtype=torch.bfloat16, generator=g)
        inp = inp if name.startswith("ffn_down") else x
        got = tm.moe_matmul_triton(inp, packs[0], qt, shape, ids).float()
        tm.MM_GLUON = False
        want = tm.moe_matmul_triton(inp, packs[0], qt, shape, ids).float()
        tm.MM_GLUON = True
        out.append(f"{(got - want).abs().max().item() / want.abs().max().item():.1e}")
    return "err " + "/".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--layers", type=int, default=8, help="weight copies a step streams")
    ap.add_argument("--block-n", default="0", help="GEMV rows a program, in turn (0: default)")
    ap.add_argument(
        "--gemv-max-slots", default=str(tm.GEMV_MAX_SLOTS),
        help="the most slots the GEMV takes (more: the sorted kernel), in turn",
    )  # fmt: skip
    ap.add_argument("--int-gemv", default="128x4", help="integer GEMV configs, in turn (off: none)")
    ap.add_argument("--gemv-sorted", default="0", help="GEMV_SORTED_SLOTS values, in turn")
    ap.add_argument(
        "--gluon", default="0",
        help="Gluon kernel: rows a program [x warps], in turn (0: off)",
    )  # fmt: skip
    ap.add_argument("--gluon-bt", default="16", help="the Gluon kernel's fewest slots a block")
    ap.add_argument(
        "--mm-configs", default=f"{tm.BLOCK_N}x{tm.MM_STEP}x{tm.MM_WARPS}",
        help="sorted blocks: BNxSTEPxWARPS[xSTAGES], in turn",
    )  # fmt: skip
    args = ap.parse_args()
    device = torch.device("cuda")
    s = get_shape(args.shape)
    bw = copy_gbs(device)
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    # K-quant experts with a high plane as bytes, so that the integer configs can run them too
    tm.GEMV_INT_LINEAR = any(c != "off" for c in args.int_gemv.split(","))
    experts = layer_experts(args.shape, args.quant, device, args.layers, rng)
    types = ", ".join(f"{n} {get_quant(q).name}" for n, q, *_ in experts)
    print(f"{args.shape} {args.quant}: {s.n_experts} experts, {s.n_experts_used} a token; {types}")
    print(f"copy bandwidth {bw:.0f} GB/s (read + write)")
    print(f"{'T':>5} {'rows':>5} {'gemv<=':>6} {'sorted':>6} {'int':>9} {'mm':>11} {'gluon':>10} "
          f"{'us/layer':>10} {'touched MB':>11} {'GB/s':>8} {'of copy':>8}")  # fmt: skip
    layer_bytes = sum(nb for *_, nb in experts)
    for t in (int(v) for v in args.tokens.split(",")):
        ids = routing(t, s.n_experts_used, s.n_experts, device, gen)
        touched = layer_bytes * ids.unique().numel() / s.n_experts
        lists = [[int(v) for v in a.split(",")] for a in (args.block_n, args.gemv_max_slots)]
        mms = args.mm_configs.split(",")
        sorts = [int(v) for v in args.gemv_sorted.split(",")]
        gluons = args.gluon.split(",")
        gbts = [int(v) for v in args.gluon_bt.split(",")]
        for bn, most, cfg, mm, srt, glu, gbt in itertools.product(
            *lists, args.int_gemv.split(","), mms, sorts, gluons, gbts
        ):
            tm.GEMV_BLOCK_N, tm.GEMV_MAX_SLOTS, tm.GEMV_INT = bn, most, int_config(cfg)
            tm.GEMV_SORTED_SLOTS = srt
            gemv = t * s.n_experts_used <= max(most, srt)
            tm.GEMV_INT_LINEAR = cfg != "off"  # (the K-quants too, to compare)
            mm_bn, mm_step, mm_warps, *mm_stages = (int(v) for v in mm.split("x"))
            tm.BLOCK_N, tm.MM_STEP, tm.MM_WARPS = mm_bn, mm_step, mm_warps
            tm.MM_STAGES = mm_stages[0] if mm_stages else None
            if not gemv and (cfg != args.int_gemv.split(",")[0] or bn != lists[0][0]):
                continue  # (the sorted blocks: the same for every GEMV config)
            if gemv and mm != mms[0]:
                continue  # (the GEMVs: the same for every sorted-block config)
            if t * s.n_experts_used <= most and srt != sorts[0]:
                continue  # (few slots: the GEMVs in slot order whatever the bound)
            on = glu != "0"
            if (gemv and glu != gluons[0]) or (not on and gbt != gbts[0]):
                continue  # (the Gluon kernel runs sorted blocks only)
            if on:
                gbn, *gw = (int(v) for v in glu.split("x"))
                tm.GLUON_BN, tm.GLUON_WARPS = gbn, gw[0] if gw else 4
            tm.MM_GLUON, tm.GLUON_MIN_BT = on, gbt
            err = check_gluon(experts, ids, s.d_model, device) if on and not gemv else ""
            us = time_layer(experts, ids, s.d_model, device, args.layers)
            gbs = touched / (us / 1e6) / 1e9
            print(f"{t:>5} {bn or 'auto':>5} {most:>6} {srt:>6} {cfg:>9} {mm:>11} "
                  f"{glu:>7}/{gbt:<2} {us:>10.1f} {touched / 1e6:>11.1f} {gbs:>8.0f} "
                  f"{gbs / bw:>8.0%} {err}")  # fmt: skip
            tm.MM_GLUON = False


if __name__ == "__main__":
    main()
