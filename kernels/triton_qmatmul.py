"""qlinear on CUDA through Triton: y = x @ W^T with W kept as packed GGUF codes.

Default paths by the number of tokens T (x is [T, K], W is [N, K]; `qdispatch` overrides them
per GGUF type, T and shape class where the kernel sweep found a faster one):

    T <= GEMV_MAX_T       qgemv   one launch: decode in registers, float32 FMAs, split-K with an
                                  in-kernel fix-up (memory-bound: time ~ weight bytes / bandwidth)
    T <= GEMV_TOKENS_MAX_T qgemv_tokens  the same, a program decoding each weight once for up to 8
                                  tokens (off for now: see GEMV_TOKENS_MAX_T)
    T <  DENSE_MIN_T      qmm     dequantize tiles straight into the tensor cores (tl.dot), K
                                  split when the tiles are fewer than the SMs
    T >= DENSE_MIN_T      dense   dequantize W (in slabs) to x's dtype, then cuBLAS (at these T
                                  the matmul dwarfs one extra pass over the weight)

qmm and dense use the references' dequantized values bit for bit, rounded to x's dtype exactly as
`qlinear_ref` rounds them; qgemv sums (q + OFF) * x per group in float32 and applies the group's
scale once (the same real numbers, summed in another order: within float tolerance).

Thresholds from benchmarks/gpu_qmatmul.py on an H200 (Q4_K, 4096 -> 14336, bf16; us per call):
T = 2: qgemv 40.0, qmm 42.5; T = 4: 62.8 / 42.4; T = 64: qmm 57.2, dense 84.9; T = 256: qmm 122,
dense 90.5 (lines cross near T = 150). Measured before qgemv factored its scales and qmm split K.

Needs: a CUDA device of compute capability >= 8.0 (bf16 tensor cores, which tl.dot on bf16
requires) and triton. Weights are repacked at load time by the registry's prepare hook
(`repack`); raw GGUF bytes are accepted too and repacked per call (correct, but slow).
GGUF types without a packed layout (F16, BF16, F32, the IQ types with grids) go to the torch
reference.

The split-K fix-up keeps one int32 counter per (token, row tile) per device, zero between launches.
Two launches that overlap on different streams must not share them: the engine runs its forward
on one stream. Call once before capturing a CUDA graph, so the counters exist outside the graph.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from hetero.kernels.reference import qlinear_ref
from hetero.kernels.registry import register
from hetero.kernels.repack import PackedWeight, QSpec, chunk_codes, packable, repack

GEMV_MAX_T = 2
# qgemv_tokens is not a default path (its range T = 3 .. 2 is empty): on the H200
# (benchmarks/gpu_qmicro.py, 2026-11-29, Q4_K 4096 -> 14336, us per call) it lost to qmm on large
# weights (T = 4: 44.1 vs 36.1; T = 8: 65.2 vs 36.4). `qdispatch` picks it for small weights
# (k/v), where the sweep found it faster at T = 3 .. 8. (The illegal access the microbenchmark
# once hit after it was the empty-split over-read since fixed: the sweep then ran it at
# T = 2 .. 16 on every shape and type without one.)
GEMV_TOKENS_MAX_T = 2
DENSE_MIN_T = 160
DENSE_SLAB_ELEMENTS = 1 << 27  # dequantize at most this many weights at a time (256 MB in bf16)
_GEMV_CTAS_PER_SM = 4  # enough warps in flight to cover DRAM latency (see gemv_config)
_GEMV_WARPS = 4
_TOKENS_BLOCK_N = 32


def triton_supported(device: torch.device | str) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _kernels() -> Any:
    from hetero.kernels import triton_qkernels  # imports triton: first use only

    return triton_qkernels


def _plane_args(pw: PackedWeight, rows: slice = slice(None)) -> tuple[list, dict[str, Any]]:
    """Kernel arguments for W[rows]: (6 plane pointers, 3 row strides and the run-time 0 the
    kernels take, constexprs). Absent planes pass `codes` as a placeholder never read."""
    s: QSpec = pw.spec
    high = pw.high
    if high is not None and pw.high_layout == "bytes":  # int32 words: see _load_step
        high = high.view(torch.int32)
    planes = [pw.codes, high, pw.scale, pw.minv, pw.d, pw.dmin]
    ptrs = [pw.codes[rows] if p is None else p[rows] for p in planes]
    strides = [pw.codes.stride(0), pw.scale.stride(0), 0 if pw.d is None else pw.d.stride(0)]
    meta = dict(
        LB=s.low_bits, HB=s.high_bits, G=s.group, OFF=s.offset,
        KQUANT=s.kquant, HAS_MIN=s.has_min, PACKED_MIN=s.packed_min, CB=s.codebook,
    )  # fmt: skip
    return ptrs + strides + [0], meta


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, enough to exercise split-K
    return torch.cuda.get_device_properties(device).multi_processor_count


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # rows a program
    chunk_step: int  # chunks a loop step: 256 codes (one K-quant super-block)
    split_k: int  # programs along K per row tile
    chunks_per_split: int  # a multiple of chunk_step
    num_warps: int


def gemv_block_n(spec: QSpec) -> int:
    """Rows a decode program: 4 rows a thread (its x values and their bf16 -> f32 conversions
    serve 4 rows), 2 where a high-bit plane doubles the registers a row takes. A warp covers
    32 / S rows of S chunks (S = 256 codes / E)."""
    s = 256 // chunk_codes(spec.low_bits)
    rows_per_thread = 2 if spec.high_bits or spec.low_bits == 2 else 4
    return rows_per_thread * (32 // s) * _GEMV_WARPS


def gemv_config(
    spec: QSpec, n: int, n_chunks: int, t: int, sm_count: int,
    split_k: int | None = None, block_n: int | None = None,
) -> GemvConfig:  # fmt: skip
    """Rows a program, and how far to split K so that about _GEMV_CTAS_PER_SM programs per SM
    stream the weight (a 4096-row matrix in 64-row tiles gives only 64 programs otherwise)."""
    block_n = block_n or gemv_block_n(spec)
    chunk_step = 256 // chunk_codes(spec.low_bits)
    steps = -(-n_chunks // chunk_step)
    tiles = -(-n // block_n) * t
    split = split_k or (_GEMV_CTAS_PER_SM * sm_count) // tiles
    per_split = -(-steps // max(1, min(steps, split)))
    split = -(-steps // per_split)  # no empty splits
    return GemvConfig(block_n, chunk_step, split, per_split * chunk_step, _GEMV_WARPS)


def qgemv(
    x: torch.Tensor, pw: PackedWeight, split_k: int | None = None, block_n: int | None = None
) -> torch.Tensor:
    """x [T, K] -> [T, N] by the decode kernel (any T; meant for a few tokens)."""
    t_count, k = x.shape
    n = pw.shape[0]
    e = chunk_codes(pw.spec.low_bits)
    n_chunks = k // e
    cfg = gemv_config(pw.spec, n, n_chunks, t_count, _sm_count(x.device), split_k, block_n)
    tiles = -(-n // cfg.block_n)
    y = torch.empty(t_count, n, dtype=x.dtype, device=x.device)
    part = torch.empty(cfg.split_k, t_count, n, dtype=torch.float32, device=x.device)
    cnt = _counters(x.device, tiles * t_count)
    args, meta = _plane_args(pw)
    _kernels()._qgemv_kernel[(t_count, tiles, cfg.split_k)](
        x, y, part, cnt, *args[:6], t_count, n, n_chunks, cfg.chunks_per_split,
        x.stride(0), y.stride(0), *args[6:], **meta,
        BN=cfg.block_n, S=cfg.chunk_step, num_warps=cfg.num_warps,
    )  # fmt: skip
    return y


def tokens_config(
    spec: QSpec, n: int, n_chunks: int, t: int, sm_count: int, split_k: int | None = None
) -> tuple[GemvConfig, int]:
    """(config, TT) for qgemv_tokens: TT tokens a program (4 or 8) and 32 rows (4 warps: a
    thread holds 2 (row, chunk) pairs of a Q4 type; ptxas for sm_90: 80 registers at TT = 4,
    128 at TT = 8, none spilled), K split as in gemv_config."""
    tt = 4 if t <= 4 else 8
    cfg = gemv_config(spec, n, n_chunks, -(-t // tt), sm_count, split_k, _TOKENS_BLOCK_N)
    return cfg, tt


def qgemv_tokens(x: torch.Tensor, pw: PackedWeight, split_k: int | None = None) -> torch.Tensor:
    """x [T, K] -> [T, N] by the few-token decode kernel (any T; meant for 3 .. 16)."""
    from hetero.kernels.triton_qgemv_tokens import _qgemv_tokens_kernel

    t_count, k = x.shape
    n = pw.shape[0]
    n_chunks = k // chunk_codes(pw.spec.low_bits)
    cfg, tt = tokens_config(pw.spec, n, n_chunks, t_count, _sm_count(x.device), split_k)
    tiles, groups = -(-n // cfg.block_n), -(-t_count // tt)
    y = torch.empty(t_count, n, dtype=x.dtype, device=x.device)
    part = torch.empty(cfg.split_k, t_count, n, dtype=torch.float32, device=x.device)
    cnt = _counters(x.device, tiles * groups)
    args, meta = _plane_args(pw)
    _qgemv_tokens_kernel[(groups, tiles, cfg.split_k)](
        x, y, part, cnt, *args[:6], t_count, n, n_chunks, cfg.chunks_per_split,
        x.stride(0), y.stride(0), *args[6:], **meta,
        BN=cfg.block_n, S=cfg.chunk_step, TT=tt, num_warps=cfg.num_warps,
    )  # fmt: skip
    return y


def mm_config(
    n: int, t: int, chunk: int, block_n: int | None = None
) -> tuple[int, int, int, int, int, int]:
    """(BN, BT, S, num_warps, num_stages, CTAs an SM holds) for the tensor-core path, 128 codes
    of K a step.

    A step's scale loads are plain (unpipelined) global loads, so one program waits a memory
    latency a step unless another program on its SM runs meanwhile. At T <= 64 tiles of 64 rows
    and 4 warps take (ptxas, sm_90, Q4_K) 121 / 167 / 248 registers a thread at BT = 16 / 32 / 64:
    4 / 3 / 2 programs fit an SM (registers and shared memory), where one 128-row program of 8
    warps (248 registers at BT = 64) fills it. K is split to give every SM that many."""
    bt = 16 if t <= 16 else 32 if t <= 32 else 64 if t <= 64 else 128
    bn = block_n or (128 if n > 64 and t > 64 else 64)
    warps = 8 if bn == 128 else 4
    per_sm = 1 if bn == 128 else {16: 4, 32: 3}.get(bt, 2)
    return bn, bt, 128 // chunk, warps, 3, per_sm


def qmm(
    x: torch.Tensor, pw: PackedWeight, block_n: int | None = None, split_k: int | None = None
) -> torch.Tensor:
    """x [T, K] -> [T, N] by the tensor-core kernel (any T). When the tiles are fewer than the
    programs the SMs hold (a 4096-row weight at small T makes 64), K is split to fill them."""
    t_count, k = x.shape
    n = pw.shape[0]
    e = chunk_codes(pw.spec.low_bits)
    bn, bt, steps, warps, stages, per_sm = mm_config(n, t_count, e, block_n)
    tiles = -(-n // bn) * -(-t_count // bt)
    n_steps = -(-(k // e) // steps)
    split = split_k or max(1, per_sm * _sm_count(x.device) // tiles)
    per_split = -(-n_steps // max(1, min(split, n_steps)))
    split = -(-n_steps // per_split)
    y = torch.empty(t_count, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, t_count, n, dtype=torch.float32, device=x.device)
    cnt = _counters(x.device, tiles)
    args, meta = _plane_args(pw)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _kernels()._qmm_kernel[(tiles, split)](
        x, y, part, cnt, *args[:6], t_count, n, k // e, per_split * steps, x.stride(0),
        y.stride(0), *args[6:], **meta,
        BN=bn, BT=bt, S=steps, PRECISION=precision, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def qdequant(
    pw: PackedWeight, dtype: torch.dtype, rows: slice = slice(None), block_n: int = 16
) -> torch.Tensor:
    """W[rows] as a dense [n, K] matrix of `dtype` (float32: the reference's exact values)."""
    n_all, k = pw.shape
    start, stop, step = rows.indices(n_all)
    if step != 1:
        raise ValueError("qdequant takes a contiguous row range")
    n = max(0, stop - start)
    out = torch.empty(n, k, dtype=dtype, device=pw.device)
    if n == 0:
        return out
    e = chunk_codes(pw.spec.low_bits)
    bn, steps = block_n, 256 // e
    args, meta = _plane_args(pw, slice(start, stop))
    grid = (-(-n // bn), -(-(k // e) // steps))
    _kernels()._dequant_kernel[grid](
        out, *args[:6], n, k // e, out.stride(0), *args[6:], **meta, BN=bn, S=steps,
        num_warps=4,
    )  # fmt: skip
    return out


def dense_mm(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """x @ W^T through a dequantized copy of W, a slab of rows at a time, and torch.mm."""
    n, k = pw.shape
    slab = max(1, DENSE_SLAB_ELEMENTS // k)
    if slab >= n:
        return x @ qdequant(pw, x.dtype).t()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, slab):
        stop = min(n, start + slab)
        y[:, start:stop] = x @ qdequant(pw, x.dtype, slice(start, stop)).t()
    return y


def prepare_qlinear(qweight: Any, ggml_type: int, shape: tuple[int, int]) -> Any:
    """Load-time hook: GGUF bytes -> PackedWeight (types without a packed layout pass through)."""
    if isinstance(qweight, PackedWeight) or not packable(ggml_type):
        return qweight
    return repack(qweight, ggml_type, shape)


def _check(x: torch.Tensor, pw: PackedWeight, ggml_type: int, shape: tuple[int, int]) -> None:
    if int(pw.ggml_type) != int(ggml_type) or tuple(pw.shape) != tuple(shape):
        raise ValueError(
            f"packed weight is {pw.ggml_type.name} {pw.shape}, the call says type {ggml_type} "
            f"{tuple(shape)}"
        )
    if x.shape[-1] != shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {shape[1]}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    if x.device != pw.device:
        raise ValueError(f"x is on {x.device}, the weight on {pw.device}")


def _by_threshold(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """The default paths (the module docstring)."""
    t_count = x.shape[0]
    if t_count <= GEMV_MAX_T:
        return qgemv(x, pw)
    if t_count <= GEMV_TOKENS_MAX_T:
        return qgemv_tokens(x, pw)
    if t_count < DENSE_MIN_T:
        return qmm(x, pw)
    return dense_mm(x, pw)


def _by_rule(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor | None:
    """y by the kernel `qdispatch` picks for this type, shape and T (None: no rule matches)."""
    from hetero.kernels import qdispatch, triton_qvariants
    from hetero.kernels.gemv_tuning import arch_of

    arch = arch_of(x.device)
    kernel = qdispatch.choose(pw.ggml_type.name, pw.shape[0], pw.shape[1], x.shape[0], arch)
    if kernel is None:
        return None
    if kernel == "mm":
        return qmm(x, pw)
    if kernel == "dense":
        return dense_mm(x, pw)
    if not triton_qvariants.runs_here(kernel, x, pw):
        return None  # (a Gluon kernel where Gluon does not run, a layout it does not read)
    return triton_qvariants.run(x, pw, kernel)


@register(
    "qlinear", "triton", priority=10, supports=triton_supported, prepare=prepare_qlinear
)  # fmt: skip
def qlinear_triton(
    x: torch.Tensor, qweight: Any, ggml_type: int, shape: tuple[int, int]
) -> torch.Tensor:
    """y = x @ W^T, x [..., K] -> [..., N]; qweight a PackedWeight or the GGUF bytes."""
    if not isinstance(qweight, PackedWeight):
        if not packable(ggml_type):
            return qlinear_ref(x, qweight, ggml_type, shape)
        qweight = repack(qweight, ggml_type, shape)
    _check(x, qweight, ggml_type, shape)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return x2.new_empty(*lead, shape[0])
    y = _by_rule(x2, qweight)
    if y is None:
        y = _by_threshold(x2, qweight)
    return y.reshape(*lead, shape[0])
