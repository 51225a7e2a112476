"""KV pools: one paged pool per device, sized from the memory left after the weights.

Each layer holds k and v as [num_blocks * block_size, KV, D] (plus per-token-head float32 scales
in fp8), so a token's slot is block * block_size + offset: the block manager hands out blocks,
the runner turns block tables into slot indices, the kernels read and write slots.

With sliding-window layers the layers of each KV cache group share the pool's layer slots
(engine/kv_groups.py: a block holds one group's KV), and one zeroed block follows the usable
ones: the null block that a window group's table holds where its blocks fell out of the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from hetero.config import ModelConfig
from hetero.engine.config import kv_dtype_rule
from hetero.engine.kv_groups import KVGroups, blocks_needed
from hetero.kernels import select

# fp32 is for exact comparisons with the contiguous fp32 reference, not for serving.
STORAGE = {
    "fp8": torch.float8_e4m3fn,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}


def fp8_hardware(device: str) -> bool:
    """Whether `device` converts e4m3 in hardware (CUDA compute capability 8.9+: Ada, Hopper,
    Blackwell). The Triton KV kernels need it for fp8 pools."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)


def resolve_kv_dtype(kv_dtype: str, device: str) -> str:
    """The KV dtype a pool on `device` stores for the asked `kv_dtype` (engine/config.py's one
    rule, with the device's fp8 hardware looked up)."""
    return kv_dtype_rule(kv_dtype, torch.device(device).type == "cpu", fp8_hardware(device))


def block_bytes(cfg: ModelConfig, n_layers: int, block_size: int, kv_dtype: str) -> int:
    """Bytes one block costs across `n_layers` layers: k and v, plus fp8 scales."""
    if kv_dtype not in STORAGE:
        raise ValueError(f"kv dtype {kv_dtype!r} is not one of {', '.join(STORAGE)}")
    per_token_head = cfg.head_dim * STORAGE[kv_dtype].itemsize
    if kv_dtype == "fp8":
        per_token_head += 4  # float32 scale
    return 2 * n_layers * block_size * cfg.n_kv_heads * per_token_head


# GPU memory caps this process set (cap_gpu_memory): device index -> bytes
_CAPS: dict[int, int] = {}


def _gpu_index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


def cap_gpu_memory(device: str, cap: int) -> None:
    """Let this process take at most `cap` bytes of the GPU (its caching allocator refuses
    more), and size what it sizes by free memory within the cap: a GPU share's memory cap
    (cuda:0@100%:8GB) run in one process, as an MPS memory limit caps a stage process."""
    index = _gpu_index(torch.device(device))
    total = torch.cuda.get_device_properties(index).total_memory
    if cap > total:
        raise ValueError(
            f"a memory cap of {cap / 1e9:.1f} GB is more than {device}'s {total / 1e9:.1f} GB"
        )
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    _CAPS[index] = cap


def free_memory(device: str) -> int:
    """Bytes free on the device now (after the weights were loaded); on a GPU this process
    capped, what the cap leaves beside what the process holds."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        index = _gpu_index(dev)
        if index in _CAPS:
            free = min(free, _CAPS[index] - torch.cuda.memory_reserved(index))
        return int(max(free, 0))
    return int(psutil.virtual_memory().available)


# A CPU pool holds this many full contexts (or max_num_seqs, if fewer), not a share of free RAM:
# RAM is the weights' and the OS's too, and a CPU serves few long sequences at once.
CPU_POOL_CONTEXTS = 4


def cpu_pool_need(
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    windows: tuple[int, ...] = (0,),
    step_tokens: int = 0,
) -> tuple[int, str]:
    """(blocks, why) a CPU pool is sized to: CPU_POOL_CONTEXTS contexts of max_model_len, each
    needing every KV cache group's blocks (a window group's while steps compute step_tokens)."""
    seqs = max(1, min(max_num_seqs, CPU_POOL_CONTEXTS))
    per_seq = blocks_needed(windows, max_model_len, step_tokens or max_model_len, block_size)
    return per_seq * seqs, f"sized for {seqs} sequence(s) of {max_model_len} tokens"


@dataclass(frozen=True)
class PoolLayout:
    """How a pool holds the KV of a range of layers (engine/kv_groups.py): each layer's slot
    and KV cache group, the slots a block has, the model's group count, and whether a zeroed
    null block follows the usable ones (a model with window groups)."""

    slots: tuple[int, ...]
    groups: tuple[int, ...]
    n_slots: int
    n_groups: int
    null_block: bool

    @classmethod
    def of(cls, cfg: ModelConfig, layers: range) -> PoolLayout:
        kg = KVGroups.of(cfg)
        slots, n = kg.slots(layers)
        groups = tuple(kg.layer_group[i] for i in layers)
        return cls(tuple(slots), groups, n, len(kg.windows), kg.windowed)


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int
    block_bytes: int
    free_bytes: int
    fraction: float
    capped: bool = False  # num_blocks set by the user's upper bound, not by memory
    sized_for: str = ""  # num_blocks set by what the pool must hold (a CPU's), not by memory

    def describe(self, kv_dtype: str) -> str:
        total = self.num_blocks * self.block_bytes / 2**20
        why = (
            "capped by num_kv_blocks"
            if self.capped
            else self.sized_for or f"{self.fraction:.0%} of {self.free_bytes / 2**20:.0f} MiB free"
        )
        return (
            f"KV cache: {self.num_blocks} blocks of {self.block_bytes / 1024:.1f} KiB "
            f"({kv_dtype}), {total:.0f} MiB ({why})"
        )


def size_pool(
    cfg: ModelConfig,
    n_layers: int,
    block_size: int,
    kv_dtype: str,
    device: str,
    fraction: float,
    max_blocks: int | None = None,
    need: tuple[int, str] | None = None,
    null_block: bool = False,
) -> PoolSize:
    """Blocks that fit in `fraction` of the free memory (capped at max_blocks when given); on a
    CPU at most `need` = (blocks, why) from cpu_pool_need, what the pool must hold. n_layers:
    the layer slots a block has (PoolLayout.n_slots); null_block: one more block is made."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv memory fraction must be in (0, 1], got {fraction}")
    per_block = block_bytes(cfg, n_layers, block_size, kv_dtype)
    free = free_memory(device)
    n = int(free * fraction) // per_block - null_block
    capped = max_blocks is not None and max_blocks < n
    sized_for = ""
    if capped:
        n = max_blocks
    elif need is not None and torch.device(device).type == "cpu" and need[0] < n:
        n, sized_for = need
    if n < 1:
        raise ValueError(
            f"no room for a KV block on {device}: {free / 2**20:.0f} MiB free, one block of "
            f"{block_size} tokens needs {per_block / 2**20:.2f} MiB"
        )
    return PoolSize(n, per_block, free, fraction, capped, sized_for)


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        layers: range | int,
        num_blocks: int,
        block_size: int,
        kv_dtype: str = "fp8",
        device: str = "cpu",
    ):
        """The KV of `layers` (an int n: layers 0 .. n - 1) in num_blocks usable blocks."""
        self.dtype = STORAGE[kv_dtype]
        self.kv_dtype, self.block_size, self.num_blocks = kv_dtype, block_size, num_blocks
        layers = range(layers) if isinstance(layers, int) else layers
        self.layout = layout = PoolLayout.of(cfg, layers)
        slots = (num_blocks + layout.null_block) * block_size
        shape = (layout.n_slots, slots, cfg.n_kv_heads, cfg.head_dim)
        # empty, not zeros: pages are touched only when used (a CPU pool may be many GiB)
        self.k = torch.empty(shape, dtype=self.dtype, device=device)
        self.v = torch.empty(shape, dtype=self.dtype, device=device)
        self.k_scale = self.v_scale = None
        if kv_dtype == "fp8":
            self.k_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)
        if layout.null_block:  # read (and masked out) at a window's edge: finite, never NaN
            for t in (self.k, self.v, self.k_scale, self.v_scale):
                if t is not None:
                    t[:, num_blocks * block_size :].zero_()
        self._write = select("kv_write", torch.device(device)).fn
        # per-layer views made once: a decode step asks for each layer's twice (write, attend),
        # and 4 tensor selects per ask are a measurable share of a small model's step on a CPU
        self._layers = [self._layer_views(s) for s in layout.slots]

    def _layer_views(self, s: int):
        ks = None if self.k_scale is None else self.k_scale[s]
        vs = None if self.v_scale is None else self.v_scale[s]
        return self.k[s], self.v[s], ks, vs

    def layer(self, i: int):
        """k, v [slots, KV, D] of the range's layer i, and their fp8 scales [slots, KV] (else
        None)."""
        return self._layers[i]

    def write(self, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._write(*self.layer(i), slots, k, v)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: read every source first, then write every destination."""
        if not pairs:
            return
        bs = self.block_size
        offs = torch.arange(bs)
        src = torch.cat([s * bs + offs for s, _ in pairs]).to(self.k.device)
        dst = torch.cat([d * bs + offs for _, d in pairs]).to(self.k.device)
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t[:, dst] = t[:, src].clone()
