"""Prompt steps run a CPU segment's matmuls on the GPU, the weights streamed over PCIe.

Decode reads every weight once per step for a handful of rows: the CPU reads its share from RAM
at RAM speed, nothing to gain by moving bytes. A prompt step multiplies every weight by hundreds
of rows: a few GFLOP per matrix, where the CPU needs milliseconds and the GPU microseconds, and
the bytes cross PCIe faster than the CPU multiplies them. So, as llama.cpp's op offload does,
in a step of at least `min_tokens` tokens each matmul of the CPU segment's layers runs on the
GPU (attention, norms and the KV stay on the CPU):

    W (pinned RAM, the CPU kernels' own bytes) --H2D, copy stream--> a staging ring
        --> W's rows in bf16, a slab at a time (kernels/triton_qdot_dequant: one launch
            reads the staged packing as it is) --> cuBLAS (x on the GPU) --> y back to the CPU

Types that kernel does not decode (Q2_K, Q3_K, the codebook types) go the general way: the
staged bytes turned back into GGUF blocks, repacked into the GPU kernels' layout
(prepare_weight) and multiplied by qlinear, some twenty passes over the weight and three copies
of it in GPU memory (`item_bytes`, `ring_slots` and `work_bytes` price both for the planner).

A feed-forward runs whole there (gate|up, SiLU-and-mul, down: `feed_forward`), so only its
input and output cross PCIe. Activations cross in bf16 through pinned buffers (the CPU's threads
round and widen them), at the link's pinned rate.

The weights are the CPU kernels' own buffers, pinned once at start: no second copy in RAM. They
are copied in items (a slab's rows of a part, or the whole part the general way) into a ring of
staging buffers (RING_BYTES' worth, at least two), each item as soon as a buffer is free, so
the link keeps copying the next matmuls' weights through this one and through the CPU's work
between them (the attention between q|k|v and o). Items are prefetched in the order the forward
meets them (qkv, o, gate|up, down, layer by layer); a call out of that order is fetched on the
spot, so the order is a speed matter, never a correctness one. Parts the CPU runs in another
scheme than qdot (fp16 for the IQ and float types) stay on the CPU.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from hetero.kernels import cpu_qdot, select
from hetero.kernels import triton_qdot_dequant as tqd
from hetero.kernels.registry import prepare_weight
from hetero.kernels.triton_qmatmul import triton_supported
from hetero.model.layers import QuantLinear

# weights a dequantized slab holds at most (64 MB in bf16): a prompt-sized product runs slab by
# slab through cuBLAS, each slab's GEMM still [T, K] x [K, >= 2048 rows] for K <= 16384
SLAB_ELEMENTS = 1 << 25


# bytes of staging buffers a streamed segment keeps on the GPU at least: items (row slabs of a
# part, or whole parts) are copied this far ahead, so the link works through the CPU's attention
# between two products instead of waiting for the product before
RING_BYTES = 160 << 20


def rows_kernel_reads(ggml_type) -> bool:
    """Whether a streamed part of this type is dequantized straight from the staged packing."""
    return tqd.supports(ggml_type)


def slab_rows(n: int, k: int) -> int:
    """Rows of one slab of a [n, k] part: at most SLAB_ELEMENTS weights, whole 16-row groups."""
    return min(n, max(16, SLAB_ELEMENTS // k // 16 * 16))


def item_bytes(ggml_type, nbytes: float, params: int, rows: int) -> float:
    """Packed bytes of one staged item of a part: a slab's, or (the general way) the part's."""
    if not rows_kernel_reads(ggml_type):
        return nbytes
    k = params // max(rows, 1)
    return nbytes * slab_rows(rows, k) / max(rows, 1)


def ring_slots(slot_bytes: float) -> int:
    """Staging buffers of `slot_bytes` in the ring: RING_BYTES' worth, at least two."""
    return max(2, -(-int(RING_BYTES) // max(int(slot_bytes), 1)))


def work_bytes(ggml_type, nbytes: float, params: int, rows: int, tokens: int) -> float:
    """GPU bytes a streamed part needs beside the ring at a step of `tokens` tokens: a bf16 slab
    and the [T, N] output with a slab's [T, rows] product beside it, or (the general way) the
    GGUF blocks and their repack, the part in bf16 and the output."""
    out = 2 * tokens * rows
    if rows_kernel_reads(ggml_type):
        k = params // max(rows, 1)
        slab = slab_rows(rows, k)
        return 2 * slab * k + out + 2 * tokens * slab
    return 2 * nbytes + 2 * params + out


class Staging:
    """A ring of device buffers (two by default) that host tensors are copied into in turn, on
    a copy stream of their own on a GPU (elsewhere, the CPU tests of these paths, plain copies;
    the events None), so the copy of the next weights overlaps the work on the last ones.

    stage(key, tensors) starts the copy into the next buffer not in use; take(key, tensors)
    gives the device views (staged ahead, or copied now) and the buffer, in use until
    release(buffer) hands it back once the work that reads the views is queued. A buffer staged
    over drops what it held."""

    ALIGN = 256

    def __init__(self, nbytes: int, device: torch.device, slots: int = 2):
        self.device = device
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self._free = [torch.cuda.Event() if cuda else None for _ in range(slots)]
        self._staged: dict[object, tuple[int, object, list[torch.Tensor]]] = {}
        self._in_use: set[int] = set()
        self._turn = 0

    @property
    def slots(self) -> int:
        return len(self.buffers)

    @classmethod
    def room(cls, tensors: list[torch.Tensor]) -> int:
        """The bytes one buffer needs to hold these tensors."""
        return sum(-(-t.nbytes // cls.ALIGN) * cls.ALIGN for t in tensors)

    def stage(self, key, tensors: list[torch.Tensor]) -> None:
        if key in self._staged:
            return
        b = self._turn
        while b in self._in_use:  # (at most one is: take, then release)
            b = (b + 1) % self.slots
        self._turn = (b + 1) % self.slots
        self._staged = {k: v for k, v in self._staged.items() if v[0] != b}
        stream, ready, views, at = self.stream, None, [], 0
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if stream is not None:
                stream.wait_event(self._free[b])  # its last reader is done
            for t in tensors:
                dst = self.buffers[b][at : at + t.nbytes]
                dst.copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
                views.append(dst.view(t.dtype).view(t.shape))
                at += self.room([t])
            if stream is not None:
                ready = torch.cuda.Event()
                ready.record(stream)
        self._staged[key] = (b, ready, views)

    def take(self, key, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        if key not in self._staged:
            self.stage(key, tensors)
        b, ready, views = self._staged.pop(key)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        self._in_use.add(b)
        return views, b

    def release(self, b: int) -> None:
        """Buffer b's views are read by the work queued so far on the current stream."""
        self._in_use.discard(b)
        if self._free[b] is not None:
            self._free[b].record(torch.cuda.current_stream(self.device))

    def clear(self) -> None:
        self._staged.clear()


class StreamedMatmuls:
    def __init__(
        self, linears: list[QuantLinear], device: torch.device, min_tokens: int,
        rows_kernel: bool | None = None,
    ):  # fmt: skip
        self.device, self.min_tokens = device, min_tokens
        self.impl = select("qlinear", device)
        self.silu_mul = select("silu_mul", device).fn
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        # the staged packing dequantized by one Triton launch a slab (a GPU with Triton), else
        # the general way; a test turns it on for the interpreter on the CPU
        self.rows_kernel = triton_supported(device) if rows_kernel is None else rows_kernel
        streamed = [lin for lin in linears if self._streams(lin)]
        # every part of every streamed linear, in the order the forward meets them
        self.order = [(lin, i) for lin in streamed for i in range(len(lin.packed_parts))]
        self.pinned_bytes = sum(self._pin(lin) for lin in streamed)  # pinned on a GPU's host
        # what is copied: each part's row slabs (the whole part the general way), in that order
        self._slabs = {self._key(lin, i): self._slab_rows(lin, i) for lin, i in self.order}
        self.items = [(lin, i, j) for lin, i in self.order
                      for j in range(len(self._slabs[self._key(lin, i)]))]  # fmt: skip
        self.position = {self._item_key(*it): n for n, it in enumerate(self.items)}
        most = max(self._item(*it).nbytes for it in self.items)
        self.staging = Staging(most, self.device, ring_slots(most))
        # pinned activation buffers on a GPU's host (to the device, back), made at first use
        self._host: list[torch.Tensor | None] = [None, None]
        self._sent = torch.cuda.Event() if self.device.type == "cuda" else None
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
        slots, size = self.staging.slots, self.staging.buffers[0].nbytes
        return (
            f"prompt steps of >= {self.min_tokens} tokens run {len(self.order)} CPU matmuls on "
            f"{self.device}, streaming {self.pinned_bytes / 2**30:.2f} GiB of pinned weights "
            f"through {slots} staging buffers of {size / 2**20:.0f} MiB"
        )

    def wants(self, tokens: int) -> bool:
        return tokens >= self.min_tokens

    @contextmanager
    def active(self):
        """Within: the CPU segment's linears run on the GPU (the step is big enough)."""
        self._on = True
        for item in self.items[: self.staging.slots - 1]:
            self._stage(*item)
        try:
            yield
        finally:
            self._on = False
            self.staging.clear()

    def runs(self, x: torch.Tensor) -> bool:
        """Whether a linear runs its matmul here now (QuantLinear.forward asks)."""
        return self._on and x.shape[0] >= self.min_tokens

    def __call__(self, lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] on the CPU -> x @ W^T [T, N] on the CPU, computed on the GPU."""
        return self._to_host(self._on_device(lin, self._to_device(x)))

    def feed_forward(self, gate_up: QuantLinear, down: QuantLinear, h: torch.Tensor):
        """h [T, C] on the CPU -> down(silu(gate) * up) [T, C] on the CPU, all three steps on
        the GPU: the [T, 2F] and [T, F] activations between them never cross PCIe (at T = 512
        on an 8B model, 88 MB a layer each way in float32), and the CPU's one-thread SiLU is
        skipped. None where a linear has a bias or does not stream (the caller goes step by
        step)."""
        if any(lin.bias is not None or lin.offload is not self for lin in (gate_up, down)):
            return None
        self.feed_forwards += 1
        gate, up = gate_up.split(self._on_device(gate_up, self._to_device(h)))
        a = self.silu_mul(gate, up)
        del gate, up  # [T, 2F] freed before down's slab is made (work_bytes' peak)
        return self._to_host(self._on_device(down, a))

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 on the CPU -> on the device in its dtype. On a GPU: rounded to bf16
        into a pinned buffer by the CPU's threads, then one asynchronous copy at the link's
        pinned rate (from ordinary memory the driver copies it once more, chunk by chunk)."""
        if self.device.type != "cuda":
            return x.to(self.device, self.dtype)
        self._sent.synchronize()  # the buffer's last copy out is done
        host = self._pinned(0, x.numel()).view(x.shape)
        host.copy_(x)
        xg = host.to(self.device, non_blocking=True)
        self._sent.record(torch.cuda.current_stream(self.device))
        return xg

    def _to_host(self, yg: torch.Tensor) -> torch.Tensor:
        """yg [T, N] on the device -> float32 on the CPU (on a GPU through a pinned buffer: the
        copy waits for the work that makes yg; the widening to float32 is the CPU's)."""
        if self.device.type != "cuda":
            return yg.to("cpu", torch.float32)
        host = self._pinned(1, yg.numel()).view(yg.shape)
        host.copy_(yg, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host.float()

    def _pinned(self, i: int, numel: int) -> torch.Tensor:
        """Pinned host buffer i (0: to the device, 1: back) of at least numel activations,
        grown as prompts grow."""
        buf = self._host[i]
        if buf is None or buf.numel() < numel:
            buf = self._host[i] = torch.empty(numel, dtype=self.dtype, pin_memory=True)
        return buf[:numel]

    def _on_device(self, lin: QuantLinear, xg: torch.Tensor) -> torch.Tensor:
        """xg [T, K] on the GPU -> xg @ W^T [T, N] there, W's parts streamed in turn."""
        self.calls += 1
        ys = [self._part(lin, i, xg) for i in range(len(lin.packed_parts))]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)

    @staticmethod
    def _key(lin: QuantLinear, i: int) -> int:
        return id(lin.packed_parts[i].weight)

    def _item_key(self, lin: QuantLinear, i: int, j: int) -> tuple[int, int]:
        return self._key(lin, i), j

    def _by_rows(self, w: cpu_qdot.QdotWeight) -> bool:
        """Whether w's products run from rows the kernel decodes (else the general way)."""
        return self.rows_kernel and rows_kernel_reads(w.ggml_type)

    def _slab_rows(self, lin: QuantLinear, i: int) -> list[tuple[int, int]]:
        """The row ranges part i of lin is copied and multiplied in."""
        w = lin.packed_parts[i].weight
        if not self._by_rows(w):
            return [(0, w.n)]
        step = slab_rows(w.n, w.k)
        return [(a, min(w.n, a + step)) for a in range(0, w.n, step)]

    def _item(self, lin: QuantLinear, i: int, j: int) -> torch.Tensor:
        """The packed bytes of item j of part i: its slab's 16-row groups (contiguous)."""
        a, b = self._slabs[self._key(lin, i)][j]
        return lin.packed_parts[i].weight.packed[a // cpu_qdot.GROUP : -(-b // cpu_qdot.GROUP)]

    def _stage(self, lin: QuantLinear, i: int, j: int) -> None:
        """Start copying item j of part i of lin into the next staging buffer."""
        self.staging.stage(self._item_key(lin, i, j), [self._item(lin, i, j)])

    def _take(self, lin: QuantLinear, i: int, j: int) -> tuple[torch.Tensor, int]:
        """Item j of part i on the device (copied ahead, or now) and its buffer; the items that
        follow it in the forward's order are staged into the ring's other buffers."""
        key = self._item_key(lin, i, j)
        (buf,), b = self.staging.take(key, [self._item(lin, i, j)])
        at = self.position[key]
        for item in self.items[at + 1 : at + self.staging.slots]:
            self._stage(*item)
        return buf, b

    def _part(self, lin: QuantLinear, i: int, xg: torch.Tensor) -> torch.Tensor:
        """xg @ W_i^T for part i of lin: slab by slab from the staged packing, or the general
        way (GGUF blocks, the GPU kernels' repack, qlinear)."""
        w = lin.packed_parts[i].weight
        slabs = self._slabs[self._key(lin, i)]
        if not self._by_rows(w):
            packed, b = self._take(lin, i, 0)
            blocks = cpu_qdot.gguf_bytes(w, packed)  # [N, K / block, type size], on the GPU
            shape = (w.n, w.k)
            qweight = prepare_weight(self.impl, blocks.reshape(w.n, -1), int(w.ggml_type), shape)
            self.staging.release(b)  # the staged bytes are read
            return self.impl.fn(xg, qweight, int(w.ggml_type), shape)
        y = None if len(slabs) == 1 else xg.new_empty(xg.shape[0], w.n)
        for j, (a, c) in enumerate(slabs):
            packed, b = self._take(lin, i, j)
            rows = tqd.dequant_rows(packed, w.ggml_type, c - a, w.k, 0, c - a, xg.dtype)
            self.staging.release(b)  # the launch that reads it is queued
            if y is None:
                return xg @ rows.t()
            y[:, a:c] = xg @ rows.t()
        return y
