"""moe_matmul on CUDA through Triton: a grouped matmul over quantized expert weights.

Same contract as `moe_matmul_ref` (kernels/moe.py): y [S, N], slot s = t * k + j of topk_ids
[T, k] times its expert's W [N, K], x [T, K] (slot s reads row s // k) or [S, K] (row s).

The layout of vLLM's fused_moe (moe_align_block_size): the S slots are sorted by expert into
blocks of BT, each block one expert's, an expert's last block padded with the id S (no slot):

    topk_ids  [[2, 0], [2, 1], [0, 2]]          T = 3, k = 2, S = 6, BT = 4
    slots by expert     0: 1 5   1: 3   2: 0 2 4
    sorted_ids   [1 5 S S | 3 S S S | 0 2 4 S]  (+ unused blocks up to the static bound)
    expert_ids   [0       | 1       | 2      ]  (-1 for the unused blocks: they exit at once)

Few slots (a decode step's, up to GEMV_MAX_SLOTS) skip the sort: bf16 / fp16 slots of a
codebook type (gpt-oss's MXFP4, IQ4_*) run the dense decode's Stream-K kernel with a row a thread
and integer dot products over all the slots' row tiles at once (triton_moe_streamk: each tile
reads its slot's expert's rows straight from topk_ids); the others one program per (slot, tile
of rows), `_moe_gemv_kernel`, the float decode loop of the dense GEMV (faster for the K-quants:
GEMV_INT below). Otherwise one program per (block, tile of BN output rows) decodes its
expert's weight tile once and multiplies it with the block's BT rows of x on the tensor cores,
the `_qmm_kernel` step with the rows offset to the expert (the experts' matrices are one packed
[E * N, K] weight: kernels/repack.py, every packable type including the codebook ones, MXFP4
for gpt-oss). Blocks of Q4_K, Q4_0, Q4_1 and Q6_K with 16-bit x and 8 or 16 slots take the
Gluon kernel instead (triton_gluon_moe: the weights decoded in the tensor cores' register
fragments; 8 slots a block where the experts average at most 4, a decode step of many streams).

The sort (triton_moe_sort) runs on the device with shapes fixed by (T, k, E) alone (no host
sync), so a decode step's MoE layers capture in a CUDA graph.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from hetero.kernels.moe import moe_matmul_ref, slot_row_div
from hetero.kernels.pdl import pdl_launch
from hetero.kernels.registry import register
from hetero.kernels.repack import PackedWeight, chunk_codes, packable, repack
from hetero.kernels.streamk import StreamKConfig, _asm_ok, schedule
from hetero.kernels.triton_moe_sort import sort_by_expert
from hetero.kernels.triton_qmatmul import (
    _GEMV_WARPS,
    _counters,
    _plane_args,
    _sm_count,
    gemv_block_n,
    triton_supported,
)
from hetero.kernels.xquant import QuantizedRows, XLayout, silu_mul_xquant, xquant

# The sorted blocks' kernel: output rows a program, codes of K a step, warps, software-pipeline
# stages (None: Triton's default); benchmarks/gpu_moe.py --mm-configs sweeps them
BLOCK_N = 64
MM_STEP = 128
MM_WARPS = 4
MM_STAGES: int | None = None
# Q4_K / Q4_0 / Q4_1 / Q6_K blocks of 16-bit slots by the Gluon kernel (triton_gluon_moe: the
# weights decoded in the tensor cores' register fragments), 16 rows a warp, GLUON_BN rows a
# program; HETERO_MOE_MM_GLUON=0 keeps the Triton kernel. H200, Qwen3-30B-A3B's experts, one
# layer at 32 tokens (benchmarks/gpu_moe.py --gluon 0,64,128 --gluon-bt 16,8): Triton 276.8
# us, Gluon 64 rows / 8 slots 165.0 (16 slots 196.0; 128 rows 181.7-183.3)
MM_GLUON = os.environ.get("HETERO_MOE_MM_GLUON", "1") == "1"
GLUON_WARPS = 4
GLUON_BN = int(os.environ.get("HETERO_MOE_GLUON_BN", "64"))  # a multiple of 16 GLUON_WARPS
# The fewest slots a block for the Gluon kernel: 8 (one n-tile of mma.sync) where the experts
# get at most 4 slots on average (a decode step of many streams), else block_rows' 16
GLUON_MIN_BT = int(os.environ.get("HETERO_MOE_GLUON_BT", "8"))
# Up to this many slots (T * k), each slot reads its expert's rows on its own (the GEMV kernel):
# a decode step's k slots choose k distinct experts, so sorting them would only add launches and
# pad each expert's one row to a tensor-core tile of 16
GEMV_MAX_SLOTS = 16
# Up to this many slots (and more than GEMV_MAX_SLOTS) the GEMVs run the slots sorted by expert
# (x's rows gathered in that order, y's scattered back), so that the programs of one expert's
# slots run side by side and read its rows from L2 after the first; 0: the sorted blocks above
# GEMV_MAX_SLOTS (off until measured: benchmarks/gpu_moe.py --gemv-sorted sweeps it, and
# HETERO_MOE_GEMV_SORTED=N sets it for a whole model's run)
GEMV_SORTED_SLOTS = int(os.environ.get("HETERO_MOE_GEMV_SORTED", "0"))
# Rows a GEMV program; 0: the dense decode kernel's (gemv_block_n). A decode step's expert
# matrices are small (8 x 1536 x 2048 codes), so fewer rows a program give more programs to fill
# the SMs: benchmarks/gpu_moe.py --block-n sweeps it. H200, Qwen3-30B-A3B, one token: 32 rows
# 19.7 us a layer, 16 rows 22.2, the default 22.1
GEMV_BLOCK_N = 32
# The integer Stream-K GEMV of bf16 / fp16 slots (None: the float GEMV above for every dtype):
# rows a tile (32 x warps), codes of K a unit, programs an SM. H200, one token's gate|up and down
# (benchmarks/gpu_moe.py --tokens 1 --int-gemv ..): gpt-oss-20b's MXFP4 experts 100.6 us a layer
# by the float GEMV, 55-58 by this one (64-128 rows a tile); Qwen3-30B-A3B's Q4_K / Q6_K 23.4 by
# the float GEMV, 26.3-29.3 by this one (its two activation quantizations included). So the
# codebook types take it, and linear codes only with GEMV_INT_LINEAR.
GEMV_INT = StreamKConfig(bn=128, step=256, ctas_per_sm=4, warps=4, rows=True)
GEMV_INT_LINEAR = False


@dataclass(eq=False)
class PackedExperts:
    """Expert weights [E, N, K] as one packed [E * N, K] weight (expert e: rows e*N ..)."""

    packed: PackedWeight
    shape: tuple[int, int, int]


def prepare_moe(qweight: Any, ggml_type: int, shape: tuple[int, int, int]) -> Any:
    """Load-time hook: GGUF bytes [E, N, row_bytes] -> PackedExperts (dense floats and types
    without a packed layout pass through, to the reference)."""
    if isinstance(qweight, PackedExperts) or qweight.is_floating_point():
        return qweight
    if not packable(ggml_type):
        return qweight
    e, n, k = shape
    # the high plane as bytes where the integer GEMV may read it (it reads only that arrangement,
    # the float kernels either; bytes cost the repack of streamed experts a pass more)
    layout = "bytes" if GEMV_INT_LINEAR else "fields"
    packed = repack(qweight.reshape(e * n, -1), ggml_type, (e * n, k), high_layout=layout)
    return PackedExperts(packed, tuple(shape))


def block_rows(n_slots: int, n_experts: int) -> int:
    """BT: slots a block, from the slots an expert gets on average (16: tl.dot's least)."""
    per_expert = n_slots / n_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def int_input(qweight: Any, slots: int, dtype: torch.dtype) -> XLayout | None:
    """The layout in which the integer GEMV reads `slots` slots of these experts, or None where
    another kernel runs them."""
    if not isinstance(qweight, PackedExperts) or not 0 < slots <= GEMV_MAX_SLOTS:
        return None
    pw = qweight.packed
    return XLayout(pw.spec.low_bits, pw.spec.group) if _int_gemv_ok(pw, dtype) else None


def quantize_input(
    qweight: Any, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> QuantizedRows | None:
    """The down projection's input act(gate, up) [S, F] as QuantizedRows where these experts
    read it by the integer GEMV (one launch for the activation and the quantization), else None
    (the caller makes it as usual)."""
    layout = int_input(qweight, gate.shape[0], gate.dtype)
    if layout is None:
        return None
    return QuantizedRows(*silu_mul_xquant(gate, up, layout, activation), layout, gate.dtype)


@register(
    "moe_matmul", "triton", priority=10, supports=triton_supported, prepare=prepare_moe,
    quantize_input=quantize_input,
)  # fmt: skip
def moe_matmul_triton(
    x: torch.Tensor | QuantizedRows,
    qweight: Any,
    ggml_type: int,
    shape: tuple[int, int, int],
    topk_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [S, N] (moe_matmul_ref's contract); qweight a PackedExperts or the GGUF bytes; x may
    be QuantizedRows in the layout `int_input` gives."""
    if isinstance(x, QuantizedRows):
        return _from_quantized(x, qweight, shape, topk_ids, bias)
    if not isinstance(qweight, PackedExperts):
        qweight = prepare_moe(qweight, ggml_type, shape)
        if not isinstance(qweight, PackedExperts):
            return moe_matmul_ref(x, qweight, ggml_type, shape, topk_ids, bias)
    n_experts, n, k = shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the experts take {k}")
    t, top = topk_ids.shape
    s = t * top
    x_div = slot_row_div(x, topk_ids)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(s, n, dtype=x.dtype, device=x.device)
    if s == 0:
        return y
    pw = qweight.packed
    args, meta = _plane_args(pw)
    e = chunk_codes(pw.spec.low_bits)
    if s <= max(GEMV_MAX_SLOTS, GEMV_SORTED_SLOTS):
        ids = topk_ids.reshape(-1).contiguous()
        order = None
        if s > GEMV_MAX_SLOTS:  # an expert's slots side by side: its rows read again from L2
            order = torch.argsort(ids, stable=True)
            x, ids, x_div = x[order // x_div], ids[order], 1
        if _int_gemv_ok(pw, x.dtype):  # (the bias added in the kernel)
            y = _moe_streamk(x, pw, ids, n, x_div, y, GEMV_INT, bias)
        else:
            bn = GEMV_BLOCK_N or gemv_block_n(pw.spec)
            _kernels()._moe_gemv_kernel[(s, -(-n // bn))](
                x, y, ids, *args[:6], n, k // e, x_div, x.stride(0), y.stride(0), *args[6:],
                **meta, BN=bn, S=256 // e, num_warps=_GEMV_WARPS, **pdl_launch(x),
            )  # fmt: skip
            y = _biased(y, bias, ids)
        if order is not None:  # back to slot order
            out = torch.empty_like(y)
            out[order] = y
            y = out
        return y
    bt = block_rows(s, n_experts)
    if MM_GLUON and GLUON_MIN_BT == 8 and s <= 4 * n_experts and _gluon_runs(pw, x, k, 8):
        bt = 8
    sorted_ids, expert_ids = sort_by_expert(topk_ids, n_experts, bt)
    if MM_GLUON and _gluon_runs(pw, x, k, bt):
        _gluon_blocks(x, y, pw, sorted_ids, expert_ids, n, k, s, x_div, bt, GLUON_BN)
        return _biased(y, bias, topk_ids.reshape(-1))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    grid = (expert_ids.shape[0], -(-n // BLOCK_N))
    stages = {} if MM_STAGES is None else {"num_stages": MM_STAGES}
    _kernels()._moe_mm_kernel[grid](
        x, y, sorted_ids, expert_ids, *args[:6], n, k // e, s, x_div, x.stride(0), y.stride(0),
        *args[6:], **meta, BN=BLOCK_N, BT=bt, S=max(1, MM_STEP // e), PRECISION=precision,
        num_warps=MM_WARPS, **stages,
    )  # fmt: skip
    return _biased(y, bias, topk_ids.reshape(-1))


def _gluon_blocks(
    x: torch.Tensor, y: torch.Tensor, pw: PackedWeight, sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor, n: int, k: int, n_slots: int, x_div: int, bt: int, bn: int,
) -> None:  # fmt: skip
    """`moe_mm_mma_kernel` over the sorted blocks: y's rows of the slots (module docstring)."""
    from hetero.kernels.triton_gluon_moe import moe_mm_mma_kernel, tile_layouts

    args, _ = _plane_args(pw)
    spec, e = pw.spec, chunk_codes(pw.spec.low_bits)
    w_l, s_l, x_l = tile_layouts(GLUON_WARPS, bn // (16 * GLUON_WARPS), bt)
    moe_mm_mma_kernel[(expert_ids.shape[0], -(-n // bn))](
        x, y, sorted_ids, expert_ids, *args[:6], n, k // e, n_slots, x_div, x.stride(0),
        y.stride(0), *args[6:9], HB=spec.high_bits, G=spec.group, OFF=spec.offset,
        KQUANT=spec.kquant, HAS_MIN=spec.has_min, BN=bn, BT=bt, WARPS=GLUON_WARPS, W_L=w_l,
        S_L=s_l, X_L=x_l, num_warps=GLUON_WARPS,
    )  # fmt: skip


def gluon_dense(x: torch.Tensor, pw: PackedWeight, bt: int = 16, bn: int = 0) -> torch.Tensor:
    """y [T, N] = x @ W^T by the Gluon blocks kernel, W as one expert and x's T rows its slots
    in blocks of bt (each block decodes the weight again; a tile of rows' blocks are
    neighbouring programs, so the blocks after the first read it from L2). Not dispatched:
    benchmarks/gpu_qmicro.py times it against the dense tensor-core kernels (batched decode,
    issue 23's 64 streams)."""
    t, k = x.shape
    n = pw.shape[0]
    if not gluon_takes(pw.spec, pw.high_layout, x.dtype, k, bt):
        raise ValueError(f"the Gluon kernel does not take {pw.ggml_type.name} at K {k}, {bt} rows")
    blocks = -(-t // bt)
    sorted_ids = torch.full((blocks * bt,), t, dtype=torch.int32, device=x.device)
    sorted_ids[:t] = torch.arange(t, dtype=torch.int32, device=x.device)
    expert_ids = torch.zeros(blocks, dtype=torch.int32, device=x.device)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    _gluon_blocks(x, y, pw, sorted_ids, expert_ids, n, k, t, 1, bt, bn or GLUON_BN)
    return y


def gluon_takes(spec: Any, high_layout: str, dtype: torch.dtype, k: int, bt: int) -> bool:
    """Whether the Gluon kernel takes such blocks: 4-bit codes whose group is a chunk, without
    a high plane or codebook (Q4_K, Q4_0, Q4_1), or Q6_K with its high plane as fields; 16-bit
    x, K in steps of 128 codes, 8 or 16 slots a block (its x fragments sit in registers)."""
    q4 = spec.group == 32 and not spec.high_bits
    q6 = spec.group == 16 and spec.high_bits == 2 and spec.kquant and high_layout == "fields"
    return (
        spec.low_bits == 4 and (q4 or q6) and not spec.codebook and not spec.packed_min
        and dtype in (torch.bfloat16, torch.float16) and k % 128 == 0 and bt in (8, 16)
    )  # fmt: skip


def _gluon_runs(pw: PackedWeight, x: torch.Tensor, k: int, bt: int) -> bool:
    return gluon_takes(pw.spec, pw.high_layout, x.dtype, k, bt) and _gluon_ok(x.device)


def _gluon_ok(device: torch.device) -> bool:
    """Gluon kernels run compiled on CUDA (sm_80+: mma.sync), never under the interpreter, and
    only with the Triton it is written for (3.6 on: Gluon's API still moves between releases;
    older ones, as older torch builds bring, keep the Triton kernel)."""
    return (
        device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
        and torch.cuda.get_device_capability(device) >= (8, 0) and _has_gluon()
    )  # fmt: skip


@functools.cache
def _has_gluon() -> bool:
    import triton

    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 6):
        return False
    try:
        import triton.experimental.gluon.language.nvidia.ampere  # noqa: F401
    except ImportError:
        return False
    return True


def _biased(y: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    return y if bias is None else y + bias[ids].to(y.dtype)


def _from_quantized(
    xq: QuantizedRows, qweight: Any, shape: tuple[int, int, int], topk_ids: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    s, n, k = topk_ids.numel(), shape[1], shape[2]
    if int_input(qweight, s, xq.dtype) != xq.layout or xq.shape[1] != k:
        raise ValueError("quantized rows must be in the layout int_input gives for these experts")
    y = torch.empty(s, n, dtype=xq.dtype, device=xq.device)
    ids = topk_ids.reshape(-1).contiguous()
    return _moe_streamk(xq, qweight.packed, ids, n, slot_row_div(xq, topk_ids), y, GEMV_INT, bias)


def _int_gemv_ok(pw: PackedWeight, dtype: torch.dtype) -> bool:
    """Whether the integer Stream-K GEMV runs these slots: 16-bit activations (float32 ones
    keep the float decode, whose rounding they need), a codebook type (or GEMV_INT_LINEAR), a
    high plane as bytes, a unit of whole chunks and K in whole blocks of xquant."""
    cfg, spec = GEMV_INT, pw.spec
    if cfg is None or dtype not in (torch.bfloat16, torch.float16):
        return False
    if not spec.codebook and not GEMV_INT_LINEAR:
        return False
    e = chunk_codes(spec.low_bits)
    k = pw.shape[1]
    high_ok = not spec.high_bits or pw.high_layout == "bytes"
    return high_ok and cfg.step % e == 0 and cfg.step // e <= 16 and k % e == 0 and k % 32 == 0


def _moe_streamk(
    x: torch.Tensor | QuantizedRows, pw: PackedWeight, ids: torch.Tensor, n: int, x_div: int,
    y: torch.Tensor, cfg: StreamKConfig, bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """y [S, N] of the S slots of ids (+ their experts' bias rows) through
    `moe_streamk_rows_kernel` (module docstring)."""
    from hetero.kernels.triton_moe_streamk import moe_streamk_rows_kernel

    s_slots, k = ids.numel(), x.shape[-1]
    e = chunk_codes(pw.spec.low_bits)
    step = cfg.step // e
    tiles = -(-n // cfg.bn)
    sch = schedule(
        s_slots * tiles * cfg.bn, k // e, step, cfg.ctas_per_sm * _sm_count(x.device), cfg.bn
    )
    if isinstance(x, QuantizedRows):
        words, floats = x.words, x.floats
    else:
        words, floats = xquant(x, XLayout(pw.spec.low_bits, pw.spec.group))
    part = torch.empty(sch.tiles, sch.max_programs, cfg.bn, dtype=torch.float32, device=x.device)
    cnt = _counters(x.device, sch.tiles)
    args, meta = _plane_args(pw)
    moe_streamk_rows_kernel[(sch.programs,)](
        words, floats, y, part, cnt, ids, *args[:6], n, k // e, sch.ks, sch.units, sch.programs,
        sch.max_programs, tiles, x_div, words.stride(0), floats.stride(0), y.stride(0),
        y if bias is None else bias, 0 if bias is None else bias.stride(0),
        *args[6:], **meta, BN=cfg.bn, S=step, ASM=_asm_ok(x.device), HAS_BIAS=bias is not None,
        FULL=(k // e) % step == 0, num_warps=cfg.warps, **pdl_launch(words),
    )  # fmt: skip
    return y


def _kernels() -> Any:
    from hetero.kernels import triton_moe_kernels  # imports triton: first use only

    return triton_moe_kernels
