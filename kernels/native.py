"""Native CPU code: the C sources of this package, compiled at first use and loaded with ctypes.

The sources (kernels/*.c, shipped as package data) build into one shared library with the system
C compiler (`cc -O3 -march=native`, OpenMP when the compiler has it) in a per-user cache
(~/.cache/hetero/native), keyed by a hash of the sources, the compiler's version and the flags,
so a changed source, compiler or machine flag set builds anew. `load()` returns None, and logs
one line, when no compiler works: callers keep their torch paths then.
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

SOURCES = tuple(
    Path(__file__).with_name(n) for n in ("cpu_qdot.c", "cpu_small_ops.c", "cpu_attention.c")
)
HEADERS = (Path(__file__).with_name("cpu_simd.h"),)  # included by the sources: in the cache key
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11")
log = logging.getLogger(__name__)

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # C function -> (argument types, result type)
    "qdot_quantize": ([_PTR, _I64, _I64, _PTR, _PTR, _PTR], None),
    "qdot_gemm": ([_INT, _I64, _I64, _I64, *([_PTR] * 7), _INT], None),
    "qdot_linear": ([_INT, _I64, _I64, _I64, *([_PTR] * 5), _INT], _INT),
    "native_rms_norm": ([_PTR, _PTR, _PTR, _I64, _I64, _F32], None),
    "native_add_rms_norm": ([_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32], None),
    "native_silu_mul": ([_PTR, _PTR, _PTR, _I64, _I64, _I64], None),
    "native_rope": ([_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _INT, _PTR], None),
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


def build() -> Path | None:
    """The compiled library (from the cache, or built now), or None without a working compiler."""
    cc = _compiler()
    if cc is None:
        return None
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    text = b"".join(s.read_bytes() for s in SOURCES + HEADERS) + version.encode()
    for flags in (FLAGS + ("-fopenmp",), FLAGS):
        key = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
        out = cache_dir() / f"hetero-native-{key}.so"
        if out.exists() or _compile(cc, flags, out):
            return out
    return None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The native library with its signatures set, or None (one warning says why)."""
    try:
        path = build()
        if path is None:
            log.warning("native CPU kernels unavailable (no working C compiler): torch paths used")
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native CPU kernels unavailable (%s): torch paths used", e)
        return None
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def available() -> bool:
    return load() is not None
