"""Single-token decode by a Stream-K GEMV: every SM busy to the end, integer dot products.

`_qgemv_kernel` (triton_qmatmul) splits K so that about 4 programs an SM stream the weight; on
the H200 the grid filled 0.85 of a wave (the idle SMs wait for the last programs) and its decode
spent 5.4 instructions a weight (ptxas, Q4_K): a 127-register program that the DRAM latency left
waiting with 1.2 eligible warps a scheduler. Here:

- Stream-K schedule: the weight is U units of BN rows x `step` codes of K (row tile after row
  tile); P = ctas_per_sm x SMs programs each take a run of U / P consecutive units, so all
  finish together for any N and K (a per-architecture tuning table picks BN, step and P). A row
  tile split between programs is summed by the last one to finish it (counters, fixed order:
  the same bits every launch).
- Integer dot products (`int_dot`, bf16 / fp16 activations): x in block fixed point (`xquant`,
  one small launch, or none where it is fused into the norm or SiLU before: the hooks
  `quantize_norm` and `quantize_input`, which the model calls for the linear after them), then
  dp4a on the code words. ptxas (sm_90) instructions a weight, a unit's steady state:

                    Q4_0  Q4_K  Q5_K  Q6_K  Q8_0
      rows          1.52  1.75  2.41  2.71  1.46   (a row a thread: triton_streamk_rows)
      chunks        2.45  3.28  5.02  5.39  3.28   (the [BN, S, 4] tile of _qgemv_kernel)
      float         5.59  7.55 10.59 10.03  6.70   (_qgemv_kernel's float decode)
      _qgemv_kernel 4.38  5.44  9.78  8.98  6.06

  float32 activations keep the float decode (`int_dot` off), whose rounding they need.
- Programmatic dependent launch (`pdl`, sm_90+): the first weights load while the previous
  kernel drains.
- A lanes config (`lanes` > 0; Q4_K, Q4_0, Q4_1, Q6_K) runs the Gluon kernel of triton_gluon_gemv
  instead: lanes along K, every load of a tile issued before its use, no split-K. On the H200
  it read the 8B's Q4_K weights at 45-69% of the copy rate where the Triton configs read
  26-54% (BENCHMARKS.md, sixteenth session); the table's entry keeps the Triton config as its
  `fallback` where Gluon does not run. HETERO_GEMV_LANES=R/CPL/WK forces one lanes config on
  every weight it reads, =0 none.

The packed weight must hold its high plane in the "bytes" arrangement for `int_dot`
(`prepare_streamk` repacks so; the float decode reads either). T > 1 goes to `qlinear`'s default
paths, which read either arrangement. Registered as qlinear's "triton_streamk", picked over
"triton" on architectures with a measured table (kernels/gemv_tuning_<arch>.json).

The codebook types (IQ4_NL, IQ4_XS, MXFP4: a code indexes a table of values) run the float
decode only: dp4a multiplies the code bytes themselves. `config_ok` refuses them an integer
config, and `choose` never picks one for them, so their bf16 / fp16 tokens go to qlinear's own
decode kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from hetero.kernels import triton_qmatmul as tq
from hetero.kernels.pdl import pdl_supported
from hetero.kernels.registry import register
from hetero.kernels.repack import PackedWeight, chunk_codes, packable, repack
from hetero.kernels.xquant import (
    QuantizedRows,
    XLayout,
    add_rms_norm_xquant,
    silu_mul_xquant,
    xquant,
)


@dataclass(frozen=True)
class StreamKConfig:
    bn: int = 32  # rows a unit
    step: int = 256  # codes of K a unit: a multiple of a chunk; divides 256 for K-quants
    ctas_per_sm: int = 8  # programs an SM: P = ctas_per_sm x SMs
    warps: int = 4
    int_dot: bool = True  # dp4a on xquant'd x (bf16 / fp16 x only); else the float decode
    pdl: bool = False  # programmatic dependent launch (sm_90+)
    rows: bool = False  # a row a thread (triton_streamk_rows; int_dot, bn = 32 x warps)
    maxnreg: int = 0  # a register cap for ptxas (0: none): more programs an SM, or spills
    lanes: int = 0  # CPL > 0: the Gluon kernel (triton_gluon_gemv): bn rows a program, warps
    # along K, CPL chunks of 32 codes a lane a tile (int_dot); ctas_per_sm > 0 there: that many
    # persistent programs an SM, each walking every P-th block of rows (0: a program a block)
    fallback: StreamKConfig | None = None  # a lanes config's Triton one, where Gluon cannot run

    @property
    def name(self) -> str:
        if self.lanes:
            grid = f":c{self.ctas_per_sm}" if self.ctas_per_sm else ""  # persistent programs
            return f"lanes:bn{self.bn}:l{self.lanes}:w{self.warps}{grid}" + (
                ":pdl" if self.pdl else ""
            )
        mode = "rows" if self.rows else "int" if self.int_dot else "f32"
        name = f"sk_{mode}:bn{self.bn}:k{self.step}:c{self.ctas_per_sm}:w{self.warps}"
        return name + (":pdl" if self.pdl else "") + (f":r{self.maxnreg}" if self.maxnreg else "")


@dataclass(frozen=True)
class Schedule:
    tiles: int  # row tiles of BN rows
    ks: int  # units a row tile (along K)
    units: int  # U = tiles x ks
    programs: int  # P
    max_programs: int  # MAXC: the most programs one tile's units span


def schedule(n: int, n_chunks: int, chunks_a_step: int, programs: int, bn: int) -> Schedule:
    """Units and programs of a weight with n rows and n_chunks chunks of K a row."""
    tiles = -(-n // bn)
    ks = -(-n_chunks // chunks_a_step)
    units = tiles * ks
    p = max(1, min(programs, units))
    return Schedule(tiles, ks, units, p, -(-ks * p // units) + 1)


def config_ok(cfg: StreamKConfig, pw: PackedWeight) -> bool:
    """Whether cfg can run pw's type (a step the layout and super-blocks allow, tile sizes
    that Triton takes; integer dot products only on linear codes: a codebook type's values are
    table entries, not the code bytes dp4a multiplies)."""
    e = chunk_codes(pw.spec.low_bits)
    if pw.spec.codebook and cfg.int_dot:
        return False
    if cfg.lanes:
        return lanes_take(pw) and cfg.int_dot and all(
            0 < v <= 16 and v & (v - 1) == 0 for v in (cfg.bn, cfg.lanes, cfg.warps)
        )  # fmt: skip
    if cfg.step % e or (pw.spec.kquant and (cfg.step > 256 or 256 % cfg.step)):
        return False
    if cfg.rows and (not cfg.int_dot or cfg.bn != 32 * cfg.warps or cfg.step // e > 16):
        return False
    return all(v > 0 and v & (v - 1) == 0 for v in (cfg.bn, cfg.step // e, cfg.warps))


def lanes_take(pw: PackedWeight) -> bool:
    """Whether the Gluon lanes kernel reads pw's type: 4-bit linear codes in groups of 32
    without a high plane (Q4_K, Q4_0, Q4_1), or Q6_K with its high plane as "bytes" (the
    integer GEMV's arrangement, which `prepare_streamk` gives)."""
    s = pw.spec
    q4 = s.group == 32 and not s.high_bits
    q6 = s.group == 16 and s.high_bits == 2 and s.kquant and pw.high_layout == "bytes"
    return (
        s.low_bits == 4 and (q4 or q6) and not s.codebook and not s.packed_min
        and pw.shape[1] % 32 == 0
    )  # fmt: skip


def lanes_run(device: torch.device) -> bool:
    """Gluon kernels run compiled on CUDA sm_80+ with Triton 3.6 (triton_moe._gluon_ok)."""
    from hetero.kernels.triton_moe import _gluon_ok

    return _gluon_ok(device)


def _asm_ok(device: torch.device) -> bool:
    """Inline PTX (dp4a, prmt) runs on CUDA only, not under the interpreter."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def qgemv_streamk(
    x: torch.Tensor,
    pw: PackedWeight,
    cfg: StreamKConfig = StreamKConfig(),
    xq: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [1, K] -> y [1, N] = x @ W^T. xq: x already in xquant's layout for pw's type (to share
    one xquant between weights of one input)."""
    if x.shape[0] != 1:
        raise ValueError(f"the Stream-K decode kernel takes one token, got {x.shape[0]}")
    if not config_ok(cfg, pw):
        raise ValueError(f"{cfg.name} cannot run {pw.ggml_type.name}")
    if cfg.lanes and not lanes_run(x.device):
        raise ValueError(f"{cfg.name} is a Gluon kernel: CUDA sm_80+ and Triton 3.6, compiled")
    int_dot = cfg.int_dot
    if int_dot and pw.spec.high_bits and pw.high_layout != "bytes":
        raise ValueError("integer dot products need the high plane in the 'bytes' arrangement")
    n, k = pw.shape
    if int_dot:
        words, floats = (
            xq if xq is not None else xquant(x, XLayout(pw.spec.low_bits, pw.spec.group))
        )
    else:
        words, floats = x if x.stride(-1) == 1 else x.contiguous(), x
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    pdl = cfg.pdl and pdl_supported(x.device)
    if cfg.lanes:
        return _lanes(words, floats, y, pw, cfg, pdl)
    e = chunk_codes(pw.spec.low_bits)
    s = cfg.step // e
    sch = schedule(n, k // e, s, cfg.ctas_per_sm * tq._sm_count(x.device), cfg.bn)
    part = torch.empty(sch.tiles, sch.max_programs, cfg.bn, dtype=torch.float32, device=x.device)
    cnt = tq._counters(x.device, sch.tiles)
    args, meta = tq._plane_args(pw)
    asm = _asm_ok(x.device)
    launch: dict[str, Any] = {"launch_pdl": True} if pdl else {}
    if cfg.maxnreg and asm:
        launch["maxnreg"] = cfg.maxnreg
    if cfg.rows:
        from hetero.kernels.triton_streamk_rows import qgemv_streamk_rows_kernel as kernel

        launch["FULL"] = (k // e) % s == 0  # no step past K: unmasked vector loads
    else:
        from hetero.kernels.triton_streamk_kernels import qgemv_streamk_kernel as kernel

        launch["INT_DOT"] = int_dot
    kernel[(sch.programs,)](
        words, floats, y, part, cnt, *args[:6], n, k // e, sch.ks, sch.units, sch.programs,
        sch.max_programs, *args[6:], **meta, BN=cfg.bn, S=s, ASM=asm, PDL=pdl,
        num_warps=cfg.warps, **launch,
    )  # fmt: skip
    return y


def _lanes(words, floats, y, pw: PackedWeight, cfg: StreamKConfig, pdl: bool) -> torch.Tensor:
    """The Gluon lanes kernel: a program a block of bn rows (or ctas_per_sm an SM, each taking
    every P-th block), cfg.warps warps along K."""
    from hetero.kernels.triton_gluon_gemv import qgemv_lanes_kernel

    n, k = pw.shape
    n_chunks = k // 32
    c = 32 * cfg.lanes * cfg.warps
    args, meta = tq._plane_args(pw)
    codes, high, scale, minv, d, dmin = args[:6]
    code_stride, grp_stride, sb_stride = args[6:9]
    blocks = -(-n // cfg.bn)
    if cfg.ctas_per_sm:  # fewer programs than row blocks, each walking several
        blocks = min(blocks, cfg.ctas_per_sm * tq._sm_count(y.device))
    qgemv_lanes_kernel[(blocks,)](
        words, floats, y, codes, high, scale, minv, d, dmin, n, n_chunks, code_stride,
        grp_stride, sb_stride, HB=meta["HB"], G=meta["G"], OFF=meta["OFF"],
        KQUANT=meta["KQUANT"], HAS_MIN=meta["HAS_MIN"], R=cfg.bn,
        CPL=cfg.lanes, WK=cfg.warps, FULL=n_chunks % c == 0, PDL=pdl, num_warps=cfg.warps,
        BIG=max(t.numel() for t in (codes, scale)) >= 2**31 - 2**20,
        PERSIST=bool(cfg.ctas_per_sm),
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return y


def prepare_streamk(qweight: Any, ggml_type: int, shape: tuple[int, int]) -> Any:
    """Load-time hook: GGUF bytes -> PackedWeight with the "bytes" high plane."""
    if isinstance(qweight, PackedWeight) or not packable(ggml_type):
        return qweight
    return repack(qweight, ggml_type, shape, high_layout="bytes")


def _lanes_default() -> StreamKConfig | bool | None:
    """HETERO_GEMV_LANES=R/CPL/WK[/CTAS]: the Gluon lanes kernel for every weight it reads
    (before the tuning table), with programmatic launches (CTAS: persistent programs an SM);
    =0: never (the table's lanes entries take their Triton fallback); unset: None, the table
    decides."""
    spec = os.environ.get("HETERO_GEMV_LANES", "")
    if spec == "0":
        return False
    if not spec:
        return None
    try:
        return lanes_config(spec)
    except ValueError:
        raise ValueError(f"HETERO_GEMV_LANES={spec!r}: give R/CPL/WK[/CTAS] or 0") from None


def lanes_config(spec: str) -> StreamKConfig:
    """ "R/CPL/WK[/CTAS]" -> that lanes config, with programmatic launches (CTAS: persistent
    programs an SM, else a program a row block)."""
    r, cpl, wk, *ctas = (int(v) for v in spec.split("/"))
    return StreamKConfig(bn=r, lanes=cpl, warps=wk, pdl=True, ctas_per_sm=sum(ctas))


LANES_DEFAULT = _lanes_default()


def choose(pw: PackedWeight, x: torch.Tensor) -> StreamKConfig | None:
    """The tuning table's config for this weight on x's device, or one that pw's type can run
    (None: qlinear's own decode kernel, where it won or where no Stream-K mode of that kind runs
    the type: bf16 / fp16 x of a codebook type). float32 x takes the float decode: the integer
    one rounds x to 16 bits."""
    from hetero.kernels.gemv_tuning import DEFAULT, lookup

    def gluon() -> bool:  # whether the lanes kernel runs this weight and x here
        return x.dtype != torch.float32 and lanes_take(pw) and lanes_run(x.device)

    lanes = LANES_DEFAULT
    if lanes and gluon():
        return lanes
    cfg = lookup(x.device, pw.ggml_type.name, *pw.shape)
    if cfg is not None and cfg.lanes and (lanes is False or not gluon()):
        cfg = cfg.fallback or DEFAULT
    if cfg is None:
        return None
    if x.dtype == torch.float32 and cfg.int_dot:
        cfg = StreamKConfig(bn=32, step=cfg.step, ctas_per_sm=cfg.ctas_per_sm, int_dot=False)
    if not config_ok(cfg, pw):
        cfg = StreamKConfig(int_dot=cfg.int_dot, step=256)
    return cfg if config_ok(cfg, pw) else None


def streamk_supported(device: torch.device | str) -> bool:
    """Triton's devices whose architecture has a measured tuning table (gemv_tuning): there the
    registry prefers this implementation to "triton"; elsewhere it is not picked (tests and
    benchmarks call it by name)."""
    from hetero.kernels.gemv_tuning import has_table

    return tq.triton_supported(device) and has_table(device)


def _int_layout(pw: PackedWeight, cfg: StreamKConfig) -> XLayout | None:
    """The activations' layout of an integer config for pw (None: the float decode)."""
    if not cfg.int_dot or (pw.spec.high_bits and pw.high_layout != "bytes"):
        return None
    return XLayout(pw.spec.low_bits, pw.spec.group)


def input_layout(qweight: Any, like: torch.Tensor) -> XLayout | None:
    """The layout in which this weight reads one token of x (like's dtype and device) by
    integer dot products, pre-quantized by the op that makes x; None where it reads x plain."""
    if like.shape[0] != 1 or not isinstance(qweight, PackedWeight):
        return None
    cfg = choose(qweight, like)
    return None if cfg is None else _int_layout(qweight, cfg)


def quantize_input(
    qweight: Any, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> QuantizedRows | None:
    """A down projection's input act(gate, up) [1, F] as QuantizedRows where this weight reads
    one token by integer dot products (the activation and the quantization in one launch, where
    they were two), else None (the caller makes it as usual)."""
    layout = input_layout(qweight, gate)
    if layout is None:
        return None
    return QuantizedRows(*silu_mul_xquant(gate, up, layout, activation), layout, gate.dtype)


def quantize_norm(
    qweight: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[Any, torch.Tensor] | None:
    """The RMSNorm before a linear as this weight reads one token by integer dot products: (the
    norm of x + residual (x without one) as QuantizedRows, x + residual), the add, the norm and
    the quantization in one launch where they were two; None where the weight reads no such
    form (the caller norms as usual). qweight may be a list (a linear's parts of other GGUF
    types: Q4_K_M's q|k beside a Q6_K v): then a QuantizedRows a part, the parts' layouts (at
    most two) made in the one launch, or None where any part reads no such form."""
    if x.shape[0] != 1 or x.stride(-1) != 1:
        return None
    if residual is not None and residual.stride(-1) != 1:
        return None
    weights = qweight if isinstance(qweight, (list, tuple)) else [qweight]
    layouts = []
    for w in weights:
        layout = input_layout(w, x)
        if layout is None:
            return None
        layouts.append(layout)
    distinct = list(dict.fromkeys(layouts))  # in order: the first part's layout first
    if len(distinct) > 2:
        return None
    *made, total = add_rms_norm_xquant(x, residual, weight, eps, *distinct)
    rows = {lay: QuantizedRows(made[2 * i], made[2 * i + 1], lay, x.dtype)
            for i, lay in enumerate(distinct)}  # fmt: skip
    if isinstance(qweight, (list, tuple)):
        return [rows[lay] for lay in layouts], total
    return rows[layouts[0]], total


@register(
    "qlinear", "triton_streamk", priority=15, supports=streamk_supported, prepare=prepare_streamk,
    quantize_input=quantize_input, quantize_norm=quantize_norm, input_layout=input_layout,
)  # fmt: skip
def qlinear_streamk(
    x: torch.Tensor, qweight: Any, ggml_type: int, shape: tuple[int, int]
) -> torch.Tensor:
    """y = x @ W^T, x [..., K] -> [..., N]: one token by the Stream-K kernel, more by
    qlinear's default paths; x may be QuantizedRows that `quantize_input` made."""
    if isinstance(x, QuantizedRows):
        cfg = choose(qweight, x) if isinstance(qweight, PackedWeight) else None
        if x.shape != (1, shape[1]) or cfg is None or _int_layout(qweight, cfg) != x.layout:
            raise ValueError("quantized rows must be in the layout quantize_input gives")
        return qgemv_streamk(x, qweight, cfg, xq=(x.words, x.floats))
    if not isinstance(qweight, PackedWeight):
        qweight = prepare_streamk(qweight, ggml_type, shape)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] != 1 or not isinstance(qweight, PackedWeight):
        return tq.qlinear_triton(x, qweight, ggml_type, shape)
    tq._check(x2, qweight, ggml_type, shape)
    cfg = choose(qweight, x2)
    fields = qweight.high is not None and qweight.high_layout != "bytes"
    if cfg is None or (cfg.int_dot and fields):  # (a weight another hook prepared)
        return tq.qlinear_triton(x, qweight, ggml_type, shape)
    return qgemv_streamk(x2, qweight, cfg).reshape(*lead, shape[0])
