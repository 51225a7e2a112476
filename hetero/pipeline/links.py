"""Point-to-point links between stages over torch.distributed.

Every stage is one rank of one process group (gloo: it carries CPU tensors, between machines
too). A message from stage i to stage i+1 is

    first   uint8 [32 + 16384]: header int64 [4] (payload bytes, T, C, activation dtype code),
            then the payload's first 16 KiB: the pickled StepPlan, forwarded as the bytes
            stage 0 got (a step's plan nearly always fits: one gloo message a hop, as each
            costs a wake-up of the receiver's transport thread, tens of us on an idle host)
    rest    uint8 [n - 16384]: the rest of a longer payload (JSON-mode masks), when there is one
    hidden  [T, C]:    activations, over NCCL between two GPUs, else over gloo (through the CPU)

A last stage on another host sends its results back to stage 0 over a second gloo group, so
stage 0's result thread never shares a group with its forward sends (a last stage beside the
engine writes them to the engine's pipe instead). Sends are asynchronous (isend): a stage
starts its next micro-batch while the previous one's activations are still on the wire, and
waits for them only before its next send.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from hetero.config import device_key
from hetero.pipeline.stages import StageSpec

_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_HEAD = 32  # header: int64 [4]
_INLINE = 16384  # payload bytes carried in a message's first part
# Idle stages wait for work without limit; liveness is the engine's job (process sentinels and
# its step timeout), so the group's own timeout only has to outlast any quiet period.
_GROUP_TIMEOUT = timedelta(days=7)


class Links:
    def __init__(self, rank: int, stages: tuple[StageSpec, ...], init_method: str):
        self.rank, self.world = rank, len(stages)
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=self.world,
            timeout=_GROUP_TIMEOUT,
        )
        # Every rank creates every group, in the same order (torch.distributed requires it).
        self.results = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)
        self.nccl: dict[int, dist.ProcessGroup] = {}  # first rank of a GPU pair -> its group
        for i in range(self.world - 1):
            if _nccl_pair(stages[i].device, stages[i + 1].device):
                group = dist.new_group([i, i + 1], backend="nccl", timeout=_GROUP_TIMEOUT)
                if rank in (i, i + 1):
                    self.nccl[i] = group
        self._pending: list = []  # (works, buffers) of the last send, kept alive until done

    def gather_all(self, value) -> list:
        """Every stage's (picklable) value, gathered on every stage."""
        out: list = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def send_next(self, payload: bytes, hidden: torch.Tensor | None) -> None:
        self._send(self.rank + 1, payload, hidden, self.nccl.get(self.rank))

    def recv_prev(self, device: torch.device, dtype: torch.dtype):
        """(payload, hidden [T, C] on `device` in `dtype`: a GPU's bf16 becomes a CPU's fp32)."""
        payload, hidden = _recv(self.rank - 1, device, None, self.nccl.get(self.rank - 1))
        return payload, None if hidden is None else hidden.to(dtype)

    def send_result(self, payload: bytes) -> None:
        self._send(0, payload, None, None, self.results)

    def recv_result(self) -> bytes:
        return _recv(self.world - 1, torch.device("cpu"), self.results, None)[0]

    def _send(self, dst, payload, hidden, nccl, group=None) -> None:
        for w in self._pending:
            w.wait()
        t, c = (0, 0) if hidden is None else hidden.shape
        code = 0 if hidden is None else _DTYPES.index(hidden.dtype)
        first, rest = _pack(payload, [len(payload), t, c, code])
        works, keep = [dist.isend(first, dst, group)], [first]
        if rest is not None:
            works.append(dist.isend(rest, dst, group))
            keep.append(rest)
        if hidden is not None:
            h = hidden.contiguous() if nccl is not None else hidden.to("cpu").contiguous()
            works.append(dist.isend(h, dst, nccl or group))
            keep.append(h)
        self._pending, self._keep = works, keep

    def flush(self) -> None:
        """Wait until the last send is delivered (before the process exits)."""
        for w in self._pending:
            w.wait()


def _nccl_pair(a: str, b: str) -> bool:
    """Two different GPUs: NCCL. One GPU shared by two stages cannot be: NCCL refuses two ranks
    on one device, so those activations go through host memory over gloo like a CPU's."""
    both = a.startswith("cuda") and b.startswith("cuda")
    return both and device_key(a) != device_key(b)


def _pack(payload: bytes, header: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first message (header, then the payload's first _INLINE bytes) and the rest."""
    first = torch.zeros(_HEAD + _INLINE, dtype=torch.uint8)
    first[:_HEAD].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64))
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    k = min(len(payload), _INLINE)
    first[_HEAD : _HEAD + k] = data[:k]
    return first, (data[_INLINE:] if len(payload) > _INLINE else None)


def _recv(src, device, group, nccl) -> tuple[bytes, torch.Tensor | None]:
    first = torch.empty(_HEAD + _INLINE, dtype=torch.uint8)
    dist.recv(first, src, group)
    n, t, c, code = first[:_HEAD].view(torch.int64).tolist()
    payload = first[_HEAD : _HEAD + min(n, _INLINE)].numpy().tobytes()
    if n > _INLINE:
        rest = torch.empty(n - _INLINE, dtype=torch.uint8)
        dist.recv(rest, src, group)
        payload += rest.numpy().tobytes()
    hidden = None
    if c:
        where = device if nccl is not None else torch.device("cpu")
        hidden = torch.empty(t, c, dtype=_DTYPES[code], device=where)
        dist.recv(hidden, src, nccl or group)
        hidden = hidden.to(device)
    return payload, hidden
