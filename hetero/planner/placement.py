"""plan(): devices in pipeline order, a weights mode and KV dtype each, the split, the numbers.

GPUs come first in the order given, CPUs last: the CPU takes layers only when the GPUs cannot hold
the model with the asked KV (the last layers spill, as llama.cpp's -ngl does). Each device first
gets its fastest weights mode; when nothing fits, the most compact one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from hetero.config import GPU_WEIGHTS_MODES
from hetero.engine.config import kv_dtype_rule
from hetero.execution.cuda_graph import PROMPT_ROW_CONTEXT, chunk_row_context
from hetero.execution.paged_meta import ROW_TILE
from hetero.planner.burst import burst_first_tokens, prompt_chunks
from hetero.planner.cost import DeviceCost, hop_seconds, kv_token_bytes, transfer_seconds
from hetero.planner.device import DeviceProfile
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
from hetero.planner.shares import bandwidth_fraction, is_share, parse_share

# exact or nearly so (fp16: logits within 0.03); qdot where its kernel builds; int4/int8 opt-in
CPU_MODES = ("fp16", "dense")


def kv_dtype_for(dev: DeviceProfile, asked: str) -> str:
    """The KV dtype `dev` stores for the asked one: the engine's own rule (kv_dtype_rule)."""
    return kv_dtype_rule(asked, dev.is_cpu, dev.fp8_kv)


def _modes(dev: DeviceProfile, asked: str) -> tuple[str, ...]:
    if asked != "auto":
        return (asked,) if dev.is_cpu or asked in GPU_WEIGHTS_MODES else ("dense",)
    if not dev.is_cpu:
        return GPU_WEIGHTS_MODES
    return (("qdot",) if "qdot" in dev.matmul else ()) + CPU_MODES  # measured by the profile


@dataclass
class _Setup:
    """One attempt: the devices taking part and their costs."""

    desc: ModelDesc
    config: PlanConfig
    context: int
    costs: list[DeviceCost]
    budgets: list[float]
    _prefix: dict[tuple[int, int, bool], list[float]] = field(default_factory=dict)

    @property
    def ctx(self) -> float:  # average context a decode reads
        return self.config.prompt_len + self.config.output_len / 2

    def kv_need(self, i: int, n_layers: int) -> float:
        bs, c = self.config.engine.block_size, self.config
        tokens = -(-self.context // bs) * bs * c.concurrency
        per = kv_token_bytes(self.desc, self.costs[i].kv_dtype) * n_layers
        return tokens * per / c.engine.kv_memory_fraction

    def base_bytes(self, i: int, a: int, b: int) -> float:
        """Weights and activations of layers [a, b) on device i."""
        last, c = b == self.desc.n_layers, self.costs[i]
        act = c.activation_bytes(
            self.config.engine.scheduler.max_num_batched_tokens,
            self.config.engine.scheduler.max_num_seqs,
            last,
        )
        return c.weights_bytes(a, b, a == 0, last) + act

    def fits(self, i: int, a: int, b: int) -> bool:
        return self.base_bytes(i, a, b) + self.kv_need(i, b - a) <= self.budgets[i]

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
        t = c.step_seconds(b - a, work, c.eager(m, True), seqs=m) + hop_seconds(c.dev, a, b, n)
        if b < n and i + 1 < len(self.costs):
            t += transfer_seconds(c.dev, self.costs[i + 1].dev, m, self.desc.config.d_model)
        return t

    def _replays_prompt(self, i: int, n: int, cached: int, seqs: int) -> bool:
        """Whether a step of n prompt tokens (of `seqs` prompts, after `cached` tokens each)
        replays a CUDA graph on device i (cuda_graph.DecodeGraphs.fits)."""
        c = self.costs[i]
        if not c.graphs or c.dev.is_cpu or n > self.config.engine.cuda_graph_max_tokens:
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
        work = sum(c.prefill_layer_seconds(n, cached, rows)[a:b])
        work += c.head_seconds(rows) if last else 0.0
        if overlap:
            work *= self.contention[i]
        replay = self._replays_prompt(i, n, cached, rows)  # as a decode step's replay
        if replay:
            work += (b - a) * c.replay_layer_seconds(n)
        t = c.step_seconds(b - a, work, not replay, seqs=rows)
        t += hop_seconds(c.dev, a, b, self.desc.n_layers)
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


def _budget(dev: DeviceProfile, cfg: PlanConfig) -> float:
    margin = cfg.cpu_margin_bytes if dev.is_cpu else cfg.gpu_margin_bytes
    return dev.usable_memory * (1.0 - cfg.margin) - margin


def _pick_mode(desc: ModelDesc, dev: DeviceProfile, cfg: PlanConfig, kv: str, compact: bool):
    graphs = not cfg.engine.enforce_eager
    costs = [
        DeviceCost(desc, dev, m, kv, graphs, cfg.engine.scheduler.max_num_seqs)
        for m in _modes(dev, cfg.weights)
    ]
    if compact:
        return min(costs, key=lambda c: c.weights_bytes(0, desc.n_layers, True, True))
    return min(costs, key=lambda c: sum(c.decode_layer_seconds(1, cfg.prompt_len)))


def _attempts(desc: ModelDesc, devices: list[DeviceProfile], cfg: PlanConfig, context: int):
    gpus = [d for d in devices if not d.is_cpu]
    cpus = [d for d in devices if d.is_cpu]
    groups = [gpus, gpus + cpus] if gpus and cpus and not cfg.use_all_devices else [gpus + cpus]
    for group in groups:
        for compact in (False, True):
            costs = [
                _pick_mode(desc, d, cfg, kv_dtype_for(d, cfg.engine.kv_dtype), compact)
                for d in group
            ]
            yield _Setup(desc, cfg, context, costs, [_budget(d, cfg) for d in group])


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
    last: _Setup | None = None
    for setup in _attempts(desc, devices, cfg, context):
        last = setup
        n_dev, n = len(setup.costs), desc.n_layers
        split = search(n_dev, n, cfg.concurrency, setup.fits, setup.stage_s, cfg.use_all_devices)
        if split is not None:
            return _build(*_without_idle_shares(setup, split), devices)

    raise PlanError(explain(last))


def _without_idle_shares(setup: _Setup, split: Split) -> tuple[_Setup, Split]:
    """The search priced each stage with every share of its GPU contending (`contention`), also
    those it then left without layers. When it left one idle beside a used share of the same
    card, search again without the idle devices: the stages are priced as they will run."""
    used = [i for i, (a, b) in enumerate(split.ranges) if b > a]
    costs, budgets = [setup.costs[i] for i in used], [setup.budgets[i] for i in used]
    narrowed = replace(setup, costs=costs, budgets=budgets, _prefix={})
    if [setup.contention[i] for i in used] == narrowed.contention:
        return setup, split
    cfg, n_dev = setup.config, len(narrowed.costs)
    again = search(n_dev, setup.desc.n_layers, cfg.concurrency, narrowed.fits, narrowed.stage_s)
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
    setup = _Setup(desc, cfg, context, costs, [_budget(d, cfg) for d in devices])
    micro = min(cfg.concurrency, len(ranges))
    m = -(-cfg.concurrency // micro)
    times = [setup.stage_s(i, a, b, m) for i, (a, b) in enumerate(ranges)]
    cycle = max(sum(times), micro * max(times))
    return _build(setup, Split(tuple(ranges), micro, m, cycle), devices)


def _stage(setup: _Setup, i: int, a: int, b: int, m: int) -> StagePlan:
    c, cfg = setup.costs[i], setup.config
    dev, last = c.dev, b == setup.desc.n_layers
    per_block = kv_token_bytes(setup.desc, c.kv_dtype) * (b - a) * cfg.engine.block_size
    left = setup.budgets[i] - setup.base_bytes(i, a, b)
    room = int(max(left, 0) * cfg.engine.kv_memory_fraction // per_block)
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
        ),
        memory_budget=int(setup.budgets[i]),
        kv_room_blocks=room,
        single_step_s=setup.stage_s(i, a, b, 1, overlap=False),  # one stream: stages take turns
        prefill_s=setup.prefill_s(i, a, b, cfg.prompt_len),
        base_device=base_device(dev.id),
        mps_percentage=round(dev.sm_share * 100) if dev.sm_share < 1.0 else None,
        memory_cap=dev.memory_cap,
    )


def _build(setup: _Setup, split: Split, devices: list[DeviceProfile]) -> Plan:
    cfg, desc = setup.config, setup.desc
    used = [(i, a, b) for i, (a, b) in enumerate(split.ranges) if b > a]
    stages = [_stage(setup, i, a, b, split.m) for i, a, b in used]
    blocks = min(s.kv_room_blocks for s in stages)
    stages = [_with_blocks(s, blocks, desc, cfg) for s in stages]
    per_seq = -(-setup.context // cfg.engine.block_size)
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
        max_context=min(
            desc.config.context_length, blocks // cfg.concurrency * cfg.engine.block_size
        ),
        max_concurrency=blocks // per_seq,
        model_path=desc.source,
        unused_devices=tuple(d.id for d in devices if d.id not in used_ids),
        notes=_notes(stages, devices, cfg),
    )


def _with_blocks(s: StagePlan, blocks: int, desc: ModelDesc, cfg: PlanConfig) -> StagePlan:
    per_block = kv_token_bytes(desc, s.kv_dtype) * s.n_layers * cfg.engine.block_size
    return replace(s, num_kv_blocks=blocks, kv_bytes=blocks * per_block)


def _notes(stages: list[StagePlan], devices: list[DeviceProfile], cfg: PlanConfig) -> tuple:
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
    unused = [d.id for d in devices if d.id not in {s.device for s in stages}]
    if unused and cfg.concurrency == 1:
        notes.append(
            f"{', '.join(unused)} unused: one stream is fastest on the fewest devices that hold "
            "it (a pipeline only adds hand-offs); a higher --concurrency may use them"
        )
    asked = {s.kv_dtype for s in stages}
    if cfg.engine.kv_dtype in ("auto", "fp8") and "fp16" in asked:
        notes.append("fp16 KV where the device has no FP8 hardware (CPU, CUDA below 8.9)")
    return tuple(notes)
