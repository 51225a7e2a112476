"""Parameterized launches of the quantized-matmul kernels: one `Variant` names a kernel and its
whole configuration, so a sweep can time configs that `triton_qmatmul` would not pick.

    kernel      gemv       _qgemv_kernel          (a program: BN rows, one token)
                gemv_pipe  _qgemv_pipe_kernel     (the same, scales prefetched too)
                tokens     _qgemv_tokens_kernel   (a program: BN = 32 rows, TT tokens)
                mm         _qmm_kernel            (a program: BN rows x BT tokens, tensor cores)
                mm_pipe    _qmm_pipe_kernel       (the same, code words prefetched a step)
                mm_t       _qmm_pipe_kernel TRANS (the same, x operand A, the tile operand B)
                gmm        dense_mm_mma_kernel    (Gluon: a program BN rows x BT <= 64 tokens,
                                                  each code decoded once into the mma.sync
                                                  fragments, x through shared memory; step 128;
                                                  stages 2: the next step loaded ahead;
                                                  triton_gluon_dense)
                gmmw       the same on Hopper's warpgroup MMA (sm_90 only: B read from shared
                                                  memory by the tensor cores, no ldmatrix)
    bn, bt      rows / tokens a program (bt: mm kernels only)
    step        codes of K a loop step (a multiple of a chunk; <= 256 for K-quants, whose steps
                must stay inside one super-block)
    split       programs along K per tile; 0: enough for `ctas` programs an SM
    warps, stages
    regs        a cap on registers a thread (ptxas's maxnreg; 0: none)

`run(x, pw, variant)` is y = x @ W^T like `qlinear`; `variant_ok` says whether a variant can run
a type at all (a step a K-quant cannot take, a tile wider than the layout allows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero.kernels import triton_qmatmul as tq
from hetero.kernels.repack import PackedWeight, chunk_codes

GLUON = ("gmm", "gmmw")  # the dense Gluon kernel's variants (triton_gluon_dense)
KERNELS = ("gemv", "gemv_pipe", "tokens", "mm", "mm_pipe", "mm_t", *GLUON)


@dataclass(frozen=True)
class Variant:
    kernel: str
    bn: int = 64
    bt: int = 16
    step: int = 256
    split: int = 0
    ctas: int = 4
    warps: int = 4
    stages: int = 1
    regs: int = 0  # ptxas's register cap a thread (maxnreg; 0: none): more programs an SM

    @property
    def name(self) -> str:
        tiled = self.kernel in ("mm", "mm_pipe", "mm_t", *GLUON)
        tile = f"bn{self.bn}" + (f"bt{self.bt}" if tiled else "")
        split = f"s{self.split}" if self.split else f"c{self.ctas}"
        regs = f":r{self.regs}" if self.regs else ""
        return f"{self.kernel}:{tile}:k{self.step}:{split}:w{self.warps}:st{self.stages}{regs}"


def parse(name: str) -> Variant:
    """A Variant from its name (`Variant.name`: kernel:tile:k<step>:s<split>|c<ctas>:w<warps>:
    st<stages>[:r<regs>]), as a sweep's results name them."""
    kernel, tile, *fields = name.split(":")
    if kernel not in KERNELS or len(fields) < 4:
        raise ValueError(f"not a variant name: {name!r}")
    kw: dict[str, int] = {}
    bn, _, bt = tile.removeprefix("bn").partition("bt")
    kw["bn"] = int(bn)
    if bt:
        kw["bt"] = int(bt)
    keys = {"k": "step", "s": "split", "c": "ctas", "w": "warps", "st": "stages", "r": "regs"}
    for f in fields:
        key = f.rstrip("0123456789")
        if key not in keys or key == f:
            raise ValueError(f"not a variant name: {name!r} ({f!r})")
        kw[keys[key]] = int(f[len(key) :])
    v = Variant(kernel, **kw)
    if v.name != name:
        raise ValueError(f"not a variant name: {name!r} (reads as {v.name!r})")
    return v


def variant_ok(v: Variant, pw: PackedWeight) -> bool:
    e = chunk_codes(pw.spec.low_bits)
    if v.kernel not in KERNELS or v.step % e or v.step < e:
        return False
    if pw.spec.kquant and (v.step > 256 or 256 % v.step):
        return False
    if v.kernel == "tokens" and v.step != 256:  # its config fixes a super-block a step
        return False
    if v.kernel in GLUON:
        from hetero.kernels.triton_gluon_dense import STEP, dense_takes

        m_tiles = v.bn // (16 * v.warps)
        return (
            v.step == STEP and v.stages in (1, 2) and m_tiles > 0
            and v.bn % (16 * v.warps) == 0 and (v.kernel == "gmm" or v.warps % 4 == 0)
            and m_tiles & (m_tiles - 1) == 0
            and dense_takes(pw.spec, pw.high_layout, torch.bfloat16, pw.shape[1], v.bt)
        )  # fmt: skip
    return v.bn >= 16 and v.bn & (v.bn - 1) == 0 and v.bt & (v.bt - 1) == 0


def runs_here(v: Variant, x: torch.Tensor, pw: PackedWeight) -> bool:
    """Whether variant v runs x [T, K] @ W^T on x's device: `variant_ok`, and for the Gluon
    kernel a device and Triton that run Gluon and x in a type it takes."""
    if not variant_ok(v, pw):
        return False
    if v.kernel not in GLUON:
        return True
    from hetero.kernels.triton_gluon_dense import dense_takes
    from hetero.kernels.triton_moe import _gluon_ok

    k = pw.shape[1]
    if not (_gluon_ok(x.device) and dense_takes(pw.spec, pw.high_layout, x.dtype, k, v.bt)):
        return False
    return v.kernel == "gmm" or torch.cuda.get_device_capability(x.device)[0] == 9


def _split(v: Variant, tiles: int, n_steps: int, sm_count: int) -> tuple[int, int]:
    """(split, steps a split): no empty splits."""
    split = v.split or max(1, v.ctas * sm_count // tiles)
    per_split = -(-n_steps // max(1, min(split, n_steps)))
    return -(-n_steps // per_split), per_split


def _launch(kernel, grid, x, y, part, cnt, pw, per_split_chunks, v: Variant, **extra) -> None:
    args, meta = tq._plane_args(pw)
    t_count, n, n_chunks = x.shape[0], pw.shape[0], x.shape[1] // chunk_codes(pw.spec.low_bits)
    if v.regs and x.device.type == "cuda":
        extra["maxnreg"] = v.regs
    kernel[grid](
        x, y, part, cnt, *args[:6], t_count, n, n_chunks, per_split_chunks,
        x.stride(0), y.stride(0), *args[6:], **meta,
        BN=v.bn, num_warps=v.warps, num_stages=v.stages, **extra,
    )  # fmt: skip


def run(x: torch.Tensor, pw: PackedWeight, v: Variant) -> torch.Tensor:
    """x [T, K] (contiguous rows) -> y [T, N] = x @ W^T by variant v."""
    if not variant_ok(v, pw):
        raise ValueError(f"{v.name} cannot run {pw.ggml_type.name}")
    t_count, k = x.shape
    if v.kernel in GLUON:
        from hetero.kernels.triton_gluon_dense import dense_mm

        if x.stride(-1) != 1:
            x = x.contiguous()
        pipe, wg = v.stages == 2, v.kernel == "gmmw"
        return dense_mm(x, pw, v.bn, v.bt, v.warps, pipe, wg, split=v.split, ctas=v.ctas)
    n = pw.shape[0]
    e = chunk_codes(pw.spec.low_bits)
    s = v.step // e  # chunks a step
    n_steps = -(-(k // e) // s)
    sms = tq._sm_count(x.device)
    if v.kernel == "tokens":
        tt = 4 if t_count <= 4 else 8
        tiles, groups = -(-n // v.bn), -(-t_count // tt)
        split, per = _split(v, tiles * groups, n_steps, sms)
        grid, cnt_n, extra = (groups, tiles, split), tiles * groups, {"S": s, "TT": tt}
        from hetero.kernels.triton_qgemv_tokens import _qgemv_tokens_kernel as kernel
    elif v.kernel.startswith("gemv"):
        tiles = -(-n // v.bn)
        split, per = _split(v, tiles * t_count, n_steps, sms)
        grid, cnt_n, extra = (t_count, tiles, split), tiles * t_count, {"S": s}
        kernel = _kernel(v.kernel)
    else:
        tiles = -(-n // v.bn) * -(-t_count // v.bt)
        split, per = _split(v, tiles, n_steps, sms)
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        grid, cnt_n = (tiles, split), tiles
        extra = {"S": s, "BT": v.bt, "PRECISION": precision}
        if v.kernel == "mm_t":
            extra["TRANS"] = True
        kernel = _kernel(v.kernel)
    y = torch.empty(t_count, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, t_count, n, dtype=torch.float32, device=x.device)
    cnt = tq._counters(x.device, cnt_n)
    _launch(kernel, grid, x, y, part, cnt, pw, per * s, v, **extra)
    return y


def _kernel(name: str):
    from hetero.kernels import triton_qkernels as base
    from hetero.kernels import triton_qvariant_kernels as var

    return {
        "gemv": base._qgemv_kernel,
        "gemv_pipe": var._qgemv_pipe_kernel,
        "mm": base._qmm_kernel,
        "mm_pipe": var._qmm_pipe_kernel,
        "mm_t": var._qmm_pipe_kernel,  # TRANS: x operand A, the decoded tile B
    }[name]
