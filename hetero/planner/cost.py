"""The cost model: seconds and bytes of a range of layers on one device, from its profile.

A decode step over m sequences on a stage holding layers [a, b) runs T = m rows, or on CUDA the
CUDA-graph bucket T >= m the engine replays (1, 2, 4, ... max_num_seqs; padding rows cost as
real ones). Replayed (or on a CPU, where decode overheads are measured from decode steps):

    step_overhead + m * seq_step_overhead                                    host, per step
    + sum over layers of (layer_overhead + T * seq_overhead                   host, launches
                                        + sum over its matrices of matmul(bytes, params, T)
                                        + m * ctx * kv_bytes_per_token / attn_gbs)  KV reads
                                                     (ctx: at most the window on a window layer)
    + (last stage) the output projection and m * V float32 logits read twice
    + (not last) m * d_model * 2 bytes sent to the next stage / link GB/s + latency

matmul(T) is the registry kernel's measured time at T (MatmulRate: a curve over small T, then the
prefill rate). An eager step (a prefill past the prompt graphs' rows, or past their context
budget; any step under --enforce-eager) costs host time
eager_step + L * eager_layer and device time (the sums above without the overheads): on a GPU the
longer of the two (the host enqueues while the device runs), on a CPU their sum.

Every rate and overhead comes from the device's profile (measured, or datasheet for dry runs);
there is no other constant. Prefill swaps the KV reads for attention flops,
4 n (c + n/2) H D per layer for n new tokens after c cached ones, at the dense matmul rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hetero.engine.config import EngineConfig
from hetero.engine.kv_groups import KVGroups, blocks_needed
from hetero.execution.cuda_graph import batch_buckets, bucket_for
from hetero.execution.kv_pool import block_bytes
from hetero.execution.offload_experts import streams_experts
from hetero.planner.device import DeviceProfile
from hetero.planner.model_desc import ModelDesc, TensorInfo, rate_key, weight_bytes

ACT_BYTES_WIRE = 2  # activations cross stages in bf16/fp16
# Matrices of a block that the loader joins into one linear where they share a GGUF type
# (model/llama.py: one QuantLinear of several tensors): q|k|v, gate|up
FUSED = {
    "attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gateup", "ffn_up": "gateup",
}  # fmt: skip


def kv_token_bytes(desc: ModelDesc, kv_dtype: str) -> int:
    """KV bytes of one token in one layer (k and v, fp8 scales included)."""
    return block_bytes(desc.config, 1, 1, kv_dtype)


def kv_layer_slots(desc: ModelDesc, a: int, b: int) -> int:
    """Layers of KV a block of layers [a, b) holds: b - a, or with sliding-window layers the
    largest KV cache group's count there (engine/kv_groups.py: the groups share the slots)."""
    return KVGroups.of(desc.config).slots(range(a, b))[1]


def seq_blocks(desc: ModelDesc, context: int, engine: EngineConfig) -> int:
    """KV blocks one sequence of `context` tokens holds, every group's (a window group's only
    those of its window and of one step: engine/kv_groups.blocks_needed)."""
    windows = KVGroups.of(desc.config).windows
    step = engine.scheduler.max_num_batched_tokens
    return blocks_needed(windows, context, step, engine.block_size)


@dataclass(frozen=True)
class DeviceCost:
    """Costs of `desc` on `dev` in one weights mode and KV dtype (arrays over layers)."""

    desc: ModelDesc
    dev: DeviceProfile
    weights: str
    kv_dtype: str
    graphs: bool = False  # decode-only steps replayed from CUDA graphs (CUDA, not --enforce-eager)
    max_num_seqs: int = 256  # the largest graph bucket
    # Mixture of experts: the experts of the first `ram_experts` layers stay in system RAM and
    # multiply on `expert_host` (a CPU's costs; --cpu-moe / --n-cpu-moe), the rest here
    ram_experts: int = 0
    expert_host: DeviceCost | None = None
    # prompt steps stream the RAM experts to this GPU and multiply them here from this many
    # tokens on, where they give each expert enough rows (execution/offload_experts.py); 0: never
    stream_experts_from: int = 0

    def decode_rows(self, m: int, replay: bool = True) -> int | None:
        """Rows a replayed decode step of m sequences runs (its bucket); None: run eagerly.
        replay: whether the step may replay at all (the engine and every pipeline stage capture
        graphs on CUDA; False prices an eager step of a graph-capable device)."""
        if not (self.graphs and replay) or self.dev.is_cpu:
            return None

        return bucket_for(m, batch_buckets(self.max_num_seqs))

    def eager(self, m: int, replay: bool = True) -> bool:
        """Whether a decode step of m sequences runs eagerly on a GPU (host-bound overheads)."""
        d = self.dev
        return not d.is_cpu and d.has_eager and self.decode_rows(m, replay) is None

    def step_seconds(self, n_layers: int, work_s: float, eager: bool, seqs: int = 0) -> float:
        """One step of `n_layers` layers whose device work (with per-layer overheads when not
        eager: replay_layer_seconds) is work_s; a replayed step adds the once-a-step cost of
        the `seqs` sequences it samples for."""
        d = self.dev
        if not eager:
            work_s += seqs * d.seq_step_overhead_s
        if not d.has_eager:  # datasheets, made-up profiles: decode's overheads, added
            return d.step_overhead_s + (n_layers * d.layer_overhead_s if eager else 0.0) + work_s
        if not eager:
            return d.step_overhead_s + work_s
        host = d.eager_step_overhead_s + n_layers * d.eager_layer_overhead_s
        return host + work_s if d.is_cpu else max(host, work_s)

    def _bytes(self, t: TensorInfo) -> float:
        return weight_bytes(t, self.weights, self.dev.is_cpu)

    def _here(self, i: int, t: TensorInfo) -> bool:
        """Whether layer i's tensor t is held on this device (not an expert kept in RAM)."""
        return not (t.is_expert and i < self.ram_experts)

    @cached_property
    def layer_bytes(self) -> list[float]:
        return [
            sum(self._bytes(t) for t in layer if self._here(i, t))
            for i, layer in enumerate(self.desc.layers)
        ]

    def ram_expert_bytes(self) -> float:
        """Bytes of the experts held in RAM (in the host's weights mode)."""
        if self.expert_host is None:
            return 0.0
        host = self.expert_host
        return sum(
            host._bytes(t) for layer in self.desc.layers[: self.ram_experts] for t in layer
            if t.is_expert
        )  # fmt: skip

    @cached_property
    def _layer_prefix(self) -> list[float]:
        out = [0.0]
        for b in self.layer_bytes:
            out.append(out[-1] + b)
        return out

    def weights_bytes(self, a: int, b: int, first: bool, last: bool) -> float:
        total = self._layer_prefix[b] - self._layer_prefix[a]
        if first:
            total += self._embed_bytes()
        if last:
            total += sum(self._bytes(t) for t in self.desc.globals_)
            if self.desc.output is not None:
                total += self._bytes(self.desc.output)
            elif not first:  # a tied head on a stage without the embedding holds its own copy
                total += self._bytes(self.desc.embed)
        return total

    def _embed_bytes(self) -> float:
        # Only "quant" keeps the table in GGUF blocks; other modes look rows up from a dense
        # table in the activation dtype (fp32 on a CPU, bf16 on a GPU).
        e = self.desc.embed
        if self.weights == "quant":
            return float(e.nbytes)
        return (4.0 if self.dev.is_cpu else 2.0) * e.params

    def linear_seconds(self, t: TensorInfo, tokens: int, layer: int = -1) -> float:
        if t.is_expert:
            return self.expert_seconds(t, tokens)
        rate = self.dev.matmul_rate(*rate_key(self.weights, t.ggml_type))
        run = self._fused_bytes(layer).get(t.name, 0.0) if layer >= 0 else 0.0
        return rate.seconds(self._bytes(t), t.params, tokens, run)

    def _joined(self, i: int) -> list[list[TensorInfo]]:
        """Layer i's matrices held here, as the linears the loader makes of them: q|k|v and
        gate|up joined where they share a GGUF type (FUSED), the others alone."""
        groups: dict[object, list[TensorInfo]] = {}
        for t in self.desc.layers[i]:
            if t.is_matrix and self._here(i, t):
                joint = FUSED.get(t.name.split(".")[-2])
                groups.setdefault((joint, t.ggml_type) if joint else t.name, []).append(t)
        return list(groups.values())

    def joined_parts(self, i: int) -> list[tuple[float, int, int, str]]:
        """(bytes, params, rows, GGUF type) of each linear layer i runs (one type a part)."""
        return [
            (sum(self._bytes(t) for t in ts), sum(t.params for t in ts),
             sum(t.shape[0] for t in ts), ts[0].ggml_type)
            for ts in self._joined(i)
        ]  # fmt: skip

    def _fused_bytes(self, i: int) -> dict[str, float]:
        """Layer i's matrices that run joined with others -> the joined matrix's bytes, whose
        size sets the rate (cached)."""
        cache = self.__dict__.setdefault("_fused", {})
        if i not in cache:
            cache[i] = {
                t.name: sum(self._bytes(u) for u in ts)
                for ts in self._joined(i) if len(ts) > 1 for t in ts
            }  # fmt: skip
        return cache[i]

    def expert_seconds(self, t: TensorInfo, tokens: int) -> float:
        """The grouped matmul of an expert tensor [E, N, K] over `tokens` tokens, k experts
        each: it reads the experts some token chose, E (1 - (1 - k/E)^T) of them on average for
        independent choices, each over its share of the T k slots. Experts stay in GGUF blocks
        but for "dense": on a GPU the quantized kernels' rate, on a CPU qdot's (the native
        kernels the CPU expert matmuls are meant to run)."""
        cfg = self.desc.config
        e, k = cfg.n_experts, cfg.n_experts_used
        touched = e * (1.0 - (1.0 - k / e) ** tokens)
        mode = self.weights if self.weights == "dense" else "qdot" if self.dev.is_cpu else "quant"
        rate = self.dev.matmul_rate(*rate_key(mode, t.ggml_type))
        per_expert = max(1, round(tokens * k / touched))
        return touched * rate.seconds(self._bytes(t) / e, t.params / e, per_expert)

    def _layer_matmuls(self, i: int, tokens: int) -> float:
        total, ram = 0.0, i < self.ram_experts
        host = self.expert_host
        cfg = self.desc.config
        streamed = (
            ram
            and not self.dev.is_cpu
            and streams_experts(tokens, cfg.n_experts, cfg.n_experts_used, self.stream_experts_from)
        )
        here, crossing = 0.0, 0.0  # the streamed experts: multiplied here, bytes over PCIe
        for t in self.desc.layers[i]:
            if self._here(i, t):
                total += self.linear_seconds(t, tokens, i) if t.is_matrix or t.is_expert else 0.0
            elif streamed:
                here += self.expert_seconds(t, tokens)
                crossing += host._bytes(t)  # type: ignore[union-attr]
            else:  # an expert in RAM: multiplied on the host, its input there and back
                total += host.expert_seconds(t, tokens)  # type: ignore[union-attr]
        if streamed:  # the copy of a layer's experts overlaps the multiplies of the last
            h2d = self.dev.h2d_gbs or host.dev.link_gbs(self.dev)  # type: ignore[union-attr]
            total += max(here, crossing / (h2d * 1e9))
        elif ram:
            total += 2 * transfer_seconds(self.dev, host.dev, tokens, cfg.d_model)  # type: ignore[union-attr]
        return total

    def decode_layer_seconds(self, m: int, ctx: float, replay: bool = True) -> list[float]:
        """Seconds of each layer in a decode step of m sequences with ctx tokens of context
        (device time only when the step runs eagerly on a GPU: step_seconds adds the host's)."""
        d, rows, cfg = self.dev, self.decode_rows(m, replay) or m, self.desc.config
        per_token = m * kv_token_bytes(self.desc, self.kv_dtype) / (d.attn_gbs * 1e9)
        fixed = 0.0 if self.eager(m, replay) else self.replay_layer_seconds(rows)
        return [  # a window layer reads its window's keys only
            fixed + per_token * min(ctx, cfg.layer_window(i) or ctx) + self._layer_matmuls(i, rows)
            for i in range(self.desc.n_layers)
        ]

    def replay_layer_seconds(self, rows: int) -> float:
        """A replayed step's cost a layer besides its device work: launches and small ops."""
        return self.dev.layer_overhead_s + rows * self.dev.seq_overhead_s

    def prefill_layer_seconds(self, n: int, cached: int, seqs: int = 1) -> list[float]:
        """Device seconds of each layer for n new tokens (of `seqs` prompts) after `cached`
        tokens (a prefill step is eager: its host overheads are step_seconds')."""
        cfg, d = self.desc.config, self.dev
        flops = 4.0 * n * (cached + n / 2) * cfg.n_heads * cfg.head_dim / max(seqs, 1)
        attn = flops / ((d.attn_tflops or d.bf16_tflops) * 1e12)
        return [attn + self._layer_matmuls(i, n) for i in range(self.desc.n_layers)]

    def head_seconds(self, tokens: int) -> float:
        """The output projection and its float32 logits (written, then read by the sampler)."""
        logits = 2 * tokens * self.desc.config.vocab_size * 4 / (self.dev.mem_bw_gbs * 1e9)
        return self.linear_seconds(self.desc.head, tokens) + logits

    def activation_bytes(self, tokens: int, seqs: int, last: bool) -> float:
        """Peak scratch of one step of `tokens` tokens over `seqs` sequences: the residual,
        q|k|v, gate|up and their products live at once ([T, 4C + 2F + q + 2kv] in the
        activation dtype), plus float32 logits [seqs, V] on the last stage (only the rows that
        produce a token reach the output projection)."""
        cfg = self.desc.config
        per_token = 4 * cfg.d_model + 2 * cfg.d_ff + cfg.q_size + 2 * cfg.kv_size
        act = tokens * per_token * (4 if self.dev.is_cpu else 2)
        return act + (min(seqs, tokens) * cfg.vocab_size * 4 if last else 0)


def transfer_seconds(src: DeviceProfile, dst: DeviceProfile, tokens: int, d_model: int) -> float:
    """Activations [tokens, d_model] from one stage to the next."""
    nbytes = tokens * d_model * ACT_BYTES_WIRE
    return nbytes / (src.link_gbs(dst) * 1e9) + max(src.link_latency_s, dst.link_latency_s)


def hop_seconds(dev: DeviceProfile, a: int, b: int, n_layers: int) -> float:
    """The host work of a stage over layers [a, b) at its pipeline boundaries: half the hop to
    each side that has a neighbour (the sender pickles and sends, the receiver wakes and
    unpickles: the stage logs show both sides' steps longer by about as much)."""
    return dev.pipeline_hop_s / 2 * ((a > 0) + (b < n_layers))
