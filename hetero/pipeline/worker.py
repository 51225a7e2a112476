"""One pipeline stage: a process holding a contiguous range of layers and their KV pool.

Stage 0 takes steps from the engine over a pipe; stage i > 0 takes them (with stage i-1's
activations) from stage i-1. Each stage runs its layers through the ordinary ModelRunner over
its own KV pool, with the one-device engine's fast path on its device: the same weights mode
("auto" resolved per device) and, on a GPU, decode steps replayed from CUDA graphs of its layer
range (tokens or hidden states in, hidden states or logits out; the sends stay outside). The
last stage also runs the sampler and sends the token ids to the engine. Steps flow in order
through every stage, so KV writes of one micro-batch always land before a later micro-batch
reads them.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace

import torch

from hetero.config import PipelineConfig, RuntimeConfig, device_key
from hetero.engine.config import EngineConfig
from hetero.engine.kv_groups import KVGroups
from hetero.engine.output import sampled_lists
from hetero.execution.cuda_graph import DecodeGraphs, capture_decode_graphs
from hetero.execution.kv_pool import (
    KVPool,
    PoolLayout,
    cpu_pool_need,
    resolve_kv_dtype,
    size_pool,
)
from hetero.execution.layout import kernels_on, tensor_bytes
from hetero.execution.runner import ModelRunner
from hetero.gguf_loader import load_gguf
from hetero.kernels import cpu_threads
from hetero.kernels.registry import forcing
from hetero.model.llama import LlamaModel
from hetero.pipeline.links import Links
from hetero.pipeline.stages import StageSpec
from hetero.pipeline.startup import StageStatus
from hetero.pipeline.step import StepPlan, StepResult
from hetero.sampler import Sampler, make_batch

STOP = pickle.dumps(None)


@dataclass(frozen=True)
class StageArgs:
    rank: int
    stages: tuple[StageSpec, ...]
    init_method: str  # tcp://HOST:PORT of rank 0's rendezvous
    model_path: str
    runtime: RuntimeConfig
    engine: EngineConfig
    pipeline: PipelineConfig
    progress: bool = False
    kernels: dict[str, str] | None = None  # registry choices the engine's process forces

    @property
    def spec(self) -> StageSpec:
        return self.stages[self.rank]


def stage_runtime(args: StageArgs) -> RuntimeConfig:
    """The engine's runtime on this stage's device, with the stage's own kernel choice.

    CPU stages on one machine share its cores: without an explicit thread count each takes its
    share, so two stages overlap instead of fighting over every core.
    """
    spec, rt = args.spec, args.runtime
    threads = rt.threads
    n_cpu = sum(1 for s in args.stages if s.device == "cpu")
    if spec.device == "cpu" and threads == 0:
        threads = cpu_threads.default_threads(stages=n_cpu)
    elif threads == 0:
        # A GPU stage only launches kernels (and repacks weights at load): beside CPU stages it
        # leaves them the cores; beside other GPU stages it takes its share, as every stage
        # taking all cores oversubscribes the machine during the load.
        threads = 1 if n_cpu else max(1, (os.cpu_count() or 1) // len(args.stages))
    if spec.n_cpu_moe is not None:  # the plan's experts in RAM (model/moe.py)
        rt = replace(rt, cpu_moe=False, n_cpu_moe=spec.n_cpu_moe)
    return replace(rt, device=spec.device, weights=spec.weights or rt.weights, threads=threads)


class Stage:
    def __init__(self, args: StageArgs, status: StageStatus | None = None):

        self.status = status = status or StageStatus(args.rank)
        self.args, spec = args, args.spec
        self.first, self.last = args.rank == 0, args.rank == len(args.stages) - 1
        rt = stage_runtime(args)
        self.dtype = rt.torch_dtype()
        if spec.device == "cpu":
            cpu_threads.configure(rt.threads)
        elif rt.threads:
            torch.set_num_threads(rt.threads)
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        status.phase(f"joining the process group at {args.init_method}")
        self.links = Links(args.rank, args.stages, args.init_method)
        self.kv_dtype = resolve_kv_dtype(spec.kv_dtype or args.engine.kv_dtype, spec.device)
        status.phase(f"loading layers {spec.describe()} ({rt.weights} weights, {rt.threads} thr)")
        gm = load_gguf(args.model_path)
        self.model = LlamaModel(gm, rt, spec.layers, progress=args.progress)
        status.phase("loaded; waiting for the other stages to load")
        dist_barrier()  # every stage's weights are in memory before any sizes its pool
        pool = self._make_pool(gm.config)
        self.runner = ModelRunner(self.model, pool)
        self.runner.graphs = self._decode_graphs(pool)
        # what each stage resolved (its device's KV dtype and weights mode) and how it decodes
        self.reports = self.links.gather_all(self._report(rt, pool))
        self.sampler = Sampler(args.engine.seed) if self.last else None
        status.phase("KV pool allocated; ready")

    def _report(self, rt: RuntimeConfig, pool: KVPool) -> dict:
        """What this stage resolved for its device and holds there (the engine's StageLayout)."""
        weights = rt.weights_mode()
        return {
            "kv_dtype": self.kv_dtype,
            "weights": weights,
            "decode": self._decode_path(),
            "kernels": kernels_on(self.args.spec.device, weights),
            "weight_bytes": tensor_bytes(self.model),
            "kv_bytes": tensor_bytes(pool),
            "kv_windows": KVGroups.of(self.model.config).windows,
        }

    def _make_pool(self, config) -> KVPool:
        """The KV pool every stage agrees on: the smallest stage's block count."""
        self.status.phase(f"all stages loaded; sizing the KV pool{_memory(self.device)}")
        self.capacities = [int(n) for n in self.links.gather_all(self._own_blocks())]
        self.num_blocks = min(self.capacities)
        self.status.phase(f"KV sized: {self.num_blocks} blocks (stages: {self.capacities})")
        spec, block_size = self.args.spec, self.args.engine.block_size
        return KVPool(config, spec.layers, self.num_blocks, block_size, self.kv_dtype, spec.device)

    def _decode_graphs(self, pool: KVPool) -> DecodeGraphs | None:
        """As the one-device engine: decode graphs on a GPU unless --enforce-eager. Elsewhere the
        same static buffers run uncaptured where the kernels read tensor metadata (the
        references: how tests walk this path on a CPU); the CPU kernels keep the eager path.
        Buckets end at a micro-batch group's share of max_num_seqs, the most a step carries."""
        ecfg = self.args.engine
        if ecfg.enforce_eager:
            self.status.phase("decode runs eagerly (--enforce-eager)")
            return None
        groups = self.args.pipeline.micro_batches or len(self.args.stages)
        max_batch = -(-ecfg.scheduler.max_num_seqs // groups)
        max_len = ecfg.scheduler.max_model_len or self.model.config.context_length
        rows = ecfg.prompt_graph_rows
        if self.device.type == "cuda":
            self.status.phase(f"capturing decode CUDA graphs (batches up to {max_batch})")
            return capture_decode_graphs(self.model, pool, max_batch, max_len, rows)
        try:
            return DecodeGraphs(self.model, pool, max_batch, max_len, rows)
        except ValueError:
            return None  # the CPU's kernels read host lists: its eager path

    def _decode_path(self) -> str:
        g = self.runner.graphs
        if g is None:
            return "eager"
        how = f"{'CUDA graphs' if g.graphs else 'static buffers'} up to batch {g.max_batch}"
        return how + (
            f", prompt steps up to {g.buckets[-1]} rows" if g.buckets[-1] > g.max_batch else ""
        )

    def _own_blocks(self) -> int:
        """Blocks this stage's own free memory holds; stages sharing a device share it."""
        a, spec, ecfg = self.args, self.args.spec, self.args.engine
        sharing = sum(1 for s in a.stages if device_key(s.device) == device_key(spec.device))
        cap = spec.num_kv_blocks or ecfg.num_kv_blocks
        if spec.num_kv_blocks and ecfg.num_kv_blocks:
            cap = min(spec.num_kv_blocks, ecfg.num_kv_blocks)
        cfg, sc = self.model.config, ecfg.scheduler
        layout = PoolLayout.of(cfg, spec.layers)
        size = size_pool(
            cfg,
            layout.n_slots,
            ecfg.block_size,
            self.kv_dtype,
            spec.device,
            ecfg.kv_memory_fraction / sharing,
            cap,
            cpu_pool_need(
                sc.max_model_len or cfg.context_length,
                sc.max_num_seqs,
                ecfg.block_size,
                KVGroups.of(cfg).windows,
                sc.max_num_batched_tokens,
            ),
            layout.null_block,
        )
        return size.num_blocks

    @torch.inference_mode()
    def run(self, plan: StepPlan, hidden: torch.Tensor | None):
        """Hidden states [T, C] for the next stage, or (last stage) the sampled StepResult."""
        y, _ = self.runner.run(plan.scheduler_output(), hidden)
        if not self.last:
            return y
        sampling = plan.sampling
        rows = sampling.rows
        if not rows:
            return StepResult(plan.micro_batch, [])
        state = make_batch(
            [r.params for r in rows],
            [r.prompt_ids for r in rows],
            [r.output_ids for r in rows],
            [r.step for r in rows],
            y.device,
            sampling.allowed,
            sampling.eos_ids,
        )
        ids, lps, tops = sampled_lists(self.sampler(y, state))
        return StepResult(plan.micro_batch, ids, lps, tops)

    def serve(self, conn, results=None) -> None:
        """The stage's loop: take a step, run it, pass it on; until the stop message.

        conn (stage 0): steps from the engine, and the ready message to it. results: the pipe
        to the engine that results go into, held by the last stage when it runs beside the
        engine (one hop, no gloo message and no thread), else by stage 0, whose result thread
        forwards what a remote last stage sends over gloo."""
        thread = None
        if self.first:
            conn.send_bytes(pickle.dumps(("ready", self.capacities, self.reports)))
        if results is not None and not self.last:
            thread = threading.Thread(target=self._forward_results, args=(results,), daemon=True)
            thread.start()
        clock = _Clock()
        while True:
            if self.first:
                payload, hidden = conn.recv_bytes(), None
            else:
                payload, hidden = self.links.recv_prev(self.device, self.dtype)
            plan = pickle.loads(payload)
            if plan is None:
                self._pass_on(STOP, results)
                break
            clock.lap("waiting")
            out = self.run(plan, hidden)
            decode = all(len(q.tokens) == 1 for q in plan.seqs)
            ran = clock.lap("running decodes" if decode else "running prompt tokens")
            if self.last:  # every stage's time, for the engine's per-stage busy share
                out.stage_s = [*stage_times(payload, self.args.rank), ran]
                self._pass_on(pickle.dumps(out), results)
            else:
                self.links.send_next(payload + struct.pack("<d", ran), out)
            clock.lap("passing on")
        if thread is not None:
            thread.join()  # the stop message came back round: every result is delivered
        self.links.flush()
        graphs = self.runner.graphs
        replayed = (
            f", {graphs.steps} through the graphs ({graphs.prompt_steps} with prompt rows)"
            if graphs
            else ""
        )
        print(f"stage {self.args.rank} ({self.args.spec.describe()}): {clock.report()}{replayed}",
              file=sys.stderr, flush=True)  # fmt: skip

    def _pass_on(self, payload: bytes, results) -> None:
        if not self.last:
            self.links.send_next(payload, None)
        elif results is not None:
            results.send_bytes(payload)
        else:
            self.links.send_result(payload)

    def _forward_results(self, results) -> None:
        """Stage 0's result thread: a remote last stage's answers, to the engine in order."""
        while True:
            payload = self.links.recv_result()
            results.send_bytes(payload)
            if payload == STOP:
                return


class _Clock:
    """Where a stage's time goes: waiting for work (and the previous stage's activations),
    running it (on a GPU the host's share: launches, and the last stage's wait for its tokens;
    decode-only steps apart from steps with prompt tokens), passing it on (which waits until the
    previous send is taken: the next stage's backpressure). Printed when the stage stops."""

    def __init__(self):
        self.t, self.spent, self.laps, self.steps = time.perf_counter(), {}, {}, 0

    def lap(self, what: str) -> float:
        """End the current lap as `what`; its seconds."""
        now = time.perf_counter()
        took = now - self.t
        if self.steps or what != "waiting":  # not the idle time before the first step
            self.spent[what] = self.spent.get(what, 0.0) + took
            self.laps[what] = self.laps.get(what, 0) + 1
        self.t = now
        self.steps += what == "waiting"
        return took

    def report(self) -> str:
        per = ", ".join(
            f"{k} {v / self.laps[k] * 1e3:.2f}" + (f" ({self.laps[k]}x)" if "running" in k else "")
            for k, v in self.spent.items()
        )
        return f"{self.steps} steps, ms per step: {per}"


def stage_times(payload: bytes, rank: int) -> list[float]:
    """The run times the stages before `rank` appended to the step's payload, 8 bytes each
    (pickle.loads ignores bytes past the pickled plan, so they travel with it unread)."""
    if rank == 0:
        return []
    return list(struct.unpack(f"<{rank}d", payload[-8 * rank :]))


def _memory(device: torch.device) -> str:
    """The GPU's free memory after the load (what the KV pool is sized from), for the log."""
    if device.type != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info(device)
    return f" ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free on {device})"


def dist_barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def stage_main(args: StageArgs, conn=None, status_conn=None, results=None) -> None:
    """Process entry point (spawned by the engine, or started by `hetero stage` on a host)."""
    if args.spec.mps_percentage is not None:  # read when this process first touches CUDA
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(args.spec.mps_percentage)

    status = StageStatus(args.rank, status_conn)
    try:
        with forcing(args.kernels or {}):
            Stage(args, status).serve(conn, results)
    except BaseException as e:  # the engine reads the reason; the exit code marks the death
        what = f"stage {args.rank} ({args.spec.describe()}): {type(e).__name__}: {e}"
        traceback.print_exc()
        status.error(what)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip process-group teardown, which can block on a dead peer
    sys.stdout.flush()
    os._exit(0)
