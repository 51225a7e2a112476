"""Frozen configuration dataclasses, one per layer of the system.

Values found at run time (KV blocks, layer placement) never get written back here: they live in
the Plan. A ModelConfig is read from GGUF metadata once and then only read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

# Architectures of the llama family that one model file (model/llama.py) serves through flags,
# and the mixture-of-experts families (model/qwen3moe.py, model/gpt_oss.py; experts: model/moe.py).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss")
MOE_ARCHITECTURES = ("qwen3moe", "gpt-oss")


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for long context (GGUF `{arch}.rope.scaling.*`).

    kind: "none" | "linear" | "yarn". llama3-style scaling arrives as a `rope_freqs.weight`
    tensor of per-frequency divisors instead, which the model reads from the file.
    """

    kind: str = "none"
    factor: float = 1.0
    original_context_length: int = 0
    # YaRN ramp (llama.cpp defaults: beta_fast 32, beta_slow 1)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # YaRN attention temperature multiplier; 0 means "derive 0.1*ln(factor)+1"
    attn_factor: float = 0.0
    # YaRN correction dims rounded to whole dims (floor/ceil), as llama.cpp rounds them; gpt-oss
    # keeps them fractional (its reference implementation and transformers' "truncate": false)
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Shape and flags of a llama-family model, as its GGUF metadata says."""

    arch: str
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_theta: float
    rope_dim: int
    # "normal": rotate adjacent pairs (x[2i], x[2i+1]), as llama GGUFs store q/k permuted for it;
    # "neox": rotate halves (x[i], x[i + d/2]), as qwen2/qwen3 do.
    rope_style: str
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tied_embeddings: bool = False
    attn_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts ({arch}.expert_count, .expert_used_count,
    # .expert_feed_forward_length): 0 for dense models
    n_experts: int = 0
    n_experts_used: int = 0
    d_ff_expert: int = 0
    # routing weights of the chosen experts renormalized to sum to 1 ({arch}.expert_weights_norm;
    # qwen3moe: always, as llama.cpp builds it)
    expert_weights_norm: bool = False
    # Sliding-window attention ({arch}.attention.sliding_window): the window of the layers that
    # have one, in tokens (a query sees itself and the window - 1 tokens before it), and which
    # layers those are (empty: none)
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def layer_window(self, i: int) -> int:
        """Layer i's attention window in tokens; 0 for full attention."""
        return self.sliding_window if self.swa_layers and self.swa_layers[i] else 0

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class PipelineConfig:
    """devices: "cuda:0,cpu" (the planner splits, or an even split without it);
    split: "cuda:0=0-19,cpu=20-31" (inclusive layer ranges); plan: a saved plan's JSON path.
    micro_batches: batches in flight at once (0: one per stage, so every stage has work).
    stage_timeout: seconds a step (or the start of the stages) may take before the pipeline is
        declared stuck: a dead stage is seen at once, this bounds a hung one.
    max_restarts: how often a failed pipeline is restarted before the engine gives up.
    dist_init: the rendezvous of the stages' process group, tcp://HOST:PORT on this machine
        (None: a free loopback port; give a reachable address when stages run on other hosts).
    remote_stages: "1,2": stage ranks this engine does not start, started on other hosts with
        `hetero stage MODEL --rank R --dist-init tcp://HOST:PORT` and the same split options.
    """

    devices: str | None = None
    split: str | None = None
    plan: str | None = None
    micro_batches: int = 0
    stage_timeout: float = 600.0
    max_restarts: int = 3
    dist_init: str | None = None
    remote_stages: str | None = None

    def __post_init__(self) -> None:
        if self.micro_batches < 0:
            raise ValueError(
                f"micro_batches must be >= 0 (0: one per stage), got {self.micro_batches}"
            )
        if self.stage_timeout <= 0:
            raise ValueError(f"stage_timeout must be > 0 seconds, got {self.stage_timeout}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")

    def remote_ranks(self) -> set[int]:
        text = self.remote_stages or ""
        try:
            ranks = {int(r) for r in text.split(",") if r.strip()}
        except ValueError as e:
            raise ValueError(f"--remote-stages {text!r}: expected stage ranks like 1,2") from e
        if 0 in ranks:
            raise ValueError("--remote-stages: stage 0 runs beside the engine; it cannot be remote")
        return ranks

    @property
    def enabled(self) -> bool:
        return bool(self.devices or self.split or self.plan)


# How a device holds the weights (RuntimeConfig.weights): "auto" picks per device; "dense" and
# "quant" run anywhere; the others are the CPU's packings (kernels/cpu_linear.py).
WEIGHTS_MODES = ("auto", "dense", "quant", "fp16", "int4", "int8", "bf16", "qdot")
GPU_WEIGHTS_MODES = ("quant", "dense")


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the model runs.

    device: "auto" (the first CUDA GPU where there is one, else the CPU), "cpu" or "cuda[:N]".
    weights: one mode for every device, or one per device ("cuda:0=quant,cpu=qdot"; a device it
        does not name takes "auto"). "quant" keeps the GGUF blocks resident and dequantizes them
        inside the matmul: the Triton kernels on a GPU; on a CPU only the torch reference does
        that (per call, the path the kernels are tested against), so it is refused there unless
        `allow_reference`. "dense" dequantizes once at load into `dtype` (exact; 2-4x the
        bytes). "qdot" / "fp16" / "int4" / "int8" / "bf16" are the CPU's packings
        (kernels/cpu_linear.py). "auto": quant on a GPU (the weights take their GGUF bytes
        there; a plan may choose dense where it fits beside the KV and is faster) and qdot on a
        CPU (GGUF blocks times int8 activations in native code, built at first use; fp16 where
        no C compiler builds it).
    n_gpu_layers: with a GPU device, layers 0 .. N-1 run there and the rest on the CPU, in this
        process (llama.cpp's -ngl); None: every layer there, unless the planner splits a model
        too big for the card.
    offload_min_tokens: with layers on the CPU beside a GPU, steps of at least this many tokens
        run those layers' matmuls on the GPU, their weights streamed over PCIe (0: never).
    allow_reference: let a device run a weights mode through the torch reference (tests).
    """

    device: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    weights: str = "auto"
    threads: int = 0  # 0: on a CPU the physical cores, one left to the server from 4 (cpu_threads)
    # Adjacent linears that share an input and a GGUF type run as one matmul (q|k|v, gate|up);
    # off: one matmul per tensor (the unfused form the fused one is tested against)
    fuse_linears: bool = True
    n_gpu_layers: int | None = None
    offload_min_tokens: int = 32
    allow_reference: bool = False
    # Mixture-of-experts models: the experts of every layer (cpu_moe) or of the first n_cpu_moe
    # layers stay in system RAM and multiply on the CPU, the rest on `device` (llama.cpp's
    # --cpu-moe / --n-cpu-moe; model/moe.py)
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    # Bytes this process may take on its GPU (0: all of it): a GPU share's memory cap
    # (cuda:0@100%:8GB) when a plan runs in one process; the KV pool is sized within it
    gpu_memory_cap: int = 0

    def __post_init__(self) -> None:
        check_cpu_moe(self.cpu_moe, self.n_cpu_moe)
        if self.gpu_memory_cap < 0:
            raise ValueError(f"gpu_memory_cap must be >= 0 bytes, got {self.gpu_memory_cap}")
        if self.device != "auto":
            check_device(self.device, "device")
        self._weights_table()  # refuses a malformed per-device form
        if self.n_gpu_layers is not None and self.n_gpu_layers < 0:
            raise ValueError(f"n_gpu_layers must be >= 0, got {self.n_gpu_layers}")
        if self.offload_min_tokens < 0:
            raise ValueError(f"offload_min_tokens must be >= 0, got {self.offload_min_tokens}")

    def _weights_table(self) -> dict[str, str]:
        """ "cuda:0=quant,cpu=qdot" -> {"cuda:0": "quant", "cpu": "qdot"}; one mode -> {"": it}."""
        if "=" not in self.weights:
            entries = {"": self.weights.strip()}
        else:
            entries = {}
            for part in self.weights.split(","):
                dev, eq, mode = part.strip().partition("=")
                if not eq:
                    raise ValueError(f"weights {self.weights!r}: {part!r} is not DEVICE=MODE")
                entries[device_key(check_device(dev.strip(), "weights: device"))] = mode.strip()
        for mode in entries.values():
            if mode not in WEIGHTS_MODES:
                raise ValueError(f"weights mode {mode!r} is not one of {', '.join(WEIGHTS_MODES)}")
        return entries

    def weights_for(self, device: str) -> str:
        """The weights mode asked of `device` (before "auto" is resolved)."""
        table = self._weights_table()
        return table.get("", table.get(device_key(device), "auto"))

    def resolved(self, device: str | None = None) -> RuntimeConfig:
        """This config on `device` (default: its own, "auto" resolved), with one weights mode:
        the one asked of that device."""
        dev = device or self.device
        if dev == "auto":
            import torch

            dev = "cuda" if torch.cuda.is_available() else "cpu"
        return replace(self, device=dev, weights=self.weights_for(dev))

    def weights_mode(self) -> str:
        """The mode this (resolved) device runs: "auto" resolved, a mode it cannot run refused."""
        on_cpu = self.device.startswith("cpu")
        mode = self.weights_for(self.device)
        if mode == "auto":
            if not on_cpu:
                return "quant"
            from hetero.kernels import cpu_qdot  # config is imported first: kernels load later

            return "qdot" if cpu_qdot.available() else "fp16"
        if mode not in GPU_WEIGHTS_MODES and not on_cpu:
            raise ValueError(f"weights mode {mode!r} is for the CPU; use dense or quant")
        if mode == "quant" and on_cpu and not self.allow_reference:
            from hetero.kernels import select

            if select("qlinear", "cpu").is_reference:
                raise ValueError(
                    "weights mode 'quant' on a CPU runs the torch reference, which dequantizes "
                    "every weight on every call (a test path, many times slower): use qdot (the "
                    "CPU's GGUF-block kernels, the default) or fp16"
                )
        return mode

    def torch_dtype(self):
        import torch

        if self.dtype == "auto":
            device = self.resolved().device
            return torch.float32 if device.startswith("cpu") else torch.bfloat16
        table = {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
        }
        if self.dtype not in table:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(table)}")
        return table[self.dtype]


_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_device(device: str, what: str) -> str:
    if not _DEVICE.match(device):
        raise ValueError(f"{what} {device!r} is not cpu, cuda or cuda:N")
    return device


def device_key(device: str) -> str:
    """One name per physical device: "cuda" and "cuda:0" are the same GPU."""
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        return f"cuda:{index or 0}"
    return device


def check_cpu_moe(cpu_moe: bool, n_cpu_moe: int) -> None:
    """--cpu-moe / --n-cpu-moe as given (against a model: model/moe.cpu_expert_layers)."""
    if n_cpu_moe < 0:
        raise ValueError(f"n_cpu_moe must be >= 0, got {n_cpu_moe}")
    if cpu_moe and n_cpu_moe:
        raise ValueError("give --cpu-moe (every layer's experts) or --n-cpu-moe N, not both")


def bind_device(device: str) -> None:
    """Make a CUDA `device` the current one of the calling thread. Triton launches on the current
    device's stream, and a CUDA-graph capture records only what runs on its capture stream: an
    engine on cuda:1 in a thread whose current device is cuda:0 would launch its kernels there
    and capture empty graphs. A no-op for other devices."""
    if device.startswith("cuda"):
        import torch

        d = torch.device(device)
        if d.index is not None and torch.cuda.current_device() != d.index:
            torch.cuda.set_device(d)
