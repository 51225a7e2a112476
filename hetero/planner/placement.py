"""plan(): devices in pipeline order, a weights mode and KV dtype each, the split, the numbers.

GPUs come first in the order given, CPUs last: the CPU takes layers only when the GPUs cannot hold
the model with the asked KV (the last layers spill, as llama.cpp's -ngl does). Each device first
gets its fastest weights mode; when nothing fits, the most compact one.
"""

from __future__ import annotations

from dataclasses import replace

from hetero.config import GPU_WEIGHTS_MODES, RuntimeConfig
from hetero.engine.config import kv_dtype_rule
from hetero.execution.kv_pool import PoolLayout
from hetero.planner.cost import DeviceCost, kv_layer_slots, kv_token_bytes, seq_blocks
from hetero.planner.device import DeviceProfile
from hetero.planner.experts import (
    check_ram,
    expert_host,
    experts_or_layers,
    may_move_experts,
    ram_expert_layers,
)
from hetero.planner.model_desc import ModelDesc
from hetero.planner.plan import (
    DEFAULT_CONTEXT_CAP,
    Plan,
    PlanConfig,
    PlanError,
    StagePlan,
    base_device,
)
from hetero.planner.refusal import explain
from hetero.planner.search import Split, search
from hetero.planner.setup import Setup

# exact or nearly so (fp16: logits within 0.03); qdot where its kernel builds; int4/int8 opt-in
CPU_MODES = ("fp16", "dense")


def kv_dtype_for(dev: DeviceProfile, asked: str) -> str:
    """The KV dtype `dev` stores for the asked one: the engine's own rule (kv_dtype_rule)."""
    return kv_dtype_rule(asked, dev.is_cpu, dev.fp8_kv)


def _modes(dev: DeviceProfile, weights: str) -> tuple[str, ...]:
    """The weights modes the planner may give `dev`: the one asked of it, or (auto) the
    candidates it chooses among by speed where they fit. A mode the device runs only through
    the torch reference (quant on a CPU) is refused, as the engine refuses it."""
    asked = RuntimeConfig(weights=weights).weights_for(base_device(dev.id))
    if asked != "auto":
        if dev.is_cpu and asked == "quant":
            raise PlanError(
                f"weights 'quant' on {dev.id} runs the torch reference (a test path, many times "
                "slower): plan it with qdot or fp16"
            )
        if dev.is_cpu or asked in GPU_WEIGHTS_MODES:
            return (asked,)
        if "=" in weights:  # asked of this GPU by name
            raise PlanError(
                f"weights {asked!r} asked of {dev.id} is a CPU packing: a GPU runs quant or dense"
            )
        return ("dense",)  # one mode for every device: the GPUs' nearest (exact) one
    if not dev.is_cpu:
        return GPU_WEIGHTS_MODES
    return (("qdot",) if "qdot" in dev.matmul else ()) + CPU_MODES  # measured by the profile


def _budget(dev: DeviceProfile, cfg: PlanConfig) -> float:
    margin = cfg.cpu_margin_bytes if dev.is_cpu else cfg.gpu_margin_bytes
    return dev.usable_memory * (1.0 - cfg.margin) - margin


def _pick_mode(
    desc: ModelDesc,
    dev: DeviceProfile,
    cfg: PlanConfig,
    kv: str,
    compact: bool,
    ram: tuple[int, DeviceCost | None] = (0, None),
):
    """Device `dev`'s costs in its fastest weights mode (compact: its smallest); `ram`: the
    layers whose experts stay in RAM, and the host that multiplies them."""
    graphs = not cfg.engine.enforce_eager
    costs = [
        DeviceCost(
            desc,
            dev,
            m,
            kv,
            graphs,
            cfg.engine.scheduler.max_num_seqs,
            *ram,
            stream_experts_from=cfg.offload_min_tokens if ram[0] else 0,
        )  # fmt: skip
        for m in _modes(dev, cfg.weights)
    ]
    if compact:
        return min(costs, key=lambda c: c.weights_bytes(0, desc.n_layers, True, True))
    return min(costs, key=lambda c: sum(c.decode_layer_seconds(1, cfg.prompt_len)))


def _reason(setup: Setup, i: int) -> str:
    """Why stage i runs its weights mode, for the plan's report."""
    c = setup.costs[i]
    if len(_modes(c.dev, setup.config.weights)) == 1:
        return "asked" if setup.config.weights != "auto" else "the only mode here"
    return "most compact (the fastest did not fit)" if setup.compact else "fastest that fits"


def _attempts(
    desc: ModelDesc,
    devices: list[DeviceProfile],
    cfg: PlanConfig,
    context: int,
    ram: int = 0,
    spill: bool = True,
):
    gpus = [d for d in devices if not d.is_cpu]
    cpus = [d for d in devices if d.is_cpu]
    if ram and gpus:  # the GPUs take the layers, the first CPU's RAM the chosen experts
        host = DeviceCost(desc, expert_host(cpus), "quant", "fp16")
        for compact in (False, True):
            kv = cfg.engine.kv_dtype
            costs = [
                _pick_mode(desc, d, cfg, kv_dtype_for(d, kv), compact, (ram, host)) for d in gpus
            ]
            yield Setup(desc, cfg, context, costs, [_budget(d, cfg) for d in gpus], compact)
        return
    groups = [gpus, gpus + cpus] if gpus and cpus and not cfg.use_all_devices else [gpus + cpus]
    for group in groups if spill else groups[:1]:
        for compact in (False, True):
            costs = [
                _pick_mode(desc, d, cfg, kv_dtype_for(d, cfg.engine.kv_dtype), compact)
                for d in group
            ]
            yield Setup(desc, cfg, context, costs, [_budget(d, cfg) for d in group], compact)


def _context(desc: ModelDesc, cfg: PlanConfig) -> int:
    model_ctx = desc.config.context_length
    if cfg.context is not None and cfg.context > model_ctx:
        raise PlanError(f"context {cfg.context} is longer than the model's {model_ctx} tokens")
    context = min(model_ctx, DEFAULT_CONTEXT_CAP) if cfg.context is None else cfg.context
    if cfg.prompt_len + cfg.output_len > context:
        raise PlanError(
            f"a prompt of {cfg.prompt_len} tokens and {cfg.output_len} of output need "
            f"{cfg.prompt_len + cfg.output_len} tokens of context; the plan's context is {context}"
        )
    return context


def place(desc: ModelDesc, devices: list[DeviceProfile], cfg: PlanConfig) -> Plan:
    if not devices:
        raise PlanError("no devices to plan for")
    ids = [d.id for d in devices]
    if len(set(ids)) != len(ids):
        raise PlanError(f"a device is listed twice: {', '.join(ids)}")
    context = _context(desc, cfg)
    ram = ram_expert_layers(desc, cfg, devices)
    if ram:
        host = expert_host([d for d in devices if d.is_cpu])
        check_ram(desc, host, ram, _budget(host, cfg))
    if may_move_experts(desc, devices, cfg):
        found, last = experts_or_layers(
            desc.n_layers, lambda n, spill=True: _place_with(desc, devices, cfg, context, n, spill)
        )
    else:
        found, last = _place_with(desc, devices, cfg, context, ram)
    if found is not None:
        return found
    raise PlanError(explain(last))


def _place_with(
    desc: ModelDesc,
    devices: list[DeviceProfile],
    cfg: PlanConfig,
    context: int,
    ram: int,
    spill: bool = True,
) -> tuple[Plan | None, Setup | None]:
    """The fastest plan that fits with the experts of the first `ram` layers in RAM (None),
    and the last setup tried (for the refusal's numbers); spill: the CPUs may take the last
    layers when the GPUs cannot hold them."""
    last: Setup | None = None
    for setup in _attempts(desc, devices, cfg, context, ram, spill):
        last = setup
        host = setup.costs[0].expert_host
        if host is not None and setup.costs[0].ram_expert_bytes() > _budget(host.dev, cfg):
            return None, last  # the RAM cannot hold them either
        n_dev, n = len(setup.costs), desc.n_layers
        split = search(
            n_dev, n, cfg.concurrency, setup.fits, setup.stage_s, cfg.use_all_devices,
            1 if cfg.in_process else None,
        )  # fmt: skip
        if split is not None:
            return _build(*_without_idle_shares(setup, split), devices), last
    return None, last


def _without_idle_shares(setup: Setup, split: Split) -> tuple[Setup, Split]:
    """The search priced each stage with every share of its GPU contending (`contention`), also
    those it then left without layers. When it left one idle beside a used share of the same
    card, search again without the idle devices: the stages are priced as they will run."""
    used = [i for i, (a, b) in enumerate(split.ranges) if b > a]
    costs, budgets = [setup.costs[i] for i in used], [setup.budgets[i] for i in used]
    narrowed = replace(setup, costs=costs, budgets=budgets, _prefix={})
    if [setup.contention[i] for i in used] == narrowed.contention:
        return setup, split
    cfg, n_dev = setup.config, len(narrowed.costs)
    again = search(
        n_dev, setup.desc.n_layers, cfg.concurrency, narrowed.fits, narrowed.stage_s,
        max_micro=1 if cfg.in_process else None,
    )  # fmt: skip
    return (narrowed, again) if again is not None else (setup, split)


def place_split(
    desc: ModelDesc,
    devices: list[DeviceProfile],
    cfg: PlanConfig,
    ranges: list[tuple[int, int]],
    weights: list[str] | None = None,
) -> Plan:
    """The plan of a split given by hand (device i holds layers ranges[i] = [start, end)), in a
    weights mode per device (None: each device's fastest): the planner's numbers for a split it
    did not choose, to hold a measured pipeline against. Whether it fits is not checked."""
    context = _context(desc, cfg)
    costs = []
    for i, d in enumerate(devices):
        kv = kv_dtype_for(d, cfg.engine.kv_dtype)
        if weights is None or weights[i] == "auto":
            costs.append(_pick_mode(desc, d, cfg, kv, False))
        else:
            costs.append(DeviceCost(desc, d, weights[i], kv, not cfg.engine.enforce_eager,
                                    cfg.engine.scheduler.max_num_seqs))  # fmt: skip
    setup = Setup(desc, cfg, context, costs, [_budget(d, cfg) for d in devices])
    micro = 1 if cfg.in_process else min(cfg.concurrency, len(ranges))
    m = -(-cfg.concurrency // micro)
    times = [setup.stage_s(i, a, b, m) for i, (a, b) in enumerate(ranges)]
    cycle = max(sum(times), micro * max(times))
    return _build(setup, Split(tuple(ranges), micro, m, cycle), devices)


def _stage(setup: Setup, i: int, a: int, b: int, m: int) -> StagePlan:
    c, cfg = setup.costs[i], setup.config
    dev, last = c.dev, b == setup.desc.n_layers
    layout = PoolLayout.of(setup.desc.config, range(a, b))  # a window model's: kv_pool.py
    per_block = kv_token_bytes(setup.desc, c.kv_dtype) * layout.n_slots * cfg.engine.block_size
    left = setup.budgets[i] - setup.base_bytes(i, a, b)
    room = int(max(left, 0) * cfg.engine.kv_memory_fraction // per_block) - layout.null_block
    room = max(room, 0)
    dominant = max(
        (t for layer in setup.desc.layers[a:b] for t in layer if t.is_matrix),
        key=lambda t: t.nbytes,
    )
    kernels = {"qlinear": dev.matmul_rate(c.weights, dominant.ggml_type).kernel}
    for op in ("paged_attention", "kv_write"):
        kernels[op] = dev.kernels.get(op, "torch")
    return StagePlan(
        device=dev.id,
        layer_start=a,
        layer_end=b,
        num_kv_blocks=room,
        kv_dtype=c.kv_dtype,
        weights=c.weights,
        kernels=kernels,
        predicted_step_s=setup.stage_s(i, a, b, m),
        name=dev.name,
        bus_id=dev.bus_id,
        has_embedding=a == 0,
        has_head=last,
        weight_bytes=int(c.weights_bytes(a, b, a == 0, last)),
        activation_bytes=int(
            c.activation_bytes(
                cfg.engine.scheduler.max_num_batched_tokens, cfg.engine.scheduler.max_num_seqs, last
            )
            + setup.offload_scratch(i, b)
        ),
        memory_budget=int(setup.budgets[i]),
        kv_room_blocks=room,
        weights_reason=_reason(setup, i),
        single_step_s=setup.stage_s(i, a, b, 1, overlap=False),  # one stream: stages take turns
        prefill_s=setup.prefill_s(i, a, b, cfg.prompt_len),
        base_device=base_device(dev.id),
        mps_percentage=round(dev.sm_share * 100) if dev.sm_share < 1.0 else None,
        memory_cap=dev.memory_cap,
    )


def _build(setup: Setup, split: Split, devices: list[DeviceProfile]) -> Plan:
    cfg, desc = setup.config, setup.desc
    used = [(i, a, b) for i, (a, b) in enumerate(split.ranges) if b > a]
    stages = [_stage(setup, i, a, b, split.m) for i, a, b in used]
    blocks = min(s.kv_room_blocks for s in stages)
    stages = [_with_blocks(s, blocks, desc, cfg) for s in stages]
    per_seq = seq_blocks(desc, setup.context, cfg.engine)
    used_ids = {s.device for s in stages}
    return Plan(
        model=desc.name,
        n_layers=desc.n_layers,
        stages=tuple(stages),
        concurrency=cfg.concurrency,
        context=setup.context,
        prompt_len=cfg.prompt_len,
        output_len=cfg.output_len,
        block_size=cfg.engine.block_size,
        microbatches=split.micro,
        single_stream_tok_s=1.0 / sum(s.single_step_s for s in stages),
        aggregate_tok_s=cfg.concurrency / split.cycle_s,
        ttft_s=sum(s.prefill_s for s in stages),
        ttft_burst_s=setup.burst_ttft_s(used, split.micro),
        max_context=_max_context(desc, blocks // cfg.concurrency, cfg),
        max_concurrency=blocks // per_seq,
        model_path=desc.source,
        unused_devices=tuple(
            d.id for d in devices if d.id not in used_ids and d.id != _host_id(setup)
        ),
        notes=_notes(stages, devices, cfg, _host_id(setup)) + _offload_note(setup, used),
        in_process=cfg.in_process,
        experts_in_ram=setup.costs[0].ram_experts,
        expert_device=_host_id(setup),
        expert_ram_bytes=int(setup.costs[0].ram_expert_bytes()),
        expert_bytes=desc.expert_bytes(),
    )


def _host_id(setup: Setup) -> str:
    host = setup.costs[0].expert_host
    return "" if host is None or not setup.costs[0].ram_experts else host.dev.id


def _with_blocks(s: StagePlan, blocks: int, desc: ModelDesc, cfg: PlanConfig) -> StagePlan:
    slots = kv_layer_slots(desc, s.layer_start, s.layer_end)
    per_block = kv_token_bytes(desc, s.kv_dtype) * slots * cfg.engine.block_size
    return replace(s, num_kv_blocks=blocks, kv_bytes=blocks * per_block)


def _max_context(desc: ModelDesc, blocks: int, cfg: PlanConfig) -> int:
    """The longest context (at most the model's) whose sequence holds at most `blocks`."""
    bs, longest = cfg.engine.block_size, desc.config.context_length
    lo, hi = 0, -(-longest // bs)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if seq_blocks(desc, mid * bs, cfg.engine) <= blocks else (lo, mid - 1)
    return min(longest, lo * bs)


def _offload_note(setup: Setup, used: list[tuple[int, int, int]]) -> tuple:
    """Where a CPU stage's prompt-sized layer goes when its matmuls stream to a GPU (in one
    process): the first such layer at the prompt length, part by part."""
    n = setup.config.prompt_len
    for i, a, b in used:
        j = setup.offload_to(i, n)
        if j is not None and b > a:
            parts = setup.offloaded_parts(i, j, a, n, 0, 1)
            ms = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in parts.items())
            dev = setup.costs[j].dev.id
            return (f"a {n}-token prompt's CPU layer with its matmuls on {dev}: "
                    f"{sum(parts.values()) * 1e3:.2f} ms ({ms} ms)",)  # fmt: skip
    return ()


def _notes(
    stages: list[StagePlan], devices: list[DeviceProfile], cfg: PlanConfig, host: str = ""
) -> tuple:
    notes = []
    measured = {d.id for d in devices if d.source != "datasheet"}  # spec#2 is another card
    shared = sorted({s.base_device for s in stages if "#" in s.device and s.device in measured})
    if shared:
        notes.append(
            f"{', '.join(shared)} runs more than one stage: they share it, and each stage's "
            "predicted time assumes it alone"
        )
    on_cpu = {d.id for d in devices if d.is_cpu}
    kinds = {s.device in on_cpu for s in stages}
    if kinds == {True, False} and not cfg.use_all_devices:  # the CPU took layers not asked of it
        notes.append("the GPUs cannot hold the model with its KV: the last layers run on the CPU")
    unused = [d.id for d in devices if d.id not in {s.device for s in stages} and d.id != host]
    if unused and cfg.concurrency == 1:
        notes.append(
            f"{', '.join(unused)} unused: one stream is fastest on the fewest devices that hold "
            "it (a pipeline only adds hand-offs); a higher --concurrency may use them"
        )
    asked = {s.kv_dtype for s in stages}
    if cfg.engine.kv_dtype in ("auto", "fp8") and "fp16" in asked:
        notes.append("fp16 KV where the device has no FP8 hardware (CPU, CUDA below 8.9)")
    return tuple(notes)
