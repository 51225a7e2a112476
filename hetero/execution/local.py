"""The local executor: the model in this process, on one device or over a GPU and the CPU.

It owns what runs the model here: one Segment per device (execution/segment.py), each its layers,
a paged KV pool (sized from the memory left after the weights), the ModelRunner and, on a GPU,
the CUDA graphs of decode steps; and, on one device, the lower KV tiers of its pool (RAM, disk).
`submit` runs the step through the segments in layer order; `collect` hands the logits to the
engine, which samples them.

With a GPU and a CPU segment, steps with many prompt tokens run the CPU segment's matmuls on the
GPU, their weights streamed over PCIe (execution/offload.py), as llama.cpp's op offload does;
decode steps stay on the CPU, which reads its weights where they are. Experts kept in RAM beside
a GPU (--cpu-moe) go the same way in such steps (execution/offload_experts.py).
"""

from __future__ import annotations

import time
from dataclasses import replace

from hetero.config import bind_device
from hetero.embedding import Embedder
from hetero.engine.config import EngineConfig
from hetero.engine.executor import ExecutorFailure, ExecutorInfo, ModelOutput, Step
from hetero.engine.kv_groups import KVGroups
from hetero.execution.cuda_graph import DecodeGraphs
from hetero.execution.layout import segment_layout
from hetero.execution.offload import StreamedMatmuls
from hetero.execution.offload_experts import StreamedExperts
from hetero.execution.segment import Segment
from hetero.kv_tiers.tiering import TieredKV, build_tiers
from hetero.model.llama import LlamaModel


class LocalExecutor:
    def __init__(
        self,
        models: LlamaModel | list[LlamaModel],
        config: EngineConfig,
        max_model_len: int,
        model_path: str | None = None,
        spec_tokens: int = 0,
        kv_fraction: float | None = None,
        gguf=None,
        offload_min_tokens: int = 0,
        offload_device: str | None = None,
    ):
        """`models`: the whole model, or its layer ranges in order, one per device;
        `model_path`: names the disk tier's files (None: no lower KV tiers, as for a draft
        model); `spec_tokens`: the most guesses a request may carry (room in the graphs);
        `kv_fraction`: of the free memory for the pool (default: the config's); `gguf`: the
        model's file as loaded (its metadata says how embeddings are pooled);
        `offload_min_tokens`: steps of at least this many tokens run a CPU segment's matmuls on
        `offload_device` (a GPU of this process; 0 or None: never)."""
        models = models if isinstance(models, list) else [models]
        self.config, self.model_path = config, model_path
        self.gguf, self._embedder = gguf, None
        # before the pools are sized: the staging buffers come out of the same memory
        self.expert_offload = StreamedExperts.install(models, offload_min_tokens, offload_device)
        fraction = kv_fraction or config.kv_memory_fraction
        sized = [Segment.sized(m, config, max_model_len, fraction) for m in models]
        blocks = min(size.num_blocks for _, size in sized)  # one block table for every pool
        self.segments = [
            Segment(m, kv, replace(size, num_blocks=blocks), config)
            for m, (kv, size) in zip(models, sized)
        ]
        self.kv_tiers: TieredKV | None = None
        if model_path is not None and len(self.segments) == 1:  # tiers of one pool only
            s = self.segments[0]
            self.kv_tiers = build_tiers(
                config, s.pool, s.size.block_bytes, str(s.device), model_path, s.model.layer_range
            )
        # a graph holds no streamed step: its steps stay below the first that streams (their
        # experts in RAM run as host nodes of the graph)
        row_cap = self.expert_offload.first - 1 if self.expert_offload is not None else None
        for s in self.segments:
            s.capture(config, max_model_len, spec_tokens, row_cap)
        self.offload = StreamedMatmuls.install(self.segments, offload_min_tokens, offload_device)
        self.info = self._info()
        self._out: ModelOutput | None = None

    # the one segment's parts (the first segment's where there are several)
    @property
    def model(self) -> LlamaModel:
        return self.segments[0].model

    @property
    def pool(self):
        return self.segments[0].pool

    @property
    def runner(self):
        return self.segments[0].runner

    @property
    def pool_size(self):
        return self.segments[0].size

    def set_graphs(self, graphs: DecodeGraphs | None) -> None:
        """Run the (one) segment's decode steps through `graphs` (None: eagerly); for tests."""
        self.runner.graphs = graphs
        self.info = self._info()

    def _info(self) -> ExecutorInfo:
        graphs = [s.runner.graphs for s in self.segments]
        whole = all(g is not None for g in graphs)  # a step replays end to end
        last = self.segments[-1].model.runtime
        kv = {s.kv_dtype for s in self.segments}
        return ExecutorInfo(
            num_blocks=self.segments[0].size.num_blocks,
            device=last.device,
            weights=last.weights_mode(),
            kv_dtype=kv.pop() if len(kv) == 1 else "mixed",
            graph_rows=min(g.buckets[-1] for g in graphs) if whole else 0,
            prompt_graphs=whole and all(g.buckets[-1] > g.max_batch for g in graphs),
            description=self.describe_kv(),
            stages=tuple(segment_layout(s) for s in self.segments),
            kv_windows=KVGroups.of(self.model.config).windows,
        )

    def describe_kv(self) -> str:
        """Each segment's pool, and what a block costs in each KV dtype (reported at start)."""
        many = len(self.segments) > 1
        parts = [
            (f"{s.where()}: " if many else "") + s.describe(self.config) for s in self.segments
        ]
        if self.kv_tiers is not None:
            parts.append(self.kv_tiers.plan.describe())
        if any(s.device.type == "cpu" for s in self.segments):
            from hetero.kernels import cpu_threads  # the thread count chosen, the kernels' ISA

            parts.append(cpu_threads.describe())
        for offload in (self.offload, self.expert_offload):
            if offload is not None:
                parts.append(offload.describe())
        return "; ".join(parts)

    def submit(self, step: Step) -> None:
        bind_device(self.info.device)  # steps may run on another thread than the load
        hidden = None
        big = self.offload is not None and self.offload.wants(step.out.num_batched_tokens)
        # each segment's time as the host sees it (on a GPU: until the next segment, or the
        # sampler, waits for its output), and where it ran
        stages, t = [], time.perf_counter()
        for s in self.segments:
            where = str(s.device)
            if big and s.device.type == "cpu":
                with self.offload.active():
                    hidden = s.run(step.out, hidden)
                where = f"cpu, matmuls on {self.offload.device}"
            else:
                hidden = s.run(step.out, hidden)
            now = time.perf_counter()
            stages.append((where, now - t))
            t = now
        graphed = all(s.runner.replayed for s in self.segments)
        self._out = ModelOutput(logits=hidden, graphed=graphed, stages=tuple(stages))

    def collect(self) -> ModelOutput:
        out, self._out = self._out, None
        if out is None:
            raise RuntimeError("collect() without a submitted step")
        return out

    def embed(self, prompts: list[list[int]]):
        """The model's pooled embeddings of the prompts (hetero/embedding.py): a forward of its
        own, on the step's thread between two steps, writing no KV."""
        if len(self.segments) > 1:
            raise ValueError("embeddings need the whole model on one device here")
        if self._embedder is None:
            if self.gguf is None:
                raise ValueError("this executor was built without its model file: no embeddings")
            self._embedder = Embedder(self.gguf, self.model)
        return self._embedder(prompts)

    def restart(self) -> None:
        raise ExecutorFailure("the local executor does not restart")  # it never fails softly

    def close(self) -> None:
        """Nothing to release: the pools and the weights go with the object."""
