"""Building blocks of the llama family: QuantLinear, embeddings, RMSNorm, rotary embedding.

Each layer calls its op through the kernel registry, so a faster kernel registered for the device
replaces the torch reference without the model file changing.
"""

from __future__ import annotations

import functools
import math

import torch
from gguf import GGMLQuantizationType
from torch import nn

from hetero.config import ModelConfig, RopeScaling, RuntimeConfig
from hetero.gguf_loader import GGUFTensor
from hetero.kernels import cpu_qdot, select
from hetero.kernels.cpu_linear import PackedLinear, choose_scheme, pack_linear, packed_linear
from hetero.kernels.registry import prepare_weight
from hetero.quant import dequantize


def _dense(t: GGUFTensor, rt: RuntimeConfig, dtype: torch.dtype | None = None) -> torch.Tensor:
    w = dequantize(t.torch(), t.ggml_type, t.shape)
    return w.to(device=rt.device, dtype=dtype or rt.torch_dtype()).contiguous()


def _same_type_runs(weights: list[GGUFTensor]) -> list[list[GGUFTensor]]:
    """[q, k, v] -> [[q, k], [v]] where v's type differs: maximal runs of one GGUF type."""
    runs: list[list[GGUFTensor]] = []
    for w in weights:
        if runs and int(runs[-1][-1].ggml_type) == int(w.ggml_type):
            runs[-1].append(w)
        else:
            runs.append([w])
    return runs


class QuantLinear(nn.Module):
    """y = x @ W^T (+ b) for W [N, K] from GGUF tensors (GGUF ne = [K, N]).

    Several tensors with the same input width fuse into one along N (q|k|v, gate|up): one matmul
    instead of three. "quant" keeps W in its GGUF blocks and dequantizes per call (the reference
    path every quantized-matmul kernel is tested against); "dense" dequantizes once at load.
    """

    def __init__(
        self,
        weights: GGUFTensor | list[GGUFTensor],
        rt: RuntimeConfig,
        biases: GGUFTensor | list[GGUFTensor | None] | None = None,
    ):
        super().__init__()
        weights = weights if isinstance(weights, list) else [weights]
        biases = biases if isinstance(biases, list) else [biases] * len(weights)
        self.splits = [w.shape[0] for w in weights]  # output widths of the fused parts
        self.out_features, self.in_features = sum(self.splits), weights[0].shape[1]
        self.ggml_type = int(weights[0].ggml_type)
        self.mode = rt.weights_mode()
        if self.mode == "dense":
            w = torch.cat([_dense(t, rt) for t in weights])
            self.weight = nn.Parameter(w, requires_grad=False)
        elif self.mode == "quant":
            self._init_quant(weights, rt)
        else:
            self._init_packed(weights, rt)
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat(
                [
                    _dense(b, rt) if b is not None else torch.zeros(n, device=rt.device)
                    for b, n in zip(biases, self.splits)
                ]
            ).to(rt.torch_dtype())

    def _init_quant(self, weights: list[GGUFTensor], rt: RuntimeConfig) -> None:
        # Rows of a GGUF tensor are independent runs of blocks, so adjacent tensors of one type
        # fuse by concatenating their bytes (the packed planes are per row too, so the fused
        # weight dequantizes to the parts' values bit for bit); a type change starts a new part:
        # Q4_K_M's q|k beside a Q6_K v is two matmuls, not three. The implementation's prepare
        # hook runs here, once per device (Triton: repack the blocks into its planes), so calls
        # never repack.
        impl = select("qlinear", torch.device(rt.device))
        self._qlinear, self._quantize_input = impl.fn, impl.quantize_input
        self._quantize_norm, self._input_layout = impl.quantize_norm, impl.input_layout
        runs = _same_type_runs(weights) if rt.fuse_linears else [[w] for w in weights]
        parts = []
        for run in runs:
            raw = torch.cat([w.torch() for w in run]) if len(run) > 1 else run[0].torch()
            shape = (sum(w.shape[0] for w in run), self.in_features)
            ggml_type = int(run[0].ggml_type)
            parts.append(
                (prepare_weight(impl, raw.to(rt.device), ggml_type, shape), ggml_type, shape)
            )
        self.parts = parts if len(parts) > 1 else None
        if self.parts is None:
            self.qweight = parts[0][0]

    def _init_packed(self, weights: list[GGUFTensor], rt: RuntimeConfig) -> None:
        # CPU repacking (kernels/cpu_linear.py). "qdot" packs each run of one GGUF type apart
        # (Q4_K_M's q|k as Q4_K blocks beside a Q6_K v: cpu_qdot.cpu_scheme, the rule the
        # planner prices); other modes pack same-type tensors from their GGUF bytes (int4 keeps
        # Q4 codes as they are) and mixed types from the exact fp32 weights.
        if self.mode == "qdot":
            self._set_packed([self._pack_qdot_run(run) for run in _same_type_runs(weights)])
            return
        if all(int(w.ggml_type) == self.ggml_type for w in weights):
            raws = [w.torch() for w in weights]
            raw, qtype = (torch.cat(raws) if len(raws) > 1 else raws[0]), self.ggml_type
        else:
            raw = torch.cat([dequantize(w.torch(), w.ggml_type, w.shape) for w in weights])
            qtype = int(GGMLQuantizationType.F32)
        shape = (self.out_features, self.in_features)
        self._set_packed([pack_linear(raw, qtype, shape, self.mode)])

    def _pack_qdot_run(self, run: list[GGUFTensor]) -> PackedLinear:
        raw = torch.cat([w.torch() for w in run]) if len(run) > 1 else run[0].torch()
        qtype, shape = int(run[0].ggml_type), (sum(w.shape[0] for w in run), self.in_features)
        if qtype in cpu_qdot.NATIVE_TYPES:
            return pack_linear(raw, qtype, shape, "qdot")
        # float and grid IQ types: fp16 (exact fp32 where fp16 cannot hold the weights)
        scheme = choose_scheme(raw, qtype, shape, candidates=("fp16", "fp32"))
        return pack_linear(raw, qtype, shape, scheme)

    def _set_packed(self, parts: list[PackedLinear]) -> None:
        """The packed parts (one per GGUF type run in "qdot" mode) and their calls."""
        self.packed_parts = parts
        self._calls = [self._packed_call(p) for p in parts]

    @property
    def packed(self) -> PackedLinear | None:
        """The packed weight when it is one part."""
        return self.packed_parts[0] if len(self.packed_parts) == 1 else None

    @staticmethod
    def _packed_call(packed: PackedLinear):
        w = packed.weight
        if packed.scheme == "qdot":
            # pointers taken once: a decode step makes ~120 of these calls
            fast = functools.partial(
                cpu_qdot.linear_ptrs, ggml_type=int(w.ggml_type), n=w.n, k=w.k,
                wptr=w.packed.data_ptr(), fn=cpu_qdot.load().qdot_linear,
            )  # fmt: skip
            return lambda x: fast(x) if x.dtype == torch.float32 else packed_linear(x, packed)
        return lambda x: packed_linear(x, packed)

    @classmethod
    def tied(cls, embedding: QuantEmbedding) -> QuantLinear:
        """An output projection that shares the token embedding's table."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features = embedding.shape
        self.ggml_type, self.mode, self.bias = embedding.ggml_type, embedding.mode, None
        self.splits, self.parts = [self.out_features], None
        if self.mode == "dense":
            self.weight = embedding.weight
        elif self.mode == "qdot":  # the table's own blocks (Q8_0 stays Q8_0), as an output's
            self._set_packed([self._pack_qdot_run([embedding.table])])
        elif self.mode != "quant":  # packed from the embedding's exact fp32 table
            f32, table = int(GGMLQuantizationType.F32), embedding.weight.float()
            self._set_packed([pack_linear(table, f32, embedding.shape, self.mode)])
        else:
            impl = select("qlinear", embedding.qweight.device)
            # the embedding keeps the GGUF rows it looks up; the head gets its own prepared copy
            # where the implementation repacks (the reference shares the bytes)
            self.qweight = prepare_weight(
                impl, embedding.qweight, embedding.ggml_type, embedding.shape
            )
            self._qlinear, self._quantize_input = impl.fn, impl.quantize_input
            self._quantize_norm, self._input_layout = impl.quantize_norm, impl.input_layout
        return self

    # a big step's matmul on another device (execution/offload.py sets it on a CPU segment)
    offload = None
    _quantize_norm = None  # the kernel's hook for the norm before it (quant mode only)
    _input_layout = None  # the kernel's layout of pre-quantized x (quant mode only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.mode == "dense":
            y = x @ self.weight.t()
        elif self.offload is not None and self.offload.runs(x):
            y = self.offload(self, x)
        elif self.mode != "quant":
            if len(self._calls) == 1:
                y = self._calls[0](x).to(x.dtype)
            else:
                y = torch.cat([call(x) for call in self._calls], dim=-1).to(x.dtype)
        elif self.parts is None:
            y = self._qlinear(
                x, self.qweight, self.ggml_type, (self.out_features, self.in_features)
            )
        else:
            y = torch.cat(self._part_outputs(x), dim=-1)
        return y if self.bias is None else y + self.bias

    def outputs(self, x) -> list[torch.Tensor]:
        """The fused parts' outputs [T, Ni] as their matmuls give them (no launch joins them),
        where this linear runs its parts apart (GGUF types of their own, quant mode); else
        [forward(x)]."""
        if self.mode != "quant" or self.parts is None or self.bias is not None:
            return [self(x)]
        if self.offload is not None and self.offload.runs(x):
            return [self(x)]
        return self._part_outputs(x)

    def _part_outputs(self, x) -> list[torch.Tensor]:
        xs = x if isinstance(x, PartInputs) else [x] * len(self.parts)
        return [self._qlinear(xi, *part) for xi, part in zip(xs, self.parts)]

    def _one_kernel(self) -> bool:
        """Whether one quantized kernel reads this linear's input (quant mode, one part, not
        offloaded): where the hooks that hand it pre-quantized input apply."""
        return self.mode == "quant" and self.parts is None and self.offload is None

    def quantized_input(self, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu"):
        """act(gate, up) as this linear's kernel reads it pre-quantized (the activation and the
        quantization in one launch: the integer decode GEMV's input), or None."""
        if not self._one_kernel():
            return None
        hook = self._quantize_input
        return None if hook is None else hook(self.qweight, gate, up, activation)

    def input_layout(self, like: torch.Tensor):
        """The layout (xquant.XLayout) in which this linear's kernel reads x of like's rows and
        dtype already quantized (the op that makes x quantizing it in its own launch, then
        handing QuantizedRows), or None where it reads x plain."""
        hook = self._input_layout
        return None if hook is None or not self._one_kernel() else hook(self.qweight, like)

    def normed_input(self, x, residual, weight: torch.Tensor, eps: float):
        """(x + residual, rms_norm(x + residual) * weight as this linear's kernel reads it
        pre-quantized) from one launch (the add, the norm and the integer decode GEMV's
        quantization), or None. residual None: x alone. A linear of parts of other GGUF types
        (Q4_K_M's q|k beside a Q6_K v) gets PartInputs, each part's layout made in the same
        launch (where the norm and two quantizations were three launches)."""
        hook = self._quantize_norm
        if self.mode != "quant" or self.offload is not None or hook is None:
            return None
        if self.parts is None:
            out = hook(self.qweight, x, residual, weight, eps)
            return None if out is None else (out[1], out[0])
        out = hook([w for w, _, _ in self.parts], x, residual, weight, eps)
        return None if out is None else (out[1], PartInputs(out[0]))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs of the fused parts: [T, N] -> ([T, N0], [T, N1], ...)."""
        return y.split(self.splits, dim=-1)


class PartInputs(tuple):
    """The input of a linear of several parts, one per part as that part's kernel reads it
    (QuantLinear.normed_input): the norm quantized in each part's layout."""

    @property
    def shape(self) -> tuple[int, int]:
        return self[0].shape


class QuantEmbedding(nn.Module):
    """Token embedding [V, C]; in "quant" mode only the looked-up rows are dequantized."""

    def __init__(self, table: GGUFTensor, rt: RuntimeConfig):
        super().__init__()
        self.shape = table.shape
        self.ggml_type = int(table.ggml_type)
        self.mode = rt.weights_mode()
        self.dtype = rt.torch_dtype()
        if self.mode != "quant":  # dense, or packed linears: rows are looked up from fp32
            self.weight = nn.Parameter(_dense(table, rt), requires_grad=False)
            self.table = table  # the mapped GGUF tensor, for a tied head that packs its blocks
        else:
            self.qweight = table.torch().to(rt.device)
            self._embed = select("embed", torch.device(rt.device)).fn

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, C]
        if self.mode != "quant":
            return self.weight[ids]
        return self._embed(ids, self.qweight, self.ggml_type, self.shape).to(self.dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: GGUFTensor, eps: float, rt: RuntimeConfig):
        super().__init__()
        self.weight = nn.Parameter(_dense(weight, rt, torch.float32), requires_grad=False)
        self.eps = eps
        self._fn = select("rms_norm", torch.device(rt.device)).fn
        fused = select("add_rms_norm", torch.device(rt.device))
        self._add = None if fused.is_reference else fused.fn  # unfused: the add, then _fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., C]
        return self._fn(x, self.weight, self.eps)

    def add(
        self, x: torch.Tensor, delta: torch.Tensor | None, into: QuantLinear | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add fused with the norm that follows it: (x + delta, norm(x + delta));
        delta None: (x, norm(x)). `into`: the linear the norm feeds, which may take the norm
        already quantized for its kernel (made in the same launch: QuantLinear.normed_input)."""
        if into is not None:
            fused = into.normed_input(x, delta, self.weight, self.eps)
            if fused is not None:
                return fused
        if delta is None:
            return x, self(x)
        if self._add is None:
            total = x + delta
            return total, self(total)
        normed, total = self._add(x, delta, self.weight, self.eps)
        return total, normed


class Rotary(nn.Module):
    """cos/sin tables for positions, with the file's frequency scaling.

    freqs[i] = theta^(-2i/rope_dim), divided by `rope_freqs` factors when the file has them
    (llama3-style long context), and stretched by linear or YaRN scaling as the metadata says.
    """

    def __init__(self, cfg: ModelConfig, rt: RuntimeConfig, freq_factors: GGUFTensor | None):
        super().__init__()
        self.style = cfg.rope_style
        dim = cfg.rope_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if freq_factors is not None:
            inv = inv / _dense(freq_factors, RuntimeConfig(device="cpu"), torch.float32)
        self.mscale = 1.0
        inv = self._scale(inv, cfg, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv.to(rt.device), persistent=False)
        self._fn = select("rope", torch.device(rt.device)).fn

    def _scale(self, inv: torch.Tensor, cfg: ModelConfig, s: RopeScaling) -> torch.Tensor:
        if s.kind == "linear":
            return inv / s.factor
        if s.kind != "yarn":
            return inv
        # YaRN (llama.cpp's rope_yarn): dims that rotate fast keep their frequency, slow ones are
        # interpolated by 1/factor, with a linear ramp between the two correction dims.
        n_ctx = s.original_context_length or cfg.context_length
        dim = cfg.rope_dim

        def corr(beta: float) -> float:
            return dim * math.log(n_ctx / (beta * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        low, high = corr(s.beta_fast), corr(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(0.0, low), min(dim - 1.0, high)
        i = torch.arange(0, dim // 2, dtype=torch.float32)
        ramp = 1.0 - torch.clamp((i - low) / max(0.001, high - low), 0.0, 1.0)
        self.mscale = (s.attn_factor or 1.0) * (1.0 + 0.1 * math.log(s.factor))
        return (inv / s.factor) * (1.0 - ramp) + inv * ramp

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, R]
        if self.mscale == 1.0:  # (two launches a step fewer)
            return freqs.cos(), freqs.sin()
        return freqs.cos() * self.mscale, freqs.sin() * self.mscale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._fn(x, cos, sin, self.style)  # [T, H, D]
