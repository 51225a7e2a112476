"""What the planner knows of one device: its memory, its measured rates, its overheads.

A DeviceProfile comes from a measurement on this machine (planner/profile.py), from a datasheet
(planner/specs.py, configs/devices/*.toml) for dry runs, or from scaling either for a share of a
GPU run through CUDA MPS (planner/shares.py). The plan is a pure function of these numbers.

Units: bytes, seconds, GB/s (1e9 bytes/s), TFLOP/s (1e12 flop/s).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

CPU_KINDS = ("cpu",)


@dataclass(frozen=True)
class MatmulRate:
    """How fast one weights mode (and GGUF type, for the quantized kernels) runs y = x @ W^T.

    decode_gbs: weight bytes streamed per second at T = 1 (decode is memory-bound);
    prefill_tflops: flop/s at a prefill-sized T (compute-bound). A linear of B weight bytes and
    P parameters at T tokens costs max(B / decode, 2 T P / prefill): a roofline whose two ceilings
    were measured with the kernel the registry picks, not taken from a datasheet.
    """

    kernel: str
    decode_gbs: float
    prefill_tflops: float
    # Measured weight GB/s at a few small T (T, GB/s), T ascending: a batched decode step runs
    # another kernel than T = 1 (qmm instead of qgemv on CUDA) at another share of the
    # bandwidth. Empty (datasheet profiles): the roofline above at every T.
    curve: tuple[tuple[int, float], ...] = ()
    prefill_t: int = 0  # the T prefill_tflops was measured at
    # T = 1 on a second, smaller matrix (a CPU's profile): (its bytes, its GB/s, the bytes of the
    # matrix decode_gbs and the curve were measured on). A matrix between the two sizes streams at
    # the GB/s interpolated over log(bytes), beyond them at the nearer one's (on a 16-core host a
    # 4 MB matrix read half the GB/s of a 30 MB one: the pool's hand-out and join, per-row work).
    # Empty: decode_gbs at every size.
    sizes: tuple[float, float, float] | tuple[()] = ()

    def __post_init__(self) -> None:  # JSON gives lists back
        object.__setattr__(self, "curve", tuple((int(t), float(g)) for t, g in self.curve))
        object.__setattr__(self, "sizes", tuple(float(v) for v in self.sizes))

    def seconds(
        self, weight_bytes: float, params: float, tokens: int, run_bytes: float = 0.0
    ) -> float:
        """run_bytes: the matrix the kernel runs, where weight_bytes are a part of it (q of a
        fused q|k|v): its size sets the rate (`sizes`)."""
        slow = self.size_factor(run_bytes or weight_bytes)
        memory = slow * weight_bytes / (self.decode_gbs * 1e9)
        compute = 2.0 * tokens * params / (self.prefill_tflops * 1e12)
        if not self.curve or tokens <= 1:
            return max(memory, compute)
        return self._measured(weight_bytes, params, tokens, compute, slow)

    def size_factor(self, weight_bytes: float) -> float:
        """How much longer than decode_gbs says a matrix of weight_bytes takes (`sizes`)."""
        if not self.sizes:
            return 1.0
        small, small_gbs, large = self.sizes
        if weight_bytes >= large or small_gbs <= 0 or large <= small:
            return 1.0
        at = max(0.0, math.log(max(weight_bytes, 1.0) / small) / math.log(large / small))
        gbs = small_gbs * (self.decode_gbs / small_gbs) ** at  # log-linear in bytes
        return self.decode_gbs / gbs

    def scaled(self, memory: float, compute: float) -> MatmulRate:
        """This rate on a share of the device: GB/s times `memory`, TFLOP/s times `compute`."""
        curve = tuple((t, g * memory) for t, g in self.curve)
        sizes = (self.sizes[0], self.sizes[1] * memory, self.sizes[2]) if self.sizes else ()
        return MatmulRate(
            self.kernel, self.decode_gbs * memory, self.prefill_tflops * compute, curve,
            self.prefill_t, sizes,
        )  # fmt: skip

    def _measured(
        self, weight_bytes: float, params: float, tokens: int, compute: float, slow: float = 1.0
    ) -> float:
        """Linear in T between measured points: (1, decode), the curve, (prefill_t, prefill);
        past the last point compute-bound (time grows with T). slow: size_factor, on the
        memory-bound points."""
        points = [(1, slow * weight_bytes / (self.decode_gbs * 1e9))]
        points += [(t, slow * weight_bytes / (g * 1e9)) for t, g in self.curve if t > 1]
        if self.prefill_t > points[-1][0]:
            points.append(
                (self.prefill_t, 2.0 * self.prefill_t * params / (self.prefill_tflops * 1e12))
            )
        for (t0, s0), (t1, s1) in zip(points, points[1:]):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        return max(points[-1][1], compute)


@dataclass(frozen=True)
class DeviceProfile:
    """One device as the planner sees it.

    id: how plans and flags name it ("cuda:0", "cpu", "cuda:0@70%:32GB", or a spec name such as
        "rtx4090" in a dry run). bus_id: the PCI bus id of a GPU (what tells a 4090 from the
        5090 beside it, whatever order CUDA enumerates them in).
    matmul: rates by key "<weights mode>" or "<weights mode>:<GGUF type>" (e.g. "quant:Q4_K",
        "dense", "fp16"); see `matmul_rate`.
    attn_gbs: KV bytes per second the decode attention reads (its dequantization included).
    step_overhead_s / layer_overhead_s / seq_overhead_s / seq_step_overhead_s: what a decode
        step costs besides the matmuls and attention reads: per step, per layer, per layer and
        sequence (small ops over its rows), and per sequence once a step (the sampler, the
        scheduler's and the step metadata's host work), measured by running the engine's decode
        steps on tiny models (on CUDA replayed from CUDA graphs, as the engine runs them unless
        --enforce-eager).
    eager_step_overhead_s / eager_layer_overhead_s: host time of an eagerly run step (a prefill
        step past the prompt graphs; any step under --enforce-eager), measured from the engine's
        prefill of a tiny model. On a GPU the host enqueues while the device works, so an eager
        step takes the longer of the two; on a CPU they add.
    """

    id: str
    kind: str  # "cuda" | "cpu"
    name: str
    memory_total: int
    memory_free: int
    mem_bw_gbs: float
    bf16_tflops: float  # dense matmul rate at the device's activation dtype
    matmul: dict[str, MatmulRate]
    attn_gbs: float
    # The prompt's attention, TFLOP/s (4 n (c + n / 2) H D a layer over its time; CPU profiles
    # time the paged attention op): 0 prices it at bf16_tflops (GPUs, datasheets)
    attn_tflops: float = 0.0
    h2d_gbs: float = 0.0
    d2h_gbs: float = 0.0
    link_latency_s: float = 0.0
    # A pipeline's hand-off between stage processes beyond the copy: pickled step plans, pipe
    # and gloo wake-ups, the engine's round to the stages and back (calibrate.py; the host's)
    pipeline_hop_s: float = 0.0
    # A CPU layer's prompt step with its matmuls streamed to this GPU, beyond its priced work
    # (the op-by-op path's small ops and launches, the crossings' waits: calibrate.py); 0: none
    offload_layer_overhead_s: float = 0.0
    p2p_gbs: dict[str, float] = field(default_factory=dict)  # other device id -> GB/s
    step_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    seq_step_overhead_s: float = 0.0
    eager_step_overhead_s: float = 0.0
    eager_layer_overhead_s: float = 0.0
    bus_id: str = ""
    compute_capability: str = ""  # "8.9"; "" for a CPU
    fp8_kv: bool = False
    kernels: dict[str, str] = field(default_factory=dict)  # op -> kernel the registry picks
    sm_share: float = 1.0  # share of the GPU's SMs (CUDA MPS); 1.0 for a whole device
    # A measured share's decode kernels' rate over the whole card's (the median over the quantized
    # types at T = 1): the part of the card's bandwidth it draws alone. 0: not measured (a whole
    # device, or a share derived by the sqrt(share) law of shares.py).
    bw_fraction: float = 0.0
    memory_cap: int = 0  # bytes this device may use (MPS share); 0: no cap
    source: str = "measured"  # "measured" | "datasheet" | "derived"

    @property
    def is_cpu(self) -> bool:
        return self.kind in CPU_KINDS

    @property
    def has_eager(self) -> bool:
        """Whether eager steps' host overheads were measured (datasheets have none)."""
        return self.eager_step_overhead_s > 0 or self.eager_layer_overhead_s > 0

    @property
    def usable_memory(self) -> int:
        """Free memory, within the cap of a share."""
        return min(self.memory_free, self.memory_cap) if self.memory_cap else self.memory_free

    @property
    def cc(self) -> tuple[int, int]:
        if not self.compute_capability:
            return (0, 0)
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    def matmul_rate(self, weights: str, ggml_type: str) -> MatmulRate:
        """The measured rate of `weights` mode for a tensor of `ggml_type`.

        Falls back from "quant:<type>" to "quant", then to the device's "dense" rate scaled to
        its copy bandwidth (a roofline, not a measurement) so an unmeasured type still plans.
        """
        for key in (f"{weights}:{ggml_type}", weights):
            if key in self.matmul:
                return self.matmul[key]
        if "dense" in self.matmul:
            return self.matmul["dense"]
        return MatmulRate("roofline", self.mem_bw_gbs / 2, self.bf16_tflops)

    def link_gbs(self, other: DeviceProfile) -> float:
        """Bandwidth of an activation copy from this device to `other`."""
        if other.id in self.p2p_gbs:
            return self.p2p_gbs[other.id]
        if self.is_cpu and not other.is_cpu:
            return other.h2d_gbs or 10.0
        if other.is_cpu and not self.is_cpu:
            return self.d2h_gbs or 10.0
        if self.is_cpu and other.is_cpu:
            return self.mem_bw_gbs
        # two GPUs without a measured peer path go through host memory
        return min(self.d2h_gbs or 10.0, other.h2d_gbs or 10.0) / 2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceProfile:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"device profile has unknown fields: {', '.join(sorted(unknown))}")
        d = dict(d)
        d["matmul"] = {k: MatmulRate(**v) for k, v in d.get("matmul", {}).items()}
        return cls(**d)

    def replace(self, **changes: Any) -> DeviceProfile:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class LiveDevice:
    """A device present now, as enumeration finds it (before any measurement)."""

    id: str  # "cuda:<torch index>" | "cpu"
    kind: str
    name: str
    bus_id: str
    compute_capability: str
    memory_total: int
    memory_free: int

    def profile(self, mem_bw_gbs: float, tflops: float, **measured: Any) -> DeviceProfile:
        """Its profile from measured rates (attention defaults to the copy bandwidth until the
        engine calibration replaces it)."""
        fields: dict[str, Any] = dict(
            id=self.id,
            kind=self.kind,
            name=self.name,
            memory_total=self.memory_total,
            memory_free=self.memory_free,
            mem_bw_gbs=mem_bw_gbs,
            bf16_tflops=tflops,
            attn_gbs=mem_bw_gbs,
            bus_id=self.bus_id,
            compute_capability=self.compute_capability,
        )
        return DeviceProfile(**{**fields, **measured})
