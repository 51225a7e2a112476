"""The engine's side of a pipeline: start the stage processes, feed them, watch them.

Stages are spawned (torch.multiprocessing, "spawn": CUDA cannot be forked) on this machine,
rank i holding stages[i]. Steps go to stage 0 over a pipe; results come back in the order the
steps went over a second pipe, written by the last stage (or, when that one runs on another
host, by stage 0 forwarding what it sends over gloo). Every wait watches the pipe and every
stage's process sentinel together, with a deadline, so a killed stage is seen at once and a hung
one after stage_timeout: the engine gets a StageFailure naming the stage, never a hang.
"""

from __future__ import annotations

import glob
import logging
import os
import pickle
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from hetero.config import PipelineConfig, RuntimeConfig
from hetero.engine.config import EngineConfig
from hetero.exit_status import exit_reason
from hetero.kernels.registry import forced
from hetero.pipeline.stages import StageSpec
from hetero.pipeline.startup import StartWatch
from hetero.pipeline.step import StepPlan, StepResult
from hetero.pipeline.worker import STOP, StageArgs, stage_main

log = logging.getLogger("hetero.pipeline")


class StageFailure(RuntimeError):
    """A stage died, failed or stopped answering; the pipeline is unusable."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def mps_running() -> bool:
    """Whether an MPS control daemon runs: its control socket in the pipe directory, or (where
    that is elsewhere) its process. CUDA connects to it when a process first initializes."""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    if os.path.exists(os.path.join(pipes, "control")):
        return True
    for comm in glob.glob("/proc/[0-9]*/comm"):
        try:
            with open(comm) as f:
                if f.read().startswith("nvidia-cuda-mps"):
                    return True
        except OSError:
            continue
    return False


def check_mps(stages: list[StageSpec]) -> None:
    """Stages with an MPS share need the daemon: without it the share is silently ignored (both
    stages get the whole GPU), so refuse at once instead of measuring something else."""
    shared = [s.describe() for s in stages if s.mps_percentage is not None]
    if shared and not mps_running():
        raise ValueError(
            f"stages {', '.join(shared)} ask for MPS shares but no MPS daemon is running: start "
            "it with `nvidia-cuda-mps-control -d` (stop: `echo quit | nvidia-cuda-mps-control`)"
        )


@contextmanager
def _spawn_env(spec: StageSpec) -> Iterator[None]:
    """The stage's MPS share in its environment from the first instruction of its process on:
    CUDA reads it when the process first touches the GPU, which an import may already do."""
    if spec.mps_percentage is None:
        yield
        return
    key = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
    saved = os.environ.get(key)
    os.environ[key] = str(spec.mps_percentage)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


class Pipeline:
    def __init__(
        self,
        model_path: str,
        stages: list[StageSpec],
        runtime: RuntimeConfig,
        engine: EngineConfig,
        pc: PipelineConfig,
        progress: bool = False,
    ):
        self.stages, self.timeout = stages, pc.stage_timeout
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()  # stage 0: steps in, its ready message out
        # results from the last stage straight to the engine when it runs here (else stage 0
        # forwards them from a remote last stage)
        self._results, results_child = ctx.Pipe(duplex=False)
        init = pc.dist_init or f"tcp://127.0.0.1:{free_port()}"
        remote = pc.remote_ranks()
        if remote and not pc.dist_init:
            raise ValueError("--remote-stages needs --dist-init tcp://HOST:PORT that they reach")
        if max(remote, default=0) >= len(stages):
            raise ValueError(f"--remote-stages {pc.remote_stages}: only {len(stages)} stages")
        self.procs: dict[int, mp.Process] = {}  # rank -> the stages started here
        self._errors = []  # a status pipe per local stage: its phases, and why it failed
        kernels = forced()  # a test's (or a comparison's) kernel choices hold in every stage
        local = sorted(set(range(len(stages))) - remote)
        check_mps([stages[r] for r in local])
        for rank in local:
            errors, err_child = ctx.Pipe(duplex=False)
            self._errors.append(errors)
            args = StageArgs(
                rank, tuple(stages), init, str(model_path), runtime, engine, pc, progress, kernels
            )
            conn = child if rank == 0 else None
            carries = rank == (len(stages) - 1 if len(stages) - 1 in local else 0)
            p = ctx.Process(
                target=stage_main,
                args=(args, conn, err_child, results_child if carries else None),
                name=f"hetero-stage-{rank}",
            )
            p.daemon = True  # never outlive the engine's process
            with _spawn_env(stages[rank]):
                p.start()
            self.procs[rank] = p
            err_child.close()
        child.close()
        results_child.close()
        self.closed = False
        names = [s.describe() for s in stages]
        self._watch = StartWatch(sorted(self.procs), self._errors, names)
        self._start()
        self.num_blocks = min(self.capacities)

    def _start(self) -> None:
        """Wait for stage 0's ready, each phase logged; bounded by stage_timeout."""
        w = self._watch
        how, took = w.wait_ready(
            self._conn, [p.sentinel for p in self.procs.values()], self.timeout
        )
        if how == "timeout":
            raise self._failure(
                f"not ready within --stage-timeout {self.timeout:.0f} s; {w.stuck()}"
            )
        if how == "died":
            raise self._failure(f"a stage died while starting; {w.stuck()}")
        kind, self.capacities, self.reports = self._receive("starting")
        if kind != "ready":
            raise self._failure(f"stage 0 answered {kind!r} instead of ready")
        log.info("pipeline: %d stages ready in %.1f s", len(self.stages), took)
        paths = "; ".join(r["decode"] for r in self.reports)
        log.info("pipeline: decode steps per stage: %s", paths)

    def describe(self) -> str:
        per = "; ".join(
            f"stage {i} ({s.describe()}): {n} blocks of {r['kv_dtype']} KV, {r['weights']} "
            f"weights, {r['decode']}"
            for i, (s, n, r) in enumerate(zip(self.stages, self.capacities, self.reports))
        )
        return (
            f"pipeline of {len(self.stages)} stages, {per}; shared block table: {self.num_blocks}"
        )

    # -- steps -------------------------------------------------------------------------------

    def submit(self, plan: StepPlan) -> None:
        try:
            self._conn.send_bytes(pickle.dumps(plan))
        except (BrokenPipeError, ConnectionError, OSError) as e:
            raise self._failure(f"cannot send a step ({e})") from e

    def result(self) -> StepResult:
        """The next micro-batch's result, in submission order."""
        return self._receive("running a step", self._results)

    def _receive(self, doing: str, conn=None):
        conn = conn or self._conn
        deadline = time.monotonic() + self.timeout
        sentinels = [p.sentinel for p in self.procs.values()]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failure(f"no answer within {self.timeout:.0f} s while {doing}")
            ready = wait([conn, *sentinels], timeout=left)
            if conn in ready:
                try:
                    return pickle.loads(conn.recv_bytes())
                except (EOFError, OSError) as e:
                    raise self._failure(
                        f"the pipe from the stages closed while {doing} ({e})"
                    ) from e
            if ready:
                raise self._failure(f"a stage died while {doing}")

    def _failure(self, what: str) -> StageFailure:
        time.sleep(0.2)  # let a dying stage's reason reach the queue
        dead = [
            f"stage {r} ({self.stages[r].describe()}) {exit_reason(p.exitcode)}"
            for r, p in self.procs.items()
            if not p.is_alive()
        ]
        self._watch.drain()
        reasons = self._watch.errors
        msg = f"pipeline failed: {what}"
        if dead:
            msg += "; " + ", ".join(dead)
        if reasons:
            msg += "; " + " | ".join(reasons)
        self.close(graceful=False)
        return StageFailure(msg)

    # -- shutdown ----------------------------------------------------------------------------

    def close(self, graceful: bool = True, timeout: float = 10.0) -> None:
        """Stop every stage: the stop message through the pipeline, then force what is left."""
        if self.closed:
            return
        self.closed = True
        if graceful and all(p.is_alive() for p in self.procs.values()):
            try:
                self._conn.send_bytes(STOP)
            except OSError:
                pass
        deadline = time.monotonic() + (timeout if graceful else 0.0)
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(5.0)
        self._conn.close()
        self._results.close()
        for e in self._errors:
            e.close()
