"""A native function on the CPU in a CUDA stream's order, so that a captured CUDA graph holds it
(a host node): the layers of a GPU model whose experts stay in RAM (--cpu-moe, --n-cpu-moe).

    x [T, C] (cuda, any float dtype) -> float32 (cuda) -> copy -> pinned `inp` [T, C]
    fn(args) on the host: the CUDA driver's callback thread calls it (the native pool joins in)
    pinned `out` [T, C] -> copy -> float32 (cuda)

The two copies and the call go to the CUDA driver (cuMemcpyDtoHAsync, cuLaunchHostFunc,
cuMemcpyHtoDAsync) on the current stream. While that stream captures, each becomes a node of
the graph: a decode step that crosses to the CPU once a layer is still one graph launch, with no
Python and no synchronization between its layers (eagerly, a layer's hop costs a wait for the GPU
and the launches that follow it). The function must call no CUDA API (the driver forbids it
there); it reports through its arguments, which the caller reads after the graph has run.

The pinned buffers are shared by every hop of one width on one device (a stream runs its hops one
after another). They are made before capture (`reserve`, called from the eager run that precedes
it: pinning memory is not allowed while a stream captures) and kept as long as the process (a
captured graph holds their addresses). The arguments of the calls captured inside `recording()`
are handed to its owner (the graphs), which keeps them as long as it replays them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator

import torch

_MAX_ROWS = 1024  # the most rows reserved ahead (a graph's largest bucket is at most this)
_buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (device, width) ->
_retired: list[torch.Tensor] = []  # smaller buffers replaced by larger ones: graphs may hold them
_recording: list[list[ctypes.Structure]] = []


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    p, size = ctypes.c_void_p, ctypes.c_size_t
    lib.cuLaunchHostFunc.argtypes = [p, p, p]
    lib.cuMemcpyDtoHAsync_v2.argtypes = [p, ctypes.c_uint64, size, p]
    lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, p, size, p]
    for fn in (lib.cuLaunchHostFunc, lib.cuMemcpyDtoHAsync_v2, lib.cuMemcpyHtoDAsync_v2):
        fn.restype = ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"host hop: {what} failed with CUDA driver error {rc}")


def reserve(device: torch.device, width: int, rows: int) -> None:
    """Pinned room for hops of `rows` rows of `width` float32 on `device`, rounded up to a power
    of two (the buffers grow a few times at most, and each size they had stays: a graph may hold
    it); a no-op where there is room, or past _MAX_ROWS (a graph never has that many)."""
    key = (device.index or 0, width)
    have = _buffers.get(key)
    if rows > _MAX_ROWS or (have is not None and have[0].shape[0] >= rows):
        return
    if have is not None:
        _retired.extend(have)
    rows = 1 << max(0, rows - 1).bit_length()
    _buffers[key] = tuple(  # type: ignore[assignment]
        torch.zeros(rows, width, dtype=torch.float32).pin_memory() for _ in range(2)
    )


def capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def recording() -> Iterator[list[ctypes.Structure]]:
    """The arguments of the host calls made inside (a capture's), for the caller to keep."""
    calls: list[ctypes.Structure] = []
    _recording.append(calls)
    try:
        yield calls
    finally:
        _recording.pop()


def run_on_host(
    x: torch.Tensor, fn: int, make_args: Callable[[int, int, int], ctypes.Structure]
) -> torch.Tensor:
    """fn(args) between the stream's work, args = make_args(inp, out, T) for pinned float32
    inp (x's values) and out [T, C] (what fn writes): out on x's device, float32 [T, C]."""
    if not _recording:
        raise RuntimeError("host hop: a call outside recording() would have no owner")
    t, c = x.shape
    key = (x.device.index or 0, c)
    if key not in _buffers or _buffers[key][0].shape[0] < t:
        raise RuntimeError(f"host hop: no pinned room for {t} rows of {c} (reserve first)")
    inp, out = _buffers[key]
    src = x.float().contiguous()
    dst = torch.empty(t, c, dtype=torch.float32, device=x.device)
    args = make_args(inp.data_ptr(), out.data_ptr(), t)
    stream, lib, n = torch.cuda.current_stream(x.device).cuda_stream, _driver(), t * c * 4
    _check(lib.cuMemcpyDtoHAsync_v2(inp.data_ptr(), src.data_ptr(), n, stream), "copy to host")
    _check(lib.cuLaunchHostFunc(stream, fn, ctypes.addressof(args)), "host function")
    _check(lib.cuMemcpyHtoDAsync_v2(dst.data_ptr(), out.data_ptr(), n, stream), "copy back")
    _recording[-1].append(args)
    return dst


def check(calls: list[ctypes.Structure]) -> None:
    """After the calls have run (their stream synchronized): an error for the first that failed
    (a nonzero rc, its function's result code)."""
    for a in calls:
        if a.rc:  # type: ignore[attr-defined]
            raise RuntimeError(f"a host function of the graph failed (result code {a.rc})")  # type: ignore[attr-defined]
