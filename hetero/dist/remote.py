"""`hetero stage`: one pipeline stage started by hand, on another host (or in another shell).

The engine starts the stages it can see; a stage listed in --remote-stages is started here
instead, with the same model file, the same split (--split or --plan: both sides must agree on
every stage's layers) and the same KV options, joining the engine's process group at
--dist-init. It serves until the engine stops the pipeline, then exits 0; it exits 1 when a peer
dies, so a supervisor (systemd Restart=always) brings it back for the engine's restart.
"""

from __future__ import annotations

from hetero.dist.stages import resolve_stages
from hetero.dist.worker import StageArgs, stage_main
from hetero.llm import build_configs
from hetero.models import resolve_model


def stage_args(model: str | None, rank: int, options: dict) -> StageArgs:
    from hetero.gguf_loader import load_gguf

    engine, runtime = build_configs(**options)
    pc = engine.pipeline
    if not pc.dist_init:
        raise ValueError("--dist-init tcp://HOST:PORT (the engine host's) is required")
    if not (pc.split or pc.plan):
        raise ValueError("give the engine's --split or --plan, so both sides agree on the layers")
    path = resolve_model(model)
    stages = resolve_stages(path, load_gguf(path).config.n_layers, pc.devices, pc.split, pc.plan)
    if not 0 < rank < len(stages):
        raise ValueError(f"--rank {rank}: the pipeline has stages 0-{len(stages) - 1}, and 0 "
                         "runs beside the engine")
    return StageArgs(rank, tuple(stages), pc.dist_init, str(path), runtime, engine, True)


def run_stage(model: str | None, rank: int, options: dict) -> None:
    """Serve as stage `rank` until the pipeline stops (exits the process)."""
    stage_main(stage_args(model, rank, options))
