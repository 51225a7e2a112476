"""Frozen configuration dataclasses, one per layer of the system.

Values found at run time (KV blocks, layer placement) never get written back here: they live in
the Plan. A ModelConfig is read from GGUF metadata once and then only read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
class RuntimeConfig:
    """Where and how the model runs.

    weights: "quant" keeps weights in their GGUF blocks and dequantizes them in the layer that uses
    them (the reference path); "dense" dequantizes once at load into `dtype` (exact);
    "qdot" / "fp16" / "int4" / "int8" / "bf16" repack for the CPU's kernels
    (kernels/cpu_linear.py); "auto" is qdot on a CPU (GGUF blocks times int8 activations in native
    code, built at first use: BENCHMARKS.md) or fp16 where no C compiler builds it, and dense on a
    GPU.
    """

    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    weights: str = "auto"
    threads: int = 0  # 0: leave torch's default
    # Adjacent linears that share an input and a GGUF type run as one matmul (q|k|v, gate|up);
    # off: one matmul per tensor (the unfused form the fused one is tested against)
    fuse_linears: bool = True
    # Mixture-of-experts models: the experts of every layer (cpu_moe) or of the first n_cpu_moe
    # layers stay in system RAM and multiply on the CPU, the rest on `device` (llama.cpp's
    # --cpu-moe / --n-cpu-moe; model/moe.py)
    cpu_moe: bool = False
    n_cpu_moe: int = 0

    def __post_init__(self) -> None:
        check_cpu_moe(self.cpu_moe, self.n_cpu_moe)

    def weights_mode(self) -> str:
        modes = ("auto", "dense", "quant", "fp16", "int4", "int8", "bf16", "qdot")
        if self.weights not in modes:
            raise ValueError(f"weights mode {self.weights!r} is not one of {', '.join(modes)}")
        on_cpu = self.device.startswith("cpu")
        if self.weights == "auto":
            if not on_cpu:
                return "dense"
            from hetero.kernels import cpu_qdot

            return "qdot" if cpu_qdot.available() else "fp16"
        if self.weights not in ("dense", "quant") and not on_cpu:
            raise ValueError(f"weights mode {self.weights!r} is for the CPU; use dense or quant")
        return self.weights

    def torch_dtype(self):
        import torch

        if self.dtype == "auto":
            return torch.float32 if self.device.startswith("cpu") else torch.bfloat16
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
