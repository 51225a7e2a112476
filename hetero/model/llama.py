"""The llama family in plain torch: llama (SmolLM2, Mistral-style), qwen2, qwen3, by flags.

Reads top to bottom. Shapes: T new tokens, C model width, H query heads, KV key/value heads,
D head dim, F feed-forward width, V vocabulary.

    tokens [T] -> embed [T, C]
    for each block:
        h = rms_norm(x)
        q, k, v = h [Wq|Wk|Wv] (+b), split                   [T, H, D], [T, KV, D], [T, KV, D]
        q, k = rms_norm_per_head(q), rms_norm_per_head(k)   (qwen3 only; on a GPU one
        q, k = rope(q), rope(k)                              launch with the rope: qk_norm_rope)
        x = x + attention(q, k, v) Wo                        (KV stored by the backend)
        gate, up = rms_norm(x) [Wgate|Wup], split            [T, F] each
        x = x + (silu(gate) * up) Wdown       (added by the next block's norm: one fused op)
    logits = rms_norm(x[wanted]) Wout                       [N, V] float32
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from hetero.config import ModelConfig, RuntimeConfig, bind_device
from hetero.gguf_loader import GGUFModel
from hetero.kernels import cpu_threads, select
from hetero.kernels.xquant import QuantizedRows
from hetero.model.forward_batch import ForwardBatch
from hetero.model.layers import QuantEmbedding, QuantLinear, RMSNorm, Rotary
from hetero.model.moe import cpu_expert_layers
from hetero.model.native_block import dense_block


class Attention(nn.Module):
    def __init__(self, gm: GGUFModel, i: int, rt: RuntimeConfig):
        super().__init__()
        cfg, p = gm.config, f"blk.{i}."
        self.cfg, self.layer = cfg, i
        names = [p + "attn_q", p + "attn_k", p + "attn_v"]
        self.wqkv = QuantLinear(  # q | k | v fused: [C] -> [H*D + 2*KV*D]
            [gm.tensor(n + ".weight") for n in names], rt, [gm.get(n + ".bias") for n in names]
        )
        self.wo = QuantLinear(gm.tensor(p + "attn_output.weight"), rt)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(gm.tensor(p + "attn_q_norm.weight"), cfg.norm_eps, rt)
            self.k_norm = RMSNorm(gm.tensor(p + "attn_k_norm.weight"), cfg.norm_eps, rt)
            fused = select("qk_norm_rope", torch.device(rt.device))  # one launch for the four
            self._qk_norm_rope = None if fused.is_reference else fused.fn

    def _qk_v(self, h) -> tuple[torch.Tensor, torch.Tensor]:
        """(q|k [T, H + KV, D], v [T, KV, D]) as views of q|k|v's matmul output, or of its
        parts' outputs where q|k and v are parts of their own (Q4_K_M's Q6_K v: no launch
        joins them)."""
        t, cfg = h.shape[0], self.cfg
        outs = self.wqkv.outputs(h)
        if len(outs) == 2 and outs[0].shape[-1] == cfg.q_size + cfg.kv_size:
            qk, v = outs
        else:
            qkv = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            qk, v = qkv[:, : cfg.q_size + cfg.kv_size], qkv[:, cfg.q_size + cfg.kv_size :]
        return qk.view(t, -1, cfg.head_dim), v.view(t, cfg.n_kv_heads, cfg.head_dim)

    def forward(self, h: torch.Tensor, rotary: Rotary, cos, sin, batch: ForwardBatch):
        t, cfg = h.shape[0], self.cfg
        if self.q_norm is None:  # q and k rotate in one call: [T, H + KV, D]
            qk, v = self._qk_v(h)
            fused = getattr(batch.attention, "rope_attend", None)  # rotation + KV write: one op
            if fused is not None:
                q, k = qk.split([cfg.n_heads, cfg.n_kv_heads], dim=1)
                # the output quantized in the attention's launch where wo reads it so
                quant = self.wo.input_layout(v[:, 0])
                o = fused(self.layer, q, k, v, cos, sin, rotary.style, quant)
                if isinstance(o, QuantizedRows):
                    return self.wo(o)
                if o is not None:
                    return self.wo(o.reshape(t, cfg.q_size))
            q, k = rotary(qk, cos, sin).split([cfg.n_heads, cfg.n_kv_heads], dim=1)
        else:
            q, k, v = self.wqkv.split(self.wqkv(h))
            q = q.reshape(t, cfg.n_heads, cfg.head_dim)
            k = k.reshape(t, cfg.n_kv_heads, cfg.head_dim)
            v = v.reshape(t, cfg.n_kv_heads, cfg.head_dim)
            if self._qk_norm_rope is not None:
                wq, wk = self.q_norm.weight, self.k_norm.weight
                eps = self.q_norm.eps
                q, k = self._qk_norm_rope(q, k, wq, wk, eps, cos, sin, rotary.style)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
                q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        o = batch.attention(self.layer, q, k, v)  # [T, H, D]
        return self.wo(o.reshape(t, cfg.q_size))


class FeedForward(nn.Module):
    def __init__(self, gm: GGUFModel, i: int, rt: RuntimeConfig):
        super().__init__()
        p = f"blk.{i}."
        self.gate_up = QuantLinear(  # gate | up fused: [C] -> [2F]
            [gm.tensor(p + "ffn_gate.weight"), gm.tensor(p + "ffn_up.weight")], rt
        )
        self.down = QuantLinear(gm.tensor(p + "ffn_down.weight"), rt)
        self._silu_mul = select("silu_mul", torch.device(rt.device)).fn

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [T, C] -> [T, C]
        offload = self.gate_up.offload  # a big step on a CPU segment: all three on the GPU
        whole = getattr(offload, "feed_forward", None)  # (a hook may run single matmuls only)
        if whole is not None and offload.runs(h):
            y = whole(self.gate_up, self.down, h)
            if y is not None:
                return y
        gate, up = self.gate_up.split(self.gate_up(h))
        a = self.down.quantized_input(gate, up)  # (SiLU and the down GEMV's quantization)
        return self.down(a if a is not None else self._silu_mul(gate, up))


class Block(nn.Module):
    def __init__(
        self,
        gm: GGUFModel,
        i: int,
        rt: RuntimeConfig,
        attn: nn.Module | None = None,
        ffn: nn.Module | None = None,
        ffn_norm: str = "ffn_norm",
    ):
        """Another family's block passes its own attention or feed-forward (the MoE families:
        model/qwen3moe.py, model/gpt_oss.py), and the name of the norm before the latter."""
        super().__init__()
        eps = gm.config.norm_eps
        self.attn_norm = RMSNorm(gm.tensor(f"blk.{i}.attn_norm.weight"), eps, rt)
        self.attn = attn or Attention(gm, i, rt)
        self.ffn_norm = RMSNorm(gm.tensor(f"blk.{i}.{ffn_norm}.weight"), eps, rt)
        self.ffn = ffn or FeedForward(gm, i, rt)
        self._native = None  # the block as one native call on a CPU (model/native_block.py)
        self._lins = [m for m in self.modules() if isinstance(m, QuantLinear)]

    def forward(
        self, x, pending: torch.Tensor | None, rotary, cos, sin, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [T, C], the block's output not yet added to x): the feed-forward's output is added
        by the next block's attention norm (one fused add + norm instead of an add, then a
        norm), or by the model after the last block. `pending`: the previous block's output."""
        fast = self._native
        if fast is None:  # decided at the first call: the weights are final then
            fast = self._native = (x.device.type == "cpu" and dense_block(self)) or False
        if fast and not any(lin.offload is not None and lin.offload.runs(x) for lin in self._lins):
            native_layer = getattr(batch.attention, "native_layer", None)
            kv = native_layer(self.attn.layer) if native_layer is not None else None
            out = fast(x, pending, cos, sin, kv)
            if out is not None:
                return out
        # the norms' outputs go to q|k|v and gate|up already quantized where their kernel reads
        # one token so (the llama family's own modules: another family's take plain tensors)
        qkv = self.attn.wqkv if isinstance(self.attn, Attention) else None
        gate_up = self.ffn.gate_up if isinstance(self.ffn, FeedForward) else None
        x, h = self.attn_norm.add(x, pending, into=qkv)
        x, h = self.ffn_norm.add(x, self.attn(h, rotary, cos, sin, batch), into=gate_up)
        return x, self.ffn(h)


class LlamaModel(nn.Module):
    def __new__(cls, gm: GGUFModel, *args, **kwargs):
        # LlamaModel(gm, ...) builds the file's family: the MoE families subclass this one and
        # differ in their blocks only (model/families.py)
        if cls is LlamaModel:
            from hetero.model.families import model_class

            cls = model_class(gm.config.arch)
        return super().__new__(cls)

    def __init__(
        self, gm: GGUFModel, rt: RuntimeConfig, layers: range | None = None, progress: bool = False
    ):
        super().__init__()
        cfg = self.config = gm.config
        self.runtime = rt = rt.resolved()  # one device, one weights mode
        bind_device(rt.device)  # load-time repacks launch kernels on the current device
        cpu_expert_layers(cfg, rt)  # --cpu-moe / --n-cpu-moe must fit the model
        self.layer_range = layers if layers is not None else range(cfg.n_layers)
        # A pipeline stage holds only its layers: the embedding on the first stage, the final
        # norm and lm_head on the last (which keeps the embedding too when lm_head is tied to it).
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == cfg.n_layers
        tied_last = self.is_last and cfg.tied_embeddings
        self.embed = None
        if self.is_first or tied_last:
            self.embed = QuantEmbedding(gm.tensor("token_embd.weight"), rt)
        self.rotary = Rotary(cfg, rt, gm.get("rope_freqs.weight"))
        bar = tqdm(self.layer_range, desc="loading layers", unit="layer", disable=not progress)
        self.blocks = nn.ModuleList(self.block(gm, i, rt) for i in bar)
        self.norm = self.lm_head = None
        if self.is_last:
            self.norm = RMSNorm(gm.tensor("output_norm.weight"), cfg.norm_eps, rt)
            if cfg.tied_embeddings:
                self.lm_head = QuantLinear.tied(self.embed)
            else:
                self.lm_head = QuantLinear(gm.tensor("output.weight"), rt)

    def block(self, gm: GGUFModel, i: int, rt: RuntimeConfig) -> nn.Module:
        """Block i of this family (a subclass changes what a block holds)."""
        return Block(gm, i, rt)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, batch: ForwardBatch, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [T] -> logits [N, V] float32 for the rows in batch.logits_indices.

        A later pipeline stage starts from the previous stage's `hidden` [T, C] instead of the
        tokens; a stage before the last returns its hidden states [T, C] for the next one.
        """
        x, pending = self._blocks(tokens, batch, hidden)
        if not self.is_last:
            return x if pending is None else x + pending
        rows = batch.logits_indices
        # only the wanted rows are added and normed (a last stage without layers: normed), the
        # norm handed to the head already quantized where its kernel reads it so
        _, x = self.norm.add(x[rows], None if pending is None else pending[rows], self.lm_head)
        return self.lm_head(x).float()  # [N, V]

    def _blocks(self, tokens, batch: ForwardBatch, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers: (x [T, C], the last block's output not yet added to x)."""
        x = self.embed(tokens) if hidden is None else hidden  # [T, C]
        cos, sin = self.rotary.cos_sin(batch.positions)  # [T, R] each
        pending = None  # a block's output, added by the next block's fused add + norm
        for block in self.blocks:
            x, pending = block(x, pending, self.rotary, cos, sin, batch)
        return x, pending

    @torch.inference_mode()
    def final_hidden(self, tokens: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """tokens [T] -> every token's last hidden state [T, C] (after the final norm, before the
        head: what embeddings pool); a whole model only."""
        x, pending = self._blocks(tokens, batch, None)
        return self.norm(x) if pending is None else self.norm.add(x, pending)[1]


def load_model(
    path, rt: RuntimeConfig | None = None, progress: bool = False
) -> tuple[GGUFModel, LlamaModel]:
    from hetero.gguf_loader import load_gguf

    rt = rt or RuntimeConfig()
    if rt.device == "cpu":  # the kernels' pool and torch's team: --threads or the default rule
        cpu_threads.configure(rt.threads)
    elif rt.threads:
        torch.set_num_threads(rt.threads)
    gm = load_gguf(path)
    return gm, LlamaModel(gm, rt, progress=progress)


def config_summary(cfg: ModelConfig) -> str:
    ffn = f"ffn {cfg.d_ff}"
    if cfg.is_moe:
        ffn = f"{cfg.n_experts} experts ({cfg.n_experts_used} a token) x ffn {cfg.d_ff_expert}"
    window = f", sliding window {cfg.sliding_window}" if cfg.sliding_window else ""
    return (
        f"{cfg.arch} {cfg.name!r}: {cfg.n_layers} layers, width {cfg.d_model}, "
        f"{cfg.n_heads} heads ({cfg.n_kv_heads} kv) x {cfg.head_dim}, {ffn}, "
        f"vocab {cfg.vocab_size}, context {cfg.context_length}{window}"
    )
