"""One attempt of the planner: the devices taking part, their costs, and what a stage costs.

`Setup.stage_s` prices a stage's decode step, `chunk_s` a prompt chunk's, `burst_ttft_s` the
mean TTFT of prompts arriving together; in one process (PlanConfig.in_process) stages hand off
nothing and a CPU stage's prompt matmuls may run on the GPU (offload_to, offloaded_layer_s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from hetero.execution.cuda_graph import PROMPT_ROW_CONTEXT, chunk_row_context
from hetero.execution.offload import item_bytes, ring_slots, rows_kernel_reads, work_bytes
from hetero.execution.offload_experts import streams_experts
from hetero.execution.paged_meta import ROW_TILE
from hetero.planner.burst import burst_first_tokens, prompt_chunks
from hetero.planner.cost import (
    DeviceCost,
    hop_seconds,
    kv_layer_slots,
    kv_token_bytes,
    seq_blocks,
    transfer_seconds,
)
from hetero.planner.model_desc import ModelDesc
from hetero.planner.plan import PlanConfig
from hetero.planner.shares import bandwidth_fraction, is_share, parse_share


def crossing(layer) -> tuple[int, int]:
    """(values a token sends to the GPU, values it brings back) when a CPU layer's matmuls run on
    the GPU (execution/offload.py): q|k|v is one linear (its input once, its outputs), o its own,
    and a feed-forward runs whole there (its input and output only); other matrices each."""
    sent = back = 0
    mats = [t for t in layer if t.is_matrix]
    roles = {t.name.split(".")[-2]: t for t in mats}
    qkv = [t for t in mats if t.name.split(".")[-2] in ("attn_q", "attn_k", "attn_v")]
    if qkv:
        sent, back = qkv[0].shape[1], sum(t.shape[0] for t in qkv)
    ffn = [roles.get(r) for r in ("ffn_gate", "ffn_up", "ffn_down")]
    if all(ffn):
        sent, back = sent + ffn[0].shape[1], back + ffn[2].shape[0]  # type: ignore[union-attr]
    for t in mats:
        if t not in qkv and (t not in ffn or not all(ffn)):
            sent, back = sent + t.shape[1], back + t.shape[0]
    return sent, back


@dataclass
class Setup:
    """One attempt: the devices taking part and their costs."""

    desc: ModelDesc
    config: PlanConfig
    context: int
    costs: list[DeviceCost]
    budgets: list[float]
    compact: bool = False  # each device in its most compact mode (the fastest did not fit)
    _prefix: dict[tuple[int, int, bool], list[float]] = field(default_factory=dict)

    @property
    def ctx(self) -> float:  # average context a decode reads
        return self.config.prompt_len + self.config.output_len / 2

    def kv_need(self, i: int, a: int, b: int) -> float:
        """KV bytes device i needs for layers [a, b): every sequence's blocks (kv_layer_slots
        layers each), within the pool's share of the memory."""
        c = self.config
        blocks = seq_blocks(self.desc, self.context, c.engine) * c.concurrency
        per = kv_token_bytes(self.desc, self.costs[i].kv_dtype) * kv_layer_slots(self.desc, a, b)
        return blocks * c.engine.block_size * per / c.engine.kv_memory_fraction

    def base_bytes(self, i: int, a: int, b: int) -> float:
        """Weights and activations of layers [a, b) on device i."""
        last, c = b == self.desc.n_layers, self.costs[i]
        act = c.activation_bytes(
            self.config.engine.scheduler.max_num_batched_tokens,
            self.config.engine.scheduler.max_num_seqs,
            last,
        )
        return c.weights_bytes(a, b, a == 0, last) + act + self.offload_scratch(i, b)

    def offload_scratch(self, i: int, b: int) -> float:
        """GPU bytes device i needs, in one process, for prompt steps that run the CPU's layers
        [b, n) there (execution/offload.py): the ring of staging buffers their streamed items
        need (row slabs of a part, or whole parts, of a joined matrix's run of one GGUF type in
        the CPU's packing), and the most any part needs beside it at a step of the token budget
        (dequantized rows, outputs). 0 where nothing streams to it."""
        cfg, n = self.config, self.desc.n_layers
        if not (cfg.in_process and cfg.offload_min_tokens) or b >= n:
            return 0.0
        if self.costs[i].dev.is_cpu:
            return 0.0
        slot, work = self._streamed_scratch[b]
        return ring_slots(slot) * slot + work

    @cached_property
    def _streamed_scratch(self) -> list[tuple[float, float]]:
        """For each first CPU layer b: the largest staged item and the most working bytes of
        the streamed parts of the layers [b, n) (zeros: no CPU in qdot mode, or no layer),
        suffix maxima."""
        cpu = next((c for c in self.costs if c.dev.is_cpu), None)
        n = self.desc.n_layers
        out = [(0.0, 0.0)] * (n + 1)
        if cpu is None or cpu.weights != "qdot":
            return out
        tokens = self.config.engine.scheduler.max_num_batched_tokens
        for b in range(n - 1, -1, -1):
            parts = cpu.joined_parts(b)
            slot = max([out[b + 1][0], *(item_bytes(t, nb, p, r) for nb, p, r, t in parts)])
            work = max([out[b + 1][1], *(work_bytes(t, nb, p, r, tokens) for nb, p, r, t in parts)])
            out[b] = (slot, work)
        return out

    def fits(self, i: int, a: int, b: int) -> bool:
        return self.base_bytes(i, a, b) + self.kv_need(i, a, b) <= self.budgets[i]

    def _decode_prefix(self, i: int, m: int, replay: bool) -> list[float]:
        """Running sums of device i's decode layer times at m sequences (cached)."""
        if (i, m, replay) not in self._prefix:
            out = [0.0]
            for t in self.costs[i].decode_layer_seconds(m, self.ctx, replay):
                out.append(out[-1] + t)
            self._prefix[i, m, replay] = out
        return self._prefix[i, m, replay]

    @cached_property
    def contention(self) -> list[float]:
        """How much slower each device streams its weights while the stages on the other shares
        of its GPU stream theirs: MPS shares split the SMs but not the memory. Alone each draws
        a fraction of the card's bandwidth (measured shares: `bw_fraction`; derived ones: the
        sqrt(share) law of shares.py), together they draw it once: the factor is the sum of
        the fractions, at least 1. (H200, 70% + 30% shares: 1.19 measured, 1.385 by the law;
        with derived profiles the 30% stage took 7.30 ms a step at 16 streams, 1.44x its
        alone-priced 5.08 ms, part of which was the law's overrating of that share.) 1 for a
        whole device. (Not base_device: "#2" devices, a device listed twice, had their rates
        divided already; two cards of one spec share nothing.)"""

        bases = [parse_share(d).base if is_share(d) else d for d in (c.dev.id for c in self.costs)]
        fractions = [c.dev.bw_fraction or bandwidth_fraction(c.dev.sm_share) for c in self.costs]
        return [max(1.0, sum(f for b, f in zip(bases, fractions) if b == mine)) for mine in bases]

    def stage_s(self, i: int, a: int, b: int, m: int, overlap: bool | None = None) -> float:
        """Device i's decode step over layers [a, b) at m sequences, its hand-off included.
        `overlap` (default: whether m sequences are one of several micro-batches in flight):
        the other stages run at the same time, so shares of one GPU contend (`contention`)."""
        c, n = self.costs[i], self.desc.n_layers
        # Pipeline stages replay decode CUDA graphs of their layers as the one-process engine
        # does (its stage worker), unless --enforce-eager (DeviceCost.graphs).
        prefix = self._decode_prefix(i, m, True)
        work = prefix[b] - prefix[a] + (c.head_seconds(m) if b == n else 0.0)
        if overlap is None:
            overlap = m < self.config.concurrency
        if overlap:
            work *= self.contention[i]
        t = c.step_seconds(b - a, work, c.eager(m, True), seqs=m) + self.hop_s(i, a, b)
        if b < n and i + 1 < len(self.costs):
            t += transfer_seconds(c.dev, self.costs[i + 1].dev, m, self.desc.config.d_model)
        return t

    def hop_s(self, i: int, a: int, b: int) -> float:
        """Stage i's hand-off between stage processes (none in one process)."""
        if self.config.in_process:
            return 0.0
        return hop_seconds(self.costs[i].dev, a, b, self.desc.n_layers)

    def offload_to(self, i: int, n: int) -> int | None:
        """The GPU stage that runs CPU stage i's matmuls in a prompt step of n tokens (in one
        process, from offload_min_tokens on: execution/offload.py), or None."""
        cfg = self.config
        if not (cfg.in_process and cfg.offload_min_tokens and n >= cfg.offload_min_tokens):
            return None
        if not self.costs[i].dev.is_cpu:
            return None
        return next((j for j, c in enumerate(self.costs) if not c.dev.is_cpu), None)

    def offloaded_layer_s(self, i: int, j: int, layer: int, n: int, cached: int, rows: int):
        """CPU layer `layer`'s prompt step with its matmuls on GPU j (offloaded_parts' sum)."""
        return sum(self.offloaded_parts(i, j, layer, n, cached, rows).values())

    def offloaded_parts(
        self, i: int, j: int, layer: int, n: int, cached: int, rows: int
    ) -> dict[str, float]:
        """Seconds of CPU layer `layer`'s prompt step with its matmuls on GPU j, by part: the
        attention on the CPU; each linear's input over and its output back in bf16 through
        pinned buffers, the CPU rounding them from float32 and widening them back (6 bytes a
        value); the GPU's products; the GPU profile's calibrated overhead of such a layer (its
        small ops, launches and waits); and the layer's weights over PCIe beyond all that (they
        are copied ahead through the staging ring while the rest runs)."""
        cpu, gpu = self.costs[i], self.costs[j]
        attn = cpu.prefill_layer_seconds(n, cached, rows)[layer] - cpu._layer_matmuls(layer, n)
        h2d = gpu.dev.h2d_gbs or gpu.dev.link_gbs(cpu.dev)
        d2h = gpu.dev.d2h_gbs or h2d
        stream = cpu.weights_bytes(layer, layer + 1, False, False) / (h2d * 1e9)
        sent, back = crossing(self.desc.layers[layer])
        parts = {
            "attention": attn,
            "activations": 2 * n * (sent / (h2d * 1e9) + back / (d2h * 1e9)),
            "conversions": 6 * n * (sent + back) / (cpu.dev.mem_bw_gbs * 1e9),
            "products": self._streamed_products(gpu, layer, n),
            "overhead": gpu.dev.offload_layer_overhead_s,
        }
        parts["weights beyond"] = max(0.0, stream - sum(parts.values()))
        return parts

    def _streamed_products(self, gpu: DeviceCost, layer: int, n: int) -> float:
        """The GPU's products of a streamed CPU layer at n tokens: a type the rows kernel reads
        is dequantized to bf16 (written once at the copy rate) and multiplied at the dense
        rate; another at the quantized kernels' rate, as the general way runs it."""
        total = 0.0
        for t in self.desc.layers[layer]:
            if not t.is_matrix:
                continue
            if rows_kernel_reads(t.ggml_type):
                dense = gpu.dev.matmul_rate("dense", t.ggml_type)
                total += dense.seconds(2.0 * t.params, t.params, n)
                total += 2.0 * t.params / (gpu.dev.mem_bw_gbs * 1e9)
            else:
                total += gpu.linear_seconds(t, n, layer)
        return total

    def _replays_prompt(self, i: int, n: int, cached: int, seqs: int) -> bool:
        """Whether a step of n prompt tokens (of `seqs` prompts, after `cached` tokens each)
        replays a CUDA graph on device i (cuda_graph.DecodeGraphs.fits)."""
        c, cfg = self.costs[i], self.desc.config
        if not c.graphs or c.dev.is_cpu or n > self.config.engine.cuda_graph_max_tokens:
            return False
        if c.ram_experts and streams_experts(
            n, cfg.n_experts, cfg.n_experts_used, c.stream_experts_from
        ):  # the graphs stop below the first step that streams the RAM experts (local.py)
            return False
        tile = (
            ROW_TILE if n > self.config.engine.scheduler.max_num_seqs else 1
        )  # a bucket past the decode rows
        return seqs * chunk_row_context(n / seqs, cached, tile) <= PROMPT_ROW_CONTEXT

    def prefill_s(self, i: int, a: int, b: int, tokens: int) -> float:
        """Stage i's time for one prompt of `tokens` tokens, in budget-sized chunks."""
        chunks = prompt_chunks(1, tokens, self.config.engine.scheduler.max_num_batched_tokens)
        return sum(self.chunk_s(i, a, b, n, cached, 1) for n, cached, _, _ in chunks)

    def chunk_s(
        self, i: int, a: int, b: int, n: int, cached: int, rows: int, overlap: bool = False
    ) -> float:
        """Stage i's step over layers [a, b) of n prompt tokens of `rows` prompts after `cached`
        tokens (each), its hand-off included; `overlap`: other stages run meanwhile (as in
        stage_s: shares of one GPU contend)."""
        c, last = self.costs[i], b == self.desc.n_layers
        gpu = self.offload_to(i, n)
        if gpu is None:
            work = sum(c.prefill_layer_seconds(n, cached, rows)[a:b])
        else:
            work = sum(
                self.offloaded_layer_s(i, gpu, layer, n, cached, rows) for layer in range(a, b)
            )
        work += c.head_seconds(rows) if last else 0.0
        if overlap:
            work *= self.contention[i]
        replay = self._replays_prompt(i, n, cached, rows)  # as a decode step's replay
        if replay:
            work += (b - a) * c.replay_layer_seconds(n)
        t = c.step_seconds(b - a, work, not replay, seqs=rows)
        t += self.hop_s(i, a, b)
        if not last and i + 1 < len(self.costs):
            t += transfer_seconds(c.dev, self.costs[i + 1].dev, n, self.desc.config.d_model)
        return t

    def burst_ttft_s(self, used: list[tuple[int, int, int]], micro: int) -> float:
        """Mean time to first token of `concurrency` prompts arriving together (burst.py).
        With several groups the stages work at once, and shares of one GPU contend."""
        cfg = self.config

        def chunk(k: int, n: int, cached: int, rows: int) -> float:
            i, a, b = used[k]
            return self.chunk_s(i, a, b, n, cached, rows, overlap=micro > 1)

        firsts = burst_first_tokens(
            len(used),
            micro,
            cfg.concurrency,
            cfg.prompt_len,
            cfg.engine.scheduler.max_num_batched_tokens,
            chunk,
        )
        return sum(firsts) / len(firsts)
