"""Native CPU code: the C sources of this package, compiled at first use and loaded with ctypes.

The sources (kernels/*.c, shipped as package data) build into one shared library per instruction
set with the system C compiler, in a per-user cache (~/.cache/hetero/native) keyed by a hash of
the sources, the compiler's version and the flags:

    variant  flags                                        runs on
    amx      avx512's + AMX-TILE, AMX-INT8                Sapphire Rapids and later Xeons
    avx512   AVX-512 F/BW/VL/DQ + VNNI, AVX2, FMA, F16C   Ice Lake, Sapphire Rapids, Zen 4 and later
    avx2     AVX2, FMA, F16C                              Haswell, Zen 1 and later
    neon     armv8.2-a + dotprod (+ fp16)                 Neoverse, Graviton 2+, Apple M
    generic  the compiler's baseline (x86-64, armv8-a)    anything

Which one runs is asked of the CPU at run time (kernels/cpu_features.c, built in the generic
library), never assumed from the build machine; HETERO_CPU_ISA names one instead (tests force
each variant the CPU can run). `amx` differs from `avx512` only where a K-quant product has 32
or more activation rows (kernels/cpu_qdot_amx.h); `amxemu`, never chosen by itself, builds that
code with the tile operations done in C, so that tests check it on any AVX-512 CPU. Threads
come from the library's own pool (kernels/cpu_pool.c), not OpenMP. `load()` returns None, and
logs one line, when no compiler works: callers keep their torch paths then.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

_NAMES = (
    "cpu_qdot.c", "cpu_qunpack.c", "cpu_qcodebook.c", "cpu_pool.c", "cpu_features.c",
    "cpu_small_ops.c", "cpu_attention.c", "cpu_qdot_moe.c", "cpu_moe_layer.c", "cpu_block.c",
)  # fmt: skip
SOURCES = tuple(Path(__file__).with_name(n) for n in _NAMES)
_HEADER_NAMES = (
    "cpu_simd.h", "cpu_pool.h", "cpu_qtypes.h", "cpu_qdot_simd.h", "cpu_qunpack.h",
    "cpu_qdot_moe.h", "cpu_qdot_amx.h",
)  # fmt: skip
HEADERS = tuple(Path(__file__).with_name(n) for n in _HEADER_NAMES)  # in the cache key
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-pthread", "-Wno-psabi")
_AVX512 = (
    "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma",
    "-mf16c", "-mbmi2",
)  # fmt: skip
VARIANT_FLAGS = {
    "amx": (*_AVX512, "-mamx-tile", "-mamx-int8"),
    "amxemu": (*_AVX512, "-DHETERO_AMX_EMULATE"),
    "avx512": _AVX512,
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-mbmi2"),
    "neon": ("-march=armv8.2-a+dotprod+fp16",),
    "generic": (),
}  # fmt: skip
# native_cpu_features() bits -> the variants they allow, best first
_FEATURE_BITS = {"amx": 2 | 32, "avx512": 2, "avx2": 1, "neon": 16}
ISA_CODES = {"amxemu": 5, "amx": 4, "avx512": 3, "avx2": 2, "neon": 1, "generic": 0}  # qdot_isa()
log = logging.getLogger(__name__)

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # C function -> (argument types, result type)
    "native_cpu_features": ([], _INT),
    "native_pool_selftest": ([_I64, _INT, _PTR], _INT),
    "native_pool_stress": ([_INT, _INT], _INT),
    "qdot_isa": ([], _INT),
    "qdot_quantize": ([_PTR, _I64, _I64, _INT, _PTR, _PTR, _PTR, _INT], None),
    "qdot_gemm": ([_INT, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _INT], _INT),
    "qdot_linear": ([_INT, _PTR, _I64, _I64, _I64, _PTR, _PTR, _INT], _INT),
    "qdot_unpack_unit": ([_INT, _PTR, _PTR], _INT),
    "qdot_moe": (
        [_INT, _INT, _PTR, _PTR, _I64, _I64, _I64, _INT, _PTR, _PTR, _PTR, _I64, _PTR, _INT],
        _INT,
    ),
    "moe_layer_forward": ([_PTR, _PTR, _I64, _INT, _PTR, _PTR, _PTR, _INT, _INT], _INT),
    "moe_layer_hop": ([_PTR], None),
    "dense_block_forward": ([_PTR, _PTR], _INT),
    "native_rms_norm": ([_PTR, _PTR, _PTR, _I64, _I64, _F32, _INT], None),
    "native_add_rms_norm": ([_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT], None),
    "native_silu_mul": ([_PTR, _PTR, _PTR, _I64, _I64, _I64, _INT], None),
    "native_rope": ([_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _INT, _PTR, _INT], None),
    "native_kv_write": ([_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT], _INT),
    "native_paged_attention": (
        [_PTR, *([_I64] * 5), *([_PTR] * 4), _INT, _I64, *([_PTR] * 5), _F32, _PTR, _INT],
        _INT,
    ),
}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "hetero" / "native"


def _arch_variants() -> tuple[str, ...]:
    """The variants this machine's architecture can build."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686", "i386"):
        return ("amx", "avx512", "avx2", "generic")
    if machine in ("aarch64", "arm64"):
        return ("neon", "generic")
    return ("generic",)


def _compile(cc: str, flags: tuple[str, ...], out: Path) -> bool:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name  # built aside, then renamed: concurrent loads never see half
        cmd = [cc, *flags, *map(str, SOURCES), "-o", str(part), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            log.debug("%s failed: %s", " ".join(cmd), r.stderr[-2000:])
            return False
        os.replace(part, out)
    return True


def build(variant: str = "generic") -> Path | None:
    """The library of `variant` (from the cache, or built now), or None where it cannot build."""
    cc = _compiler()
    if cc is None or variant not in VARIANT_FLAGS:
        return None
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    text = b"".join(s.read_bytes() for s in SOURCES + HEADERS) + version.encode()
    flags = FLAGS + VARIANT_FLAGS[variant]
    key = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir() / f"hetero-native-{variant}-{key}.so"
    if out.exists() or _compile(cc, flags, out):
        return out
    return None


@functools.cache
def _library(variant: str) -> ctypes.CDLL | None:
    path = build(variant)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@functools.cache
def supported_variants() -> tuple[str, ...]:
    """The variants this CPU runs, best first (asked of the CPU through the generic build)."""
    arch = _arch_variants()
    try:
        base = _library("generic")
    except (OSError, subprocess.SubprocessError):
        base = None
    if base is None:
        return ()
    features = base.native_cpu_features()
    runs = [v for v in arch if v == "generic" or features & _FEATURE_BITS[v] == _FEATURE_BITS[v]]
    if "amx" in runs and build("amx") is None:  # a compiler without AMX intrinsics (GCC < 11)
        runs.remove("amx")
    return tuple(runs)


def emulations() -> tuple[str, ...]:
    """Builds that run another CPU's code path in C here (tests name them; never chosen)."""
    return ("amxemu",) if "avx512" in supported_variants() else ()


def variant() -> str | None:
    """The variant `load()` gives: HETERO_CPU_ISA where set, else the best this CPU runs."""
    supported = supported_variants()
    forced = os.environ.get("HETERO_CPU_ISA")
    if forced:
        if forced not in supported + emulations():
            raise ValueError(
                f"HETERO_CPU_ISA={forced}: this CPU runs {', '.join(supported) or 'none'}"
            )
        return forced
    return supported[0] if supported else None


@functools.cache
def _load(name: str | None) -> ctypes.CDLL | None:
    try:
        lib = _library(name) if name else None
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native CPU kernels unavailable (%s): torch paths used", e)
        return None
    if lib is None:
        log.warning("native CPU kernels unavailable (no working C compiler): torch paths used")
    return lib


def load(name: str | None = None) -> ctypes.CDLL | None:
    """The native library of variant `name` (default: `variant()`) with its signatures set, or
    None (one warning says why)."""
    return _load(name or variant())


def available() -> bool:
    return load() is not None
