"""The model runner: one scheduler step -> one forward pass over all scheduled tokens.

Tokens of all scheduled requests go back to back into one [T] batch (decodes and prefill chunks
mixed); the paged attention backend knows where each request's queries start and which slots
hold its context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero.engine.scheduler import ScheduledRequest, SchedulerOutput
from hetero.execution.kv_pool import KVPool
from hetero.execution.paged_meta import TensorMeta, tensor_meta
from hetero.kernels import select
from hetero.kernels.cpu_native import flat_meta, paged_attention_native
from hetero.kernels.xquant import QuantizedRows
from hetero.model.forward_batch import ForwardBatch
from hetero.model.llama import LlamaModel


@dataclass
class PagedMeta:
    q_starts: list[int]  # first row of each sequence's queries in the [T] batch
    q_lens: list[int]
    ctx_slots: list[torch.Tensor]  # [ctx_len] slots of positions 0 .. ctx_len - 1, per sequence
    decode_slots: torch.Tensor | None = None  # [B, Lmax] when every sequence has one query
    decode_mask: torch.Tensor | None = None  # [B, Lmax] True where a slot is real
    tensors: TensorMeta | None = None  # block tables etc. for the Triton kernels (paged_meta.py)
    native_flat: tuple | None = None  # the C attention's arrays, made at the first layer


class PagedAttention:
    """The ForwardBatch attention backend of one step: write the new KV, attend over pages.

    slots [T] (the new tokens' slots) and meta: one of each, or a list of each with one per KV
    cache group of the pool (engine/kv_groups.py; None for a group without layers here): a
    layer writes and reads through its group's block tables."""

    def __init__(self, pool: KVPool, first_layer: int, slots, meta, scale: float):
        self.pool, self.first, self.scale = pool, first_layer, scale
        self.slots = slots if isinstance(slots, list) else [slots]
        self.meta = meta if isinstance(meta, list) else [meta]
        self._group = pool.layout.groups if len(self.meta) > 1 else None
        self._attend = select("paged_attention", pool.k.device).fn
        self._native: bool | None = None  # whether native_layer() serves (known at first ask)
        fused = select("rope_kv_write", pool.k.device)
        self._rope_write = None if fused.is_reference else fused.fn
        fused = select("rope_attention", pool.k.device)
        self._rope_attention = None if fused.is_reference else fused.fn

    def native_layer(self, layer: int):
        """(k_cache, v_cache, new slots, the C attention's arrays, scale) of `layer`, for a kernel
        that writes the step's KV and attends itself (kernels/cpu_block.py) as this backend
        would, or None where this backend goes another way (fp8 caches, not the native
        attention)."""
        if self._native is None:
            self._native = self._attend is paged_attention_native and self.pool.k_scale is None
        if not self._native:
            return None
        i = layer - self.first
        g = 0 if self._group is None else self._group[i]
        meta, slots = self.meta[g], self.slots[g]
        if slots.dtype != torch.int64 or not len(meta.ctx_slots) == len(meta.q_starts) > 0:
            return None
        k_cache, v_cache, _, _ = self.pool.layer(i)
        return k_cache, v_cache, slots.contiguous(), flat_meta(meta), self.scale

    def rope_attend(self, layer: int, q, k, v, cos, sin, style: str, quant=None):
        """Rotate q and k (the "rope" op's contract), store k and v, attend, in as few launches
        as the kernels allow: a decode step's all in the attention's one (`rope_attention`),
        another step's rotation and KV write in one (`rope_kv_write`), then its attention; None
        where no kernel fuses them (the caller rotates and calls the backend as usual). quant
        (an xquant.XLayout): the output [T, H * D] as QuantizedRows in that layout where the
        decode launch quantizes it too, else the plain output."""
        i = layer - self.first
        g = 0 if self._group is None else self._group[i]
        caches, slots, meta = self.pool.layer(i), self.slots[g], self.meta[g]
        if self._rope_attention is not None:
            done = self._rope_attention(
                q, k, v, cos, sin, style, *caches, slots, meta, self.scale, quant
            )  # fmt: skip
            if done is not None:
                out, words, floats = done
                return out if words is None else QuantizedRows(words, floats, quant, out.dtype)
        if self._rope_write is None:
            return None
        q = self._rope_write(q, k, v, cos, sin, style, *caches, slots)
        return self._attend(q, *caches, meta, self.scale)

    def __call__(self, layer: int, q, k, v, window: int = 0, sinks=None) -> torch.Tensor:
        i = layer - self.first
        g = 0 if self._group is None else self._group[i]
        self.pool.write(i, self.slots[g], k, v)
        if window or sinks is not None:  # gpt-oss: kernels/paged_sinks.py
            attend = select("paged_attention_sinks", self.pool.k.device).fn
            return attend(q, *self.pool.layer(i), self.meta[g], self.scale, window, sinks)
        return self._attend(q, *self.pool.layer(i), self.meta[g], self.scale)


def _context_slots(table: list[int], ctx_len: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(table[: -(-ctx_len // block_size)], dtype=torch.long)
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx_len]


def build_meta(
    scheduled: list[ScheduledRequest], block_size: int, tensors: bool = True, group: int = 0
) -> tuple[torch.Tensor, PagedMeta]:
    """Slots of the new tokens [T] and the per-sequence attention metadata (with `tensors`, the
    block-table form the Triton kernels read, too), through KV cache group `group`'s tables.
    A window group's context slots reach its null block where its blocks were released: zeros
    that the window masks out."""
    meta = PagedMeta([], [], [])
    new_slots, row = [], 0
    for s in scheduled:
        table = s.req.block_tables[group]
        ctx = _context_slots(table, s.start_pos + s.num_new_tokens, block_size)
        meta.q_starts.append(row)
        meta.q_lens.append(s.num_new_tokens)
        meta.ctx_slots.append(ctx)
        new_slots.append(ctx[s.start_pos :])
        row += s.num_new_tokens
    if scheduled and all(n == 1 for n in meta.q_lens):
        lmax = max(c.shape[0] for c in meta.ctx_slots)
        slots = torch.zeros(len(scheduled), lmax, dtype=torch.long)
        mask = torch.zeros(len(scheduled), lmax, dtype=torch.bool)
        for b, c in enumerate(meta.ctx_slots):
            slots[b] = c[0]  # padding reads a written slot: masked out, but never NaN bytes
            slots[b, : c.shape[0]] = c
            mask[b, : c.shape[0]] = True
        meta.decode_slots, meta.decode_mask = slots, mask
    if tensors:
        ctx_lens = [s.start_pos + s.num_new_tokens for s in scheduled]
        tables = [s.req.block_tables[group] for s in scheduled]
        meta.tensors = tensor_meta(tables, ctx_lens, meta.q_lens, block_size)
    return torch.cat(new_slots), meta


def resolve_placeholders(tokens: torch.Tensor, source: torch.Tensor | None) -> torch.Tensor:
    """tokens [T] int64 with each placeholder -1 - i (an overlapped step's token not yet on the
    host: engine/overlap.py) replaced, in place, by source[i], the samples on the device."""
    if source is None or not len(source):  # (a step of middle prompt chunks samples nothing)
        return tokens
    # (to a GPU asynchronously; to the CPU a blocking copy: an asynchronous one from a GPU
    # would hand back memory the copy has yet to fill)
    source = source.to(tokens.device, non_blocking=tokens.device.type == "cuda")
    idx = (-1 - tokens).clamp_(min=0)  # a real token's reads row 0, and is kept
    return tokens.copy_(torch.where(tokens < 0, source[idx], tokens))


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool):
        self.model, self.pool = model, pool
        self.device = torch.device(model.runtime.device)
        self.scale = model.config.head_dim**-0.5
        self.graphs = None  # DecodeGraphs (cuda_graph.py): replays decode-only steps
        self.replayed = False  # whether the last step ran through the graphs' buffers
        # only the Triton attention reads the block-table tensors: skip building them elsewhere
        self.tensor_meta = select("paged_attention", self.device).name == "triton"

    def run(
        self, out: SchedulerOutput, hidden: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[ScheduledRequest]]:
        """Logits [N, V] float32 for the scheduled requests whose step produces a token: one
        row each, or 1 + len(spec_ids) rows (the last token's, then each guess's) when it
        speculates; `producing` lists those requests in row order.

        A pipeline stage after the first passes the previous stage's hidden states [T, C]; a
        stage before the last gets its own hidden states [T, C] back instead of logits.
        """
        self.pool.copy_blocks(out.copies)
        self.replayed = self.graphs is not None and self.graphs.fits(out)
        if self.replayed:
            producing = [s for s in out.scheduled if s.produces_token]
            return self.graphs.run(out.scheduled, hidden, out.token_source), producing
        sched = out.scheduled
        tokens, positions, last_rows, producing = [], [], [], []
        row = 0
        for s in sched:
            known = s.num_new_tokens - len(s.spec_ids)
            tokens.extend(s.req.tokens(s.start_pos, s.start_pos + known))
            tokens.extend(s.spec_ids)
            positions.extend(range(s.start_pos, s.start_pos + s.num_new_tokens))
            row += s.num_new_tokens
            if s.produces_token:
                last_rows.extend(range(row - 1 - len(s.spec_ids), row))
                producing.append(s)
        slots, metas = self._metas(sched)
        attn = PagedAttention(self.pool, self.model.layer_range.start, slots, metas, self.scale)
        dev = self.device
        batch = ForwardBatch(
            torch.tensor(positions, device=dev),
            torch.tensor(last_rows, dtype=torch.long, device=dev),
            attn,
        )
        ids = torch.tensor(tokens, device=dev)
        if hidden is None:
            ids = resolve_placeholders(ids, out.token_source)
        logits = self.model(ids, batch, hidden)
        return logits, producing

    def _metas(self, sched: list[ScheduledRequest]) -> tuple[list, list]:
        """The new tokens' slots and the attention metadata of each KV cache group with layers
        in this pool, on the device (None for the others)."""
        dev, layout = self.device, self.pool.layout
        slots, metas = [], []
        for g in range(layout.n_groups):
            if g not in layout.groups:
                slots.append(None)
                metas.append(None)
                continue
            sl, meta = build_meta(sched, self.pool.block_size, self.tensor_meta, g)
            meta.ctx_slots = [c.to(dev) for c in meta.ctx_slots]
            if meta.decode_slots is not None:
                meta.decode_slots = meta.decode_slots.to(dev)
                meta.decode_mask = meta.decode_mask.to(dev)
            if meta.tensors is not None:
                meta.tensors = meta.tensors.to(dev)
            slots.append(sl.to(dev))
            metas.append(meta)
        return slots, metas
