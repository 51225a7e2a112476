"""CUDA graphs for decode steps (and short prompt chunks): captured once per batch size at
start, replayed per step.

A decode step of a small batch launches a few hundred kernels whose work is microseconds each;
the host, not the GPU, would bound it. Captured, the step is one graph launch.

A graph replays fixed shapes from fixed addresses, so the step's inputs live in static buffers
sized for the largest captured batch:

    tokens, positions [Bmax] int64; seq_lens [Bmax] int32; q_start_loc [Bmax + 1] int32 (0, 1,
    2, ...: one query a sequence); and for each KV cache group with layers in the pool
    (engine/kv_groups.py: its own tables) slots [Bmax] int64, block_tables [Bmax, max_blocks] int32

All but q_start_loc are views of one device arena (graph_inputs.py): a step writes its values
into a pinned host mirror of it with plain Python and numpy, and one copy moves them.

A step of n rows runs the graph of the smallest bucket b >= n (1, 2, 4, 8, ... up to the
largest captured); rows n .. b - 1 are padding: slot -1 (the KV write skips it) and seq_len 0
(attention gives 0), their logits dropped. Steps with more rows than the largest bucket, a
context past max_blocks or prompt rows past PROMPT_ROW_CONTEXT (below) run eagerly.

A speculative verify step (engine/spec/) fits too: a decode with guesses g_1 .. g_k at position p
is k + 1 rows, each a one-query decode of the same sequence:

    row i (0 <= i <= k)   token t_i (t_0 the last known token, then the guesses)
                          position p + i, slot of p + i, the request's block table,
                          seq_len p + i + 1

Each layer writes the KV of all rows (kv_write, one launch) before any row attends (the attention
launch after it), so row i attends over the prefix and t_0 .. t_i: exactly the causal attention
the eager step's prefill kernel gives the k + 1 queries. Its logits rows come back in that order,
what spec/verify.py reads. A decode step's rows are distinct sequences, and there the attention's
launch rotates and stores each row's own key itself (`rope_attention`); it must not where rows
share a sequence (one launch's programs are unordered: a row would read a key not yet stored), so
each bucket that both kinds of step reach has two graphs, one per kind (the metadata's `shared`).

Prompt chunks fit the same way (max_rows > max_batch adds larger buckets for them): a chunk of
m prompt tokens at positions p .. p + m - 1 is m one-query rows with seq_len p + i + 1, so a step
that admits a few short prompts beside running decodes (or one prompt of up to max_rows tokens)
replays a graph instead of paying an eager step's host launches (~0.5 ms a layer on the H200: a
mixed step cost ten decode steps). In the buckets past max_batch (those only prompt rows reach)
the rows of a chunk attend in tiles of row_tile rows (paged_meta.RowTiles: decode_lens and
tile_lens [Bmax], two more static buffers), each tile reading its keys once, as the eager prefill
kernel reads them for a tile of queries; elsewhere each row reads its whole context. A step fits
only while its prompt rows read at most PROMPT_ROW_CONTEXT row-positions in all (a 512-token
prompt alone: 5k in tiles, 131k row by row); longer contexts (a chunk after a long cached
prefix) run eagerly, where their device work outweighs the launches anyway.
Only the rows that produce a token reach the output projection: their indices go in one more
static buffer, logit_rows [L] (L = min(bucket, max_batch), padding rows pointing at row 0).

A pipeline stage after the first starts from the previous stage's hidden states, so it has one
more static buffer, hidden [Bmax, C]; a stage before the last returns its hidden states [n, C]
instead of logits (the model's layer range decides both). Sending and receiving them stay
outside the graph.

Without capture (a CPU, or graphs turned off) `run` takes the same static-buffer path eagerly:
that is how the padding and bucketing are tested on a machine without CUDA.
"""

from __future__ import annotations

import logging
import math

import torch

from hetero.engine.scheduler import ScheduledRequest, SchedulerOutput
from hetero.execution.graph_inputs import GraphInputs
from hetero.execution.graph_inputs import is_decode as _is_decode
from hetero.execution.kv_pool import KVPool
from hetero.execution.paged_meta import (
    ROW_TILE,
    RowTiles,
    TensorMeta,
    decode_slots_from_tables,
)
from hetero.execution.runner import PagedAttention, PagedMeta, resolve_placeholders
from hetero.kernels import host_hop, select
from hetero.kernels.registry import chosen as chosen_kernels
from hetero.model.forward_batch import ForwardBatch
from hetero.model.llama import LlamaModel

log = logging.getLogger(__name__)

MAX_SPEC_ROWS = 64  # graph rows speculation may add beyond max_num_seqs (graph_rows)
PROMPT_ROW_CONTEXT = 1 << 18  # row-positions a step's prompt rows may read in a graph (fits)


def batch_buckets(max_batch: int, max_rows: int = 0) -> list[int]:
    """Powers of two up to max_batch, and max_batch itself: [1, 2, 4, ..., max_batch]; then, for
    steps with prompt rows, the powers of two past it up to max_rows, and max_rows itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    top = max(max_batch, max_rows)
    return sorted({*(1 << i for i in range(top.bit_length()) if 1 << i < top), max_batch, top})


def graph_rows(max_num_seqs: int, max_num_batched_tokens: int, spec_tokens: int = 0) -> int:
    """Rows of the largest graph: one per sequence; with speculation (spec_tokens guesses at most
    a request), room for a few requests' guesses too where max_num_seqs alone leaves little,
    within the step's token budget and at most MAX_SPEC_ROWS (graphs cost capture time and
    memory; the scheduler's default of 256 sequences already leaves 256 rows)."""
    rows = max_num_seqs
    if spec_tokens:
        rows = max(rows, min(max_num_seqs * (1 + spec_tokens), MAX_SPEC_ROWS))
    return min(rows, max(max_num_batched_tokens, max_num_seqs))


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds n sequences (None: more than the largest)."""
    return next((b for b in buckets if b >= n), None)


def chunk_row_context(m: float, p: float, tile: int = 1) -> float:
    """Row-positions a chunk of m prompt tokens after p cached ones reads as one-query rows:
    p + 1, p + 2, ... p + m (the planner asks with average chunk sizes). With its rows in tiles
    of `tile` (paged_meta.RowTiles), each tile reads up to its last row's context once, and the
    chunk's first tile - 1 rows read their own (the most that can share a tile with other rows:
    the chunk starting one row past a tile's start)."""
    if tile <= 1:
        return m * p + m * (m + 1) / 2
    lead = min(m, tile - 1)
    n = math.ceil((m - lead) / tile)  # tiles; the last one ends at the chunk's last row
    tiles = n * p + (n - 1) * lead + tile * n * (n - 1) / 2 + m if n else 0
    return chunk_row_context(lead, p) + tiles


def prompt_row_context(sched: list[ScheduledRequest], tile: int = 1) -> float:
    """Row-positions the prompt rows of a step read as one-query rows (in tiles of `tile`)."""
    return sum(
        chunk_row_context(s.num_new_tokens, s.start_pos, tile) for s in sched if not _is_decode(s)
    )


def _check_kernels(device: torch.device) -> bool:
    """Whether attention is the reference (which reads per-position slots, derived here from the
    tables). Other kernels must read the tensor metadata and skip slot -1 (the Triton ones do);
    a kernel that reads the host lists would see none and attend to nothing."""
    for op in ("paged_attention", "kv_write"):
        impl = select(op, device)
        if not (impl.is_reference or impl.name == "triton"):
            raise ValueError(
                f"{op} kernel {impl.name!r} reads host lists: the static decode buffers need "
                "the Triton kernels or the references"
            )
    return select("paged_attention", device).is_reference


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        pool: KVPool,
        max_batch: int,
        max_model_len: int,
        max_rows: int = 0,
        row_tile: int = ROW_TILE,
    ):
        """max_batch: the most rows that produce a token (sequences, plus guesses); max_rows:
        the most rows of a step with prompt chunks (0: decode steps only); row_tile: rows of a
        prompt chunk that attend together in the buckets past max_batch (paged_meta.RowTiles)."""
        self.model, self.pool = model, pool
        self.device = pool.k.device
        self.max_batch = max_batch
        self.buckets = batch_buckets(max_batch, max_rows)
        self.block_size = pool.block_size
        self.max_blocks = -(-max_model_len // pool.block_size)
        bmax, dev = self.buckets[-1], self.device
        # per KV cache group (None: no layer of the group here)
        here = set(pool.layout.groups)
        self.groups = [g for g in range(pool.layout.n_groups) if g in here]
        self.row_tile = row_tile
        # the static buffers: views of one device arena, filled from a host mirror in one copy
        self.inputs = GraphInputs(
            bmax, max_batch, self.max_blocks, self.groups, pool.layout.n_groups, self.block_size,
            dev,
        )  # fmt: skip
        ins = self.inputs
        self.tokens, self.positions, self.seq_lens = ins.tokens, ins.positions, ins.seq_lens
        self.slots, self.block_tables = ins.slots, ins.block_tables
        self.decode_lens, self.tile_lens = ins.decode_lens, ins.tile_lens  # RowTiles
        self.logit_rows = ins.logit_rows
        self.q_start_loc = torch.arange(bmax + 1, dtype=torch.int32, device=dev)
        self.hidden = None  # [Bmax, C]: the previous stage's activations (a later stage only)
        if not model.is_first:
            dtype = model.runtime.torch_dtype()
            self.hidden = torch.zeros(bmax, model.config.d_model, dtype=dtype, device=dev)
        self.scale = model.config.head_dim**-0.5
        # per (bucket, whether rows may share a sequence): the second kind only in the buckets
        # where it changes the launches (the attention stores keys itself: `_kinds`)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        # the host functions each graph calls (layers with their experts in RAM: their
        # arguments, kept while the graph may replay them), and an event whose wait sleeps
        # rather than spins: a replay that computes on the CPU leaves the cores to it
        self.host_calls: dict[tuple[int, bool], list] = {}
        self._done = torch.cuda.Event(blocking=True) if self.device.type == "cuda" else None
        self._ref_attention = _check_kernels(self.device)
        # whether a decode step's attention launch stores the rows' keys itself (_kinds)
        self.attention_stores_keys = not select("rope_attention", self.device).is_reference
        self.steps = 0  # steps run through the static buffers (replayed or not)
        self.rows_run = 0  # their rows (sequences, guesses, prompt tokens)
        self.prompt_steps = 0  # those of them with prompt rows
        self.tiled_rows = 0  # prompt rows that attended in row tiles
        self.shared_steps = 0  # steps through a graph of rows that share a sequence (_kinds)

    def fits(self, out: SchedulerOutput) -> bool:
        """A step these buffers hold: decodes (each one known token, plus its guesses) and prompt
        chunks, within the largest bucket, the logits rows, the block table and the prompt rows'
        context budget."""
        sched, cap = out.scheduled, self.max_blocks * self.block_size
        n = sum(s.num_new_tokens for s in sched)
        if not 0 < n <= self.buckets[-1]:
            return False
        if any(s.start_pos + s.num_new_tokens > cap for s in sched):
            return False
        producing = sum(1 + len(s.spec_ids) for s in sched if s.produces_token)
        b = bucket_for(n, self.buckets)
        return producing <= self._logit_count(b) and (
            prompt_row_context(sched, self._tile(b)) <= PROMPT_ROW_CONTEXT
        )

    def _tile(self, b: int) -> int:
        """Rows a prompt chunk attends in together in bucket b (1: each row alone)."""
        return self.row_tile if b > self.max_batch else 1

    def _logit_count(self, b: int) -> int:
        """Rows of a bucket that reach the output projection (padding included)."""
        return min(b, self.max_batch)

    def run(
        self,
        sched: list[ScheduledRequest],
        hidden: torch.Tensor | None = None,
        token_source: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [N, V] float32 of the rows that produce a token (one a decoding sequence or a
        finished prompt, 1 + k for one that speculates k tokens), in the order of `sched`; a
        pipeline stage before the last gets its hidden states [n, C] of all n rows instead, and
        a later stage passes the previous one's `hidden`. `token_source`: what the tokens'
        placeholders index (runner.resolve_placeholders), an overlapped step's samples."""
        n = sum(s.num_new_tokens for s in sched)
        b = bucket_for(n, self.buckets)
        produced = self._fill(sched, b)
        if hidden is None and token_source is not None:
            resolve_placeholders(self.inputs.tokens[:n], token_source)
        if (hidden is None) != (self.hidden is None):
            raise ValueError("a pipeline stage after the first (only) takes hidden states")
        if hidden is not None:  # rows n .. b - 1 keep stale finite values: padding, dropped
            self.hidden[:n].copy_(hidden)
        self.steps += 1
        self.rows_run += n
        self.prompt_steps += not all(_is_decode(s) for s in sched)
        keep = produced if self.model.is_last else n
        key = (b, self._shared(b, sched))
        self.shared_steps += key[1]
        if key in self.graphs:
            self.graphs[key].replay()
            out = self.outputs[key][:keep].clone()  # the graph's buffer is rewritten next replay
            calls = self.host_calls.get(key)
            if calls:
                self._done.record()
                self._done.synchronize()
                host_hop.check(calls)
            return out
        return self._forward(*key)[:keep]

    def _kinds(self, b: int) -> tuple[bool, ...]:
        """The graphs bucket b needs: rows of distinct sequences (False), and rows that may share
        one (True) where that changes the launches: 2 rows or more, not in row tiles (whose
        attention never stores keys), with an attention launch that would store them."""
        both = self.attention_stores_keys and 1 < b and self._tile(b) == 1
        return (False, True) if both else (False,)

    def _shared(self, b: int, sched: list[ScheduledRequest]) -> bool:
        """Whether the step's graph is bucket b's of rows that share a sequence."""
        return len(self._kinds(b)) > 1 and any(s.num_new_tokens > 1 for s in sched)

    def _fill(self, sched: list[ScheduledRequest], b: int) -> int:
        """Host values of the step into the static buffers, rows n .. b - 1 as padding; returns
        how many rows produce a token (their indices lead logit_rows)."""
        produced, tiled = self.inputs.fill(sched, b, self._tile(b))
        self.tiled_rows += tiled
        return produced

    def _forward(self, b: int, shared: bool = False) -> torch.Tensor:
        """The model over the first b rows of the static buffers: [b, V] float32. shared: rows
        may be one sequence's (`_kinds`)."""
        metas = [None if g is None else self._meta(b, g, shared) for g in self.block_tables]
        slots = [None if t is None else t[:b] for t in self.slots]
        first = self.model.layer_range.start
        attn = PagedAttention(self.pool, first, slots, metas, self.scale)
        # a bucket of one row: its logit row is row 0, a view (no gathers of x and the delta)
        rows = slice(0, 1) if b == 1 else self.logit_rows[: self._logit_count(b)]
        batch = ForwardBatch(self.positions[:b], rows, attn)
        hidden = None if self.hidden is None else self.hidden[:b]
        return self.model(self.tokens[:b], batch, hidden)

    def _meta(self, b: int, tables: torch.Tensor, shared: bool = False) -> PagedMeta:
        """The attention metadata of b rows over one KV cache group's tables [Bmax, blocks]."""
        bs = self.block_size
        meta = PagedMeta(list(range(b)), [1] * b, [])
        meta.tensors = TensorMeta(
            tables[:b], self.seq_lens[:b], self.q_start_loc[: b + 1], 1, self.max_blocks * bs, bs,
            shared=shared,
        )  # fmt: skip
        if self._tile(b) > 1:  # a bucket for prompt rows: their chunks attend as tiles
            meta.tensors.tiles = RowTiles(self.decode_lens[:b], self.tile_lens[:b], self.row_tile)
        if self._ref_attention:  # the reference reads per-position slots; padding rows mask out
            lens = self.seq_lens[:b]
            meta.decode_slots, meta.decode_mask = decode_slots_from_tables(tables[:b], lens, bs)
        return meta

    def capture(self) -> DecodeGraphs:
        """Record one graph per bucket, largest first (the smaller ones reuse its memory pool).
        Each is run once eagerly first: Triton compiles, lazily made buffers exist outside."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        for t in self.slots:
            if t is not None:
                t.fill_(-1)
        self.seq_lens.zero_()
        mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        keys = [(b, shared) for b in reversed(self.buckets) for shared in self._kinds(b)]
        with torch.cuda.stream(side):
            for key in keys:
                self._forward(*key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        for key in keys:
            graph = torch.cuda.CUDAGraph()
            # the capture stream must be on this device: torch's default one is made once, on
            # whichever device was current first, and would capture nothing of this one's work
            with host_hop.recording() as calls, torch.cuda.graph(graph, pool=mempool, stream=side):
                self.outputs[key] = self._forward(*key)
            self.graphs[key], self.host_calls[key] = graph, calls
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)
        return self


def capture_decode_graphs(
    model: LlamaModel, pool: KVPool, max_batch: int, max_model_len: int, max_rows: int = 0
) -> DecodeGraphs | None:
    """Graphs for the scheduler's batch sizes (and steps with prompt rows up to max_rows), or
    None (logged) where capture fails: the engine then runs every step eagerly, as with
    --enforce-eager."""
    log.info("kernels on %s: %s", pool.k.device, chosen_kernels(pool.k.device))
    try:
        return DecodeGraphs(model, pool, max_batch, max_model_len, max_rows).capture()
    except (RuntimeError, ValueError) as e:
        log.warning("CUDA graph capture failed, decode runs eagerly: %s", e)
        return None
