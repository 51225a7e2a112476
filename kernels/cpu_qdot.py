"""The "qdot" CPU linear: GGUF block weights times int8-quantized activations, in native code.

llama.cpp's CPU path: weights stay in 32-weight blocks (0.56-1.06 bytes per weight instead of
fp16's 2), each 32-block of x is rounded to int8 with a float32 scale, and blocks multiply as
integers (kernels/cpu_qdot.c: AVX2 maddubs/madd, a plain C loop elsewhere). The C source is
compiled at first use with the system compiler into a per-user cache, keyed by a hash of the
source, the compiler and the flags; `load()` returns None (and logs one line) when that fails,
and the CPU linears fall back to fp16.

    kind  GGUF types          qs                    d, m (float32 [N, K/32])   bytes/w
    q4    Q4_0, Q4_1          uint8 [N, K/32, 16]   w = d*q + m (Q4_0: m=-8d)  0.75
    q8    Q8_0                int8 [N, K/32, 32]    w = d*q                    1.125
    q8    others (requant)    int8 [N, K/32, 32]    d = amax/127 per block

Q4_0/Q4_1/Q8_0 keep their codes and scales (fp16 -> fp32, exact): the kernel multiplies by the
exact dequantized weights, and its only rounding is the int8 activations' (x ~ xd * xq per block,
|error| <= xd/2). `qdot_reference` does the same integer arithmetic in torch (float64 sums).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from hetero.quant import QuantType, dequantize
from hetero.quant.bits import f16_field

_T = GGMLQuantizationType
QK = 32
SOURCE = Path(__file__).with_name("cpu_qdot.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")
NATIVE_TYPES = (_T.Q4_0, _T.Q4_1, _T.Q8_0)
log = logging.getLogger(__name__)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "hetero" / "cpu_qdot"


def _compile(cc: str, flags: tuple[str, ...], out: Path) -> bool:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name  # built aside, then renamed: concurrent loads never see half
        cmd = [cc, *flags, str(SOURCE), "-o", str(part), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            log.debug("%s failed: %s", " ".join(cmd), r.stderr[-2000:])
            return False
        os.replace(part, out)
    return True


def _build() -> Path | None:
    """The compiled library (from the cache or built now); OpenMP if the compiler has it."""
    cc = _compiler()
    if cc is None:
        return None
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    for flags in (FLAGS + ("-fopenmp",), FLAGS):
        key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(flags).encode())
        out = _cache_dir() / f"cpu_qdot-{key.hexdigest()[:16]}.so"
        if out.exists() or _compile(cc, flags, out):
            return out
    return None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None when it cannot be built here (one log line says why)."""
    try:
        path = _build()
        if path is None:
            log.warning("qdot CPU kernel unavailable (no working C compiler): using fp16 linears")
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("qdot CPU kernel unavailable (%s): using fp16 linears", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.qdot_quantize.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
    lib.qdot_quantize.restype = None
    lib.qdot_gemm.argtypes = [ctypes.c_int, i64, i64, i64, *([ptr] * 7), ctypes.c_int]
    lib.qdot_gemm.restype = None
    return lib


def available() -> bool:
    return load() is not None


def pack(raw: torch.Tensor, qt: QuantType, n: int, k: int) -> tuple[bool, tuple[torch.Tensor, ...]]:
    """GGUF bytes (or F16/F32 elements) of W [N, K] -> (is_q4, (qs, d, m or None)).

    Q4_0/Q4_1/Q8_0 keep their codes; other types are dequantized exactly and requantized to int8
    per 32-block with a float32 scale (amax / 127), K zero-padded to a multiple of 32.
    """
    nb = -(-k // QK)
    t = qt.ggml_type
    if t in (_T.Q4_0, _T.Q4_1):
        blocks = raw.reshape(n * nb, qt.type_size)
        d = f16_field(blocks, 0)
        start = 2 if t == _T.Q4_0 else 4
        m = -8 * d if t == _T.Q4_0 else f16_field(blocks, 2)
        qs = blocks[:, start : start + 16].reshape(n, nb, 16)
        return True, (qs.contiguous(), d.reshape(n, nb).contiguous(), m.reshape(n, nb).contiguous())
    if t == _T.Q8_0:
        blocks = raw.reshape(n * nb, qt.type_size)
        d = f16_field(blocks, 0).reshape(n, nb)
        qs = blocks[:, 2:].contiguous().view(torch.int8).reshape(n, nb, QK)
        return False, (qs.contiguous(), d.contiguous(), None)
    w = F.pad(dequantize(raw, t, (n, k)), (0, nb * QK - k)).reshape(n, nb, QK)
    d = w.abs().amax(dim=2) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    qs = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return False, (qs.contiguous(), d.contiguous(), None)


def unpack(is_q4: bool, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The float32 W [N, K] the packed blocks represent."""
    n, nb = d.shape
    if is_q4:
        codes = torch.cat((qs & 15, qs >> 4), dim=2).float()  # [N, nb, 32]
        return (codes * d[..., None] + m[..., None]).reshape(n, nb * QK)
    return (qs.float() * d[..., None]).reshape(n, nb * QK)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] float32 -> xq int8 [T, K/32, 32], xd, xs float32 [T, K/32] in native code."""
    lib = load()
    t, k = x.shape
    x = x.contiguous()
    xq = torch.empty(t, k // QK, QK, dtype=torch.int8)
    xd = torch.empty(t, k // QK)
    xs = torch.empty(t, k // QK)
    lib.qdot_quantize(x.data_ptr(), t, k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs


def quantize_x_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch twin of `quantize_x` (same float32 operations, so bit-identical)."""
    t, k = x.shape
    xb = x.float().reshape(t, k // QK, QK)
    d = xb.abs().amax(dim=2) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None])
    return q.to(torch.int8), d, d * q.sum(dim=2)


def qdot_linear(x: torch.Tensor, is_q4: bool, qs, d, m, threads: int = 0) -> torch.Tensor:
    """x [T, K] float32 -> y [T, N] float32 through the native kernel."""
    lib = load()
    n, nb = d.shape
    t = x.shape[0]
    if x.shape[1] != nb * QK:  # requantized weights with K padded to whole blocks
        x = F.pad(x, (0, nb * QK - x.shape[1]))
    xq, xd, xs = quantize_x(x)
    y = torch.empty(t, n)
    if t == 0:
        return y
    mp = m.data_ptr() if m is not None else None
    threads = threads or torch.get_num_threads()
    lib.qdot_gemm(
        int(is_q4), n, nb * QK, t, qs.data_ptr(), d.data_ptr(), mp,
        xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), y.data_ptr(), threads,
    )  # fmt: skip
    return y


def qdot_reference(x: torch.Tensor, is_q4: bool, qs, d, m) -> torch.Tensor:
    """What `qdot_linear` computes, in torch: exact integer block dots, the same scales."""
    n, nb = d.shape
    xq, xd, xs = quantize_x_reference(F.pad(x, (0, nb * QK - x.shape[1])))
    if is_q4:
        codes = torch.cat((qs & 15, qs >> 4), dim=2)
    else:
        codes = qs
    dots = torch.einsum("tbj,nbj->tnb", xq.double(), codes.double())  # exact integers
    y = (dots * (d.double()[None] * xd.double()[:, None])).sum(-1)
    if is_q4:
        y = y + xs.double() @ m.double().t()
    return y.float()
