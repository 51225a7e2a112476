"""Prompt steps run a CPU segment's matmuls on the GPU, the weights streamed over PCIe.

Decode reads every weight once per step for a handful of rows: the CPU reads its share from RAM
at RAM speed, nothing to gain by moving bytes. A prompt step multiplies every weight by hundreds
of rows: a few GFLOP per matrix, where the CPU needs milliseconds and the GPU microseconds, and
the bytes cross PCIe faster than the CPU multiplies them. So, as llama.cpp's op offload does,
in a step of at least `min_tokens` tokens each matmul of the CPU segment's layers runs on the
GPU (attention, norms and the KV stay on the CPU):

    W (pinned RAM, the CPU kernels' own bytes) --H2D, copy stream--> staging[i % 2]
        --> GGUF blocks (the packing undone) --> the GPU kernel's layout (prepare_weight)
        --> qlinear(x on the GPU) --> y back to the CPU

A feed-forward runs whole there (gate|up, SiLU-and-mul, down: `feed_forward`), so only its
input and output cross PCIe.

The weights are the CPU kernels' own buffers, pinned once at start: no second copy in RAM. Two
staging buffers alternate, so the copy of the next matmul's weights overlaps this matmul and the
CPU's work between the two (attention between o-proj's input and the qkv before it). Linears
are prefetched in the order the forward meets them (qkv, o, gate|up, down, layer by layer); a
call out of that order is fetched on the spot, so the order is a speed matter, never a
correctness one. Parts the CPU runs in another scheme than qdot (fp16 for the IQ and float
types) stay on the CPU.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from hetero.kernels import cpu_qdot, select
from hetero.kernels.registry import prepare_weight
from hetero.model.layers import QuantLinear


class StreamedMatmuls:
    def __init__(self, linears: list[QuantLinear], device: torch.device, min_tokens: int):
        self.device, self.min_tokens = device, min_tokens
        self.impl = select("qlinear", device)
        self.silu_mul = select("silu_mul", device).fn
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        streamed = [lin for lin in linears if self._streams(lin)]
        # every part of every streamed linear, in the order the forward meets them
        self.order = [(lin, i) for lin in streamed for i in range(len(lin.packed_parts))]
        self.next_of = {self._key(*a): b for a, b in zip(self.order, self.order[1:])}
        self.pinned_bytes = sum(self._pin(lin) for lin in streamed)  # pinned on a GPU's host
        most = max(lin.packed_parts[i].weight.packed.nbytes for lin, i in self.order)
        self.staging = [torch.empty(most, dtype=torch.uint8, device=device) for _ in range(2)]
        # on a GPU the copies run on a stream of their own; elsewhere (the CPU tests of this
        # path) they are plain copies, and the events below are None
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self._staged: dict[int, tuple[int, object]] = {}  # part -> (buffer, ready event)
        self._free = [torch.cuda.Event(), torch.cuda.Event()] if cuda else [None, None]
        self._turn = 0
        self._on = False
        self.calls = 0  # matmuls run here (tests, benchmarks)
        self.feed_forwards = 0  # of them, feed-forwards run whole here

    @classmethod
    def install(
        cls, segments, min_tokens: int, device: torch.device | None
    ) -> StreamedMatmuls | None:
        """Streaming of the CPU segments' matmuls to `device` (a GPU of this process; None, or
        no CPU segment with qdot weights: nothing to stream)."""
        cpus = [s for s in segments if s.device.type == "cpu"]
        if not min_tokens or device is None or not cpus:
            return None
        linears = [m for s in cpus for b in s.model.blocks for m in b.modules()
                   if isinstance(m, QuantLinear)]  # fmt: skip
        if not any(cls._streams(lin) for lin in linears):
            return None
        self = cls(linears, torch.device(device), min_tokens)
        for lin, _ in self.order:
            lin.offload = self
        return self

    @staticmethod
    def _streams(lin: QuantLinear) -> bool:
        parts = getattr(lin, "packed_parts", None)
        return bool(parts) and all(p.scheme == "qdot" for p in parts)

    def _pin(self, lin: QuantLinear) -> int:
        """Move the linear's packed weights into pinned memory, where the CPU kernels then read
        them (their pointers are taken again); the bytes moved."""
        moved = 0
        for p in lin.packed_parts:
            if self.device.type == "cuda":
                p.weight.packed = p.weight.packed.pin_memory()
            moved += p.weight.packed.nbytes
        lin._set_packed(lin.packed_parts)
        return moved

    def describe(self) -> str:
        return (
            f"prompt steps of >= {self.min_tokens} tokens run {len(self.order)} CPU matmuls on "
            f"{self.device}, streaming {self.pinned_bytes / 2**30:.2f} GiB of pinned weights"
        )

    def wants(self, tokens: int) -> bool:
        return tokens >= self.min_tokens

    @contextmanager
    def active(self):
        """Within: the CPU segment's linears run on the GPU (the step is big enough)."""
        self._on = True
        self._stage(*self.order[0])
        try:
            yield
        finally:
            self._on = False
            self._staged.clear()

    def runs(self, x: torch.Tensor) -> bool:
        """Whether a linear runs its matmul here now (QuantLinear.forward asks)."""
        return self._on and x.shape[0] >= self.min_tokens

    def __call__(self, lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] on the CPU -> x @ W^T [T, N] on the CPU, computed on the GPU."""
        return self._on_device(lin, x.to(self.device, self.dtype)).to("cpu", torch.float32)

    def feed_forward(self, gate_up: QuantLinear, down: QuantLinear, h: torch.Tensor):
        """h [T, C] on the CPU -> down(silu(gate) * up) [T, C] on the CPU, all three steps on
        the GPU: the [T, 2F] and [T, F] activations between them never cross PCIe (at T = 512
        on an 8B model, 88 MB a layer each way in float32), and the CPU's one-thread SiLU is
        skipped. None where a linear has a bias or does not stream (the caller goes step by
        step)."""
        if any(lin.bias is not None or lin.offload is not self for lin in (gate_up, down)):
            return None
        self.feed_forwards += 1
        gate, up = gate_up.split(self._on_device(gate_up, h.to(self.device, self.dtype)))
        a = self.silu_mul(gate, up)
        return self._on_device(down, a).to("cpu", torch.float32)

    def _on_device(self, lin: QuantLinear, xg: torch.Tensor) -> torch.Tensor:
        """xg [T, K] on the GPU -> xg @ W^T [T, N] there, W's parts streamed in turn."""
        self.calls += 1
        ys = []
        for i, part in enumerate(lin.packed_parts):
            buf, b = self._take(lin, i)
            nxt = self.next_of.get(self._key(lin, i))
            if nxt is not None:
                self._stage(*nxt)  # into the other buffer, while this part is multiplied
            ys.append(self._matmul(xg, part.weight, buf, b))
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)

    @staticmethod
    def _key(lin: QuantLinear, i: int) -> int:
        return id(lin.packed_parts[i].weight)

    def _stage(self, lin: QuantLinear, i: int) -> None:
        """Start copying part i of lin's weights into the next staging buffer."""
        w = lin.packed_parts[i].weight
        b = self._turn
        self._turn ^= 1
        stream = self.copy_stream
        ready = None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if stream is not None:
                stream.wait_event(self._free[b])  # its last reader is done
            self.staging[b][: w.packed.nbytes].copy_(w.packed.view(-1), non_blocking=True)
            if stream is not None:
                ready = torch.cuda.Event()
                ready.record(stream)
        self._staged[self._key(lin, i)] = (b, ready)

    def _take(self, lin: QuantLinear, i: int) -> tuple[torch.Tensor, int]:
        """Part i's packed bytes on the GPU (staged ahead, or copied now) and their buffer."""
        key = self._key(lin, i)
        if key not in self._staged:
            self._stage(lin, i)
        b, ready = self._staged.pop(key)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        w = lin.packed_parts[i].weight
        return self.staging[b][: w.packed.nbytes].view(w.packed.shape), b

    def _matmul(self, xg: torch.Tensor, w: cpu_qdot.QdotWeight, packed, b: int) -> torch.Tensor:
        blocks = cpu_qdot.gguf_bytes(w, packed)  # [N, K / block, type size], on the GPU
        shape = (w.n, w.k)
        qweight = prepare_weight(self.impl, blocks.reshape(w.n, -1), int(w.ggml_type), shape)
        if self._free[b] is not None:  # the staged bytes are read
            self._free[b].record(torch.cuda.current_stream(self.device))
        return self.impl.fn(xg, qweight, int(w.ggml_type), shape)
