"""A segment: a contiguous range of layers on one device of this process.

The local executor runs one segment per device it uses, in layer order, inside one process: the
whole model on one GPU is one segment; a model bigger than the card is a GPU segment (the first
layers, the embedding) followed by a CPU segment (the last layers, the norm and lm_head), as
llama.cpp's `-ngl` places it. Hidden states pass from one segment to the next as a tensor copy,
with no process, pipe or collective between them.

Each segment holds its layers, a KV pool for them on its device and the ModelRunner over both
(with CUDA graphs of decode steps on a GPU). All pools have the same number of blocks: one block
table per request (per KV cache group: engine/kv_groups.py) indexes every segment's pool.
"""

from __future__ import annotations

import torch

from hetero.config import bind_device
from hetero.engine.config import EngineConfig
from hetero.engine.kv_groups import KVGroups
from hetero.execution.cuda_graph import capture_decode_graphs, graph_rows
from hetero.execution.kv_pool import (
    KVPool,
    PoolLayout,
    PoolSize,
    block_bytes,
    cpu_pool_need,
    resolve_kv_dtype,
    size_pool,
)
from hetero.execution.runner import ModelRunner
from hetero.model.llama import LlamaModel


class Segment:
    def __init__(self, model: LlamaModel, kv_dtype: str, size: PoolSize, config: EngineConfig):
        self.model, self.kv_dtype, self.size = model, kv_dtype, size
        self.device = torch.device(model.runtime.device)
        self.dtype = model.runtime.torch_dtype()
        bind_device(model.runtime.device)
        self.pool = KVPool(
            model.config,
            model.layer_range,
            size.num_blocks,
            config.block_size,
            kv_dtype,
            model.runtime.device,
        )
        self.runner = ModelRunner(model, self.pool)

    @staticmethod
    def sized(
        model: LlamaModel, config: EngineConfig, max_model_len: int, fraction: float
    ) -> tuple[str, PoolSize]:
        """The KV dtype this segment's device stores, and the blocks its memory holds."""
        device, sc = model.runtime.device, config.scheduler
        kv_dtype = resolve_kv_dtype(config.kv_dtype, device)
        layout = PoolLayout.of(model.config, model.layer_range)
        windows = KVGroups.of(model.config).windows
        need = cpu_pool_need(
            max_model_len, sc.max_num_seqs, config.block_size, windows, sc.max_num_batched_tokens
        )
        size = size_pool(
            model.config,
            layout.n_slots,
            config.block_size,
            kv_dtype,
            device,
            fraction,
            config.num_kv_blocks,
            need,
            layout.null_block,
        )
        return kv_dtype, size

    def capture(
        self, config: EngineConfig, max_model_len: int, spec_tokens: int, row_cap: int | None = None
    ) -> None:
        """CUDA graphs of this segment's decode steps (a GPU only; not under enforce_eager), of
        at most row_cap rows where given."""
        if config.enforce_eager or self.device.type != "cuda":
            return
        sc = config.scheduler
        rows, prompt_rows = (
            graph_rows(sc.max_num_seqs, sc.max_num_batched_tokens, spec_tokens),
            config.prompt_graph_rows,
        )
        if row_cap is not None:
            rows, prompt_rows = min(rows, row_cap), min(prompt_rows, row_cap)
        self.runner.graphs = capture_decode_graphs(
            self.model, self.pool, rows, max_model_len, prompt_rows
        )

    def run(self, out, hidden: torch.Tensor | None) -> torch.Tensor:
        """This segment's layers over the step: hidden states for the next segment, or (the
        last) the logits. `hidden` comes from the previous segment, on its device."""
        if hidden is not None:
            hidden = hidden.to(device=self.device, dtype=self.dtype)
        return self.runner.run(out, hidden)[0]

    def describe(self, config: EngineConfig) -> str:
        cfg, n = self.model.config, self.pool.layout.n_slots
        costs = ", ".join(
            f"{d} {block_bytes(cfg, n, config.block_size, d) / 1024:.1f} KiB"
            for d in ("fp8", "fp16", "bf16")
        )
        name = self.kv_dtype
        if config.kv_dtype == "auto":
            name = f"{self.kv_dtype}, auto for {self.model.runtime.device}"
        return f"{self.size.describe(name)}; one block costs {costs}"

    def where(self) -> str:
        r = self.model.layer_range
        return f"{self.model.runtime.device} layers {r.start}-{r.stop - 1}"
