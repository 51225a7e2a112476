"""The local executor: the whole model on one device, one step at a time.

It owns what runs the model there: the loaded layers, the paged KV pool (sized from the memory
left after the weights), the ModelRunner, the CUDA graphs of decode steps (captured at start on
a GPU unless enforce_eager) and the lower KV tiers of its pool (RAM, disk). `submit` runs the
step; `collect` hands its logits to the engine, which samples them.
"""

from __future__ import annotations

from hetero.config import bind_device
from hetero.embedding import Embedder
from hetero.engine.config import EngineConfig
from hetero.engine.executor import ExecutorFailure, ExecutorInfo, ModelOutput, Step
from hetero.execution.cuda_graph import DecodeGraphs, capture_decode_graphs, graph_rows
from hetero.execution.kv_pool import (
    KVPool,
    block_bytes,
    cpu_pool_need,
    resolve_kv_dtype,
    size_pool,
)
from hetero.execution.runner import ModelRunner
from hetero.kv_tiers.tiering import TieredKV, build_tiers
from hetero.model.llama import LlamaModel


class LocalExecutor:
    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig,
        max_model_len: int,
        model_path: str | None = None,
        spec_tokens: int = 0,
        kv_fraction: float | None = None,
        gguf=None,
    ):
        """`model_path`: names the disk tier's files (None: no lower KV tiers, as for a draft
        model); `spec_tokens`: the most guesses a request may carry (room in the graphs);
        `kv_fraction`: of the free memory for the pool (default: the config's); `gguf`: the
        model's file as loaded (its metadata says how embeddings are pooled)."""
        self.model, self.config, self.model_path = model, config, model_path
        self.gguf, self._embedder = gguf, None
        device = model.runtime.device
        bind_device(device)
        self.kv_dtype = resolve_kv_dtype(config.kv_dtype, device)
        n_layers = len(model.layer_range)
        self.pool_size = size_pool(
            model.config,
            n_layers,
            config.block_size,
            self.kv_dtype,
            device,
            kv_fraction or config.kv_memory_fraction,
            config.num_kv_blocks,
            cpu_pool_need(max_model_len, config.scheduler.max_num_seqs, config.block_size),
        )
        self.pool = KVPool(
            model.config,
            n_layers,
            self.pool_size.num_blocks,
            config.block_size,
            self.kv_dtype,
            device,
        )
        self.kv_tiers: TieredKV | None = None
        if model_path is not None:
            self.kv_tiers = build_tiers(
                config, self.pool, self.pool_size.block_bytes, device, model_path, model.layer_range
            )
        self.runner = ModelRunner(model, self.pool)
        graphs = None
        if not config.enforce_eager and device.startswith("cuda"):
            sc = config.scheduler
            rows = graph_rows(sc.max_num_seqs, sc.max_num_batched_tokens, spec_tokens)
            graphs = capture_decode_graphs(
                model, self.pool, rows, max_model_len, config.prompt_graph_rows
            )
        self.set_graphs(graphs)
        self._out: ModelOutput | None = None

    def set_graphs(self, graphs: DecodeGraphs | None) -> None:
        """Run decode steps through `graphs` (None: eagerly); tests give their own."""
        self.runner.graphs = graphs
        self.info = self._info()

    def _info(self) -> ExecutorInfo:
        g = self.runner.graphs
        rt = self.model.runtime
        return ExecutorInfo(
            num_blocks=self.pool_size.num_blocks,
            device=rt.device,
            weights=rt.weights_mode(),
            kv_dtype=self.kv_dtype,
            graph_rows=0 if g is None else g.buckets[-1],
            prompt_graphs=g is not None and g.buckets[-1] > g.max_batch,
            description=self.describe_kv(),
        )

    def describe_kv(self) -> str:
        """The pool, and what a block costs in each KV dtype (reported at start)."""
        cfg, n = self.model.config, len(self.model.layer_range)
        costs = ", ".join(
            f"{d} {block_bytes(cfg, n, self.config.block_size, d) / 1024:.1f} KiB"
            for d in ("fp8", "fp16", "bf16")
        )
        tiers = "" if self.kv_tiers is None else f"; {self.kv_tiers.plan.describe()}"
        name = self.kv_dtype
        if self.config.kv_dtype == "auto":
            name = f"{self.kv_dtype}, auto for {self.model.runtime.device}"
        cpu = ""
        if self.model.runtime.device == "cpu":  # the thread count chosen, and the kernels' ISA
            from hetero.kernels import cpu_threads

            cpu = f"; {cpu_threads.describe()}"
        return f"{self.pool_size.describe(name)}; one block costs {costs}{tiers}{cpu}"

    def submit(self, step: Step) -> None:
        bind_device(self.model.runtime.device)  # steps may run on another thread than the load
        logits, _ = self.runner.run(step.out)
        self._out = ModelOutput(logits=logits, graphed=self.runner.replayed)

    def collect(self) -> ModelOutput:
        out, self._out = self._out, None
        if out is None:
            raise RuntimeError("collect() without a submitted step")
        return out

    def embed(self, prompts: list[list[int]]):
        """The model's pooled embeddings of the prompts (hetero/embedding.py): a forward of its
        own, on the step's thread between two steps, writing no KV."""
        if self._embedder is None:
            if self.gguf is None:
                raise ValueError("this executor was built without its model file: no embeddings")
            self._embedder = Embedder(self.gguf, self.model)
        return self._embedder(prompts)

    def restart(self) -> None:
        raise ExecutorFailure("the local executor does not restart")  # it never fails softly

    def close(self) -> None:
        """Nothing to release: the pool and the weights go with the object."""
