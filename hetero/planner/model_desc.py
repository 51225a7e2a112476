"""A model as the planner needs it: shapes and tensor types, never the weights.

From a GGUF file only the header is read (the tensor data stays unmapped pages on disk); from a
`hetero synth` shape name the same description is computed without writing the file, so a plan
for a Llama-3-8B-sized model needs neither the 5 GB nor the time to write it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.config import ModelConfig
from hetero.gguf_loader import load_gguf
from hetero.kernels.cpu_qdot import cpu_scheme, qdot_blocks
from hetero.synth import tensor_specs
from hetero.synth_shapes import get_shape

# Bytes per weight of the CPU repacks (kernels/cpu_linear.py): int4 keeps a bf16 (scale, zero)
# pair per 32 weights; int8 a bf16 scale per row (ignored: < 0.1%).
_PACKED_BYTES = {"fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.625}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str  # "Q4_K", "F32", ...
    shape: tuple[int, ...]  # numpy order: (rows, cols) = (out, in)
    nbytes: int  # in the file

    @property
    def params(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) == 2

    @property
    def is_expert(self) -> bool:
        """A 3-D tensor of E experts' matrices (ffn_{gate,up,down}_exps, [E, N, K])."""
        return len(self.shape) == 3 and "_exps." in self.name


def weight_bytes(t: TensorInfo, weights: str, on_cpu: bool) -> float:
    """Bytes `t` takes on a device in `weights` mode (vectors stay float32; experts stay in
    their GGUF blocks unless "dense": model/moe.py)."""
    if t.is_expert:
        return (4.0 if on_cpu else 2.0) * t.params if weights == "dense" else float(t.nbytes)
    if not t.is_matrix:
        return 4.0 * t.params
    if weights == "quant":
        return float(t.nbytes)
    if weights == "dense":
        return (4.0 if on_cpu else 2.0) * t.params  # fp32 on a CPU, bf16 on a GPU
    weights = packed_mode(weights, t.ggml_type)
    if weights == "qdot":  # kernels/cpu_qdot.py: the file's blocks, rows padded to groups of 16
        rows = t.shape[0]
        return float(t.nbytes) * (-(-rows // 16) * 16) / rows
    return _PACKED_BYTES[weights] * t.params


def packed_mode(weights: str, ggml_type: str) -> str:
    """The packing a matrix of `ggml_type` gets in `weights` mode: in "qdot" mode the block
    types the kernel reads (Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS, MXFP4) run qdot, float
    and grid IQ types fp16 (kernels/cpu_qdot.cpu_scheme, the rule the loader follows)."""
    if weights != "qdot":
        return weights

    return cpu_scheme(ggml_type)


def rate_key(weights: str, ggml_type: str) -> tuple[str, str]:
    """(packing, GGUF type) whose measured rate a matrix of `ggml_type` runs at in `weights`
    mode (DeviceProfile.matmul_rate's arguments, which fall back from "qdot:<type>" to the
    profile's "qdot" rate for a type it did not time)."""
    mode = packed_mode(weights, ggml_type)
    if mode != "qdot":
        return mode, ggml_type

    return mode, qdot_blocks(ggml_type)


@dataclass(frozen=True)
class ModelDesc:
    name: str
    config: ModelConfig
    layers: tuple[tuple[TensorInfo, ...], ...]  # the tensors of each block
    embed: TensorInfo
    output: TensorInfo | None  # None: tied to the embedding
    globals_: tuple[TensorInfo, ...] = ()  # output norm, rope factors
    source: str = ""  # the GGUF path, or "synth:SHAPE:QUANT"

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def file_bytes(self) -> int:
        tensors = [t for layer in self.layers for t in layer] + [self.embed, *self.globals_]
        return sum(t.nbytes for t in tensors) + (self.output.nbytes if self.output else 0)

    @property
    def head(self) -> TensorInfo:
        """The output projection (the embedding's table when tied)."""
        return self.output or self.embed

    def expert_bytes(self, layers: range | None = None) -> int:
        """File bytes of the expert tensors of `layers` (all by default): what a mixture-of-
        experts model can keep in system RAM while the rest runs on a GPU."""
        chosen = self.layers if layers is None else self.layers[layers.start : layers.stop]
        return sum(t.nbytes for layer in chosen for t in layer if t.is_expert)


def from_gguf(path: str) -> ModelDesc:
    """Describe the GGUF file at `path` from its header."""

    gm = load_gguf(path)
    infos = {
        name: TensorInfo(name, t.ggml_type.name, t.shape, t.nbytes)
        for name, t in gm.tensors.items()
    }
    return _assemble(gm.config.name or gm.path.name, gm.config, infos, str(gm.path))


def from_shape(shape: str, quant: str = "q4_k_m") -> ModelDesc:
    """Describe the model `hetero synth --shape SHAPE --quant QUANT` would write."""

    s = get_shape(shape)
    infos = {
        spec.name: TensorInfo(spec.name, spec.qtype.name, spec.shape, spec.nbytes)
        for spec in tensor_specs(s, quant)
    }
    cfg = ModelConfig(
        arch=s.arch,
        name=f"synthetic {shape} {quant}",
        n_layers=s.n_layers,
        d_model=s.d_model,
        n_heads=s.n_heads,
        n_kv_heads=s.n_kv_heads,
        head_dim=s.head_dim,
        d_ff=s.d_ff,
        vocab_size=s.vocab_size,
        context_length=s.context_length,
        norm_eps=s.norm_eps,
        rope_theta=s.rope_theta,
        rope_dim=s.head_dim,
        rope_style="normal" if s.arch == "llama" else "neox",
        tied_embeddings=s.tied_embeddings,
        attn_bias=s.attn_bias,
        qk_norm=s.qk_norm,
        n_experts=s.n_experts,
        n_experts_used=s.n_experts_used,
        d_ff_expert=s.d_ff_expert,
        sliding_window=s.sliding_window,
        swa_layers=tuple(s.sliding_window > 0 and i % 2 == 0 for i in range(s.n_layers)),
    )
    return _assemble(cfg.name, cfg, infos, f"synth:{shape}:{quant}")


def describe(model: str) -> ModelDesc:
    """A GGUF path, or "synth:SHAPE[:QUANT]" for a model `hetero synth` would write."""
    if model.startswith("synth:"):
        parts = model.split(":")
        if len(parts) not in (2, 3) or not parts[1]:
            raise ValueError(f"model {model!r}: write synth:SHAPE or synth:SHAPE:QUANT")
        return from_shape(parts[1], parts[2] if len(parts) == 3 else "q4_k_m")
    return from_gguf(model)


def _assemble(name: str, cfg: ModelConfig, infos: dict[str, TensorInfo], source: str) -> ModelDesc:
    layers = tuple(
        tuple(t for key, t in infos.items() if key.startswith(f"blk.{i}."))
        for i in range(cfg.n_layers)
    )
    in_layers = {t.name for layer in layers for t in layer}
    special = {"token_embd.weight", "output.weight"}
    rest = tuple(t for key, t in infos.items() if key not in in_layers and key not in special)
    if "token_embd.weight" not in infos:
        raise ValueError(f"{name}: tensor 'token_embd.weight' is missing")
    head = infos.get("output.weight")
    return ModelDesc(name, cfg, layers, infos["token_embd.weight"], head, rest, source)
