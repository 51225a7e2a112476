"""The engine core: schedule -> run -> sample -> update, one step at a time, over token ids.

Text lives at the edges (engine/output.py and the server); here everything is integer ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hetero.config import RuntimeConfig, bind_device
from hetero.engine.block_manager import BlockManager
from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.engine.cuda_graph import capture_decode_graphs, graph_rows
from hetero.engine.json_mask import Constraints
from hetero.engine.kv_cache import (
    KVPool,
    PoolSize,
    block_bytes,
    cpu_pool_need,
    resolve_kv_dtype,
    size_pool,
)
from hetero.engine.kv_tiered import build_tiers
from hetero.engine.request import Request
from hetero.engine.runner import ModelRunner
from hetero.engine.scheduler import Scheduler
from hetero.engine.spec import make_speculator
from hetero.engine.spec.speculator import fit_rows
from hetero.engine.spec.verify import accept_rows, expand_rows
from hetero.gguf_loader import GGUFModel
from hetero.model.llama import LlamaModel, load_model
from hetero.models import resolve_model
from hetero.sampling import Sampler, SamplingParams, make_batch


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens and their logprobs, best first


@dataclass
class StepOutput:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


class Engine:
    def __new__(cls, model: str | None = None, config: EngineConfig | None = None, *args, **kw):
        # One way to ask for a pipeline: the same constructor, with stages in the config.
        if cls is Engine and config is not None and config.pipeline.enabled:
            from hetero.dist.engine import PipelineEngine

            cls = PipelineEngine
        return super().__new__(cls)

    def __init__(
        self,
        model: str | None = None,
        config: EngineConfig | None = None,
        runtime: RuntimeConfig | None = None,
        progress: bool = False,
        loaded: tuple[GGUFModel, LlamaModel] | None = None,
    ):
        """`loaded`: a model already in memory (from load_model), shared instead of reloaded."""
        from hetero.tokenizer import Tokenizer

        self.config = config or EngineConfig()
        # a model already loaded names its own file (no default model needed beside it)
        self.model_path = resolve_model(model) if loaded is None or model else loaded[0].path
        if loaded is None:
            loaded = load_model(self.model_path, runtime or RuntimeConfig(), progress=progress)
        self.gguf, self.model = loaded
        self.runtime = self.model.runtime
        bind_device(self.runtime.device)
        self.model_config = self.gguf.config
        self.tokenizer = Tokenizer.from_gguf(self.gguf.reader)
        self.kv_dtype = resolve_kv_dtype(self.config.kv_dtype, self.runtime.device)
        self.params: dict[str, SamplingParams] = {}
        # before the pool is sized: a draft model's weights and KV come out of the same memory
        self.spec = make_speculator(self)  # None when speculative decoding is off
        self.pool_size = self._size_pool()
        cfg = self.config
        self.pool = KVPool(
            self.model_config,
            len(self.model.layer_range),
            self.pool_size.num_blocks,
            cfg.block_size,
            self.kv_dtype,
            self.runtime.device,
        )
        self.kv_tiers = build_tiers(
            cfg,
            self.pool,
            self.pool_size.block_bytes,
            self.runtime.device,
            self.model_path,
            self.model.layer_range,
        )
        self.block_manager = BlockManager(
            self.pool_size.num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            tiers=None if self.kv_tiers is None else self.kv_tiers.tiers,
        )
        self.scheduler = Scheduler(self._scheduler_config(), self.block_manager)
        self.runner = ModelRunner(self.model, self.pool)
        if not cfg.enforce_eager and self.runtime.device.startswith("cuda"):
            sc = self.scheduler.config
            k = 0 if self.spec is None else cfg.num_speculative_tokens
            rows = graph_rows(sc.max_num_seqs, sc.max_num_batched_tokens, k)
            graphs = capture_decode_graphs(
                self.model, self.pool, rows, self.max_model_len, cfg.prompt_graph_rows
            )
            self.runner.graphs = graphs
            if graphs is not None and graphs.buckets[-1] > graphs.max_batch:  # prompt graphs
                self.scheduler.graph_rows = graphs.buckets[-1]
        self.sampler = Sampler(cfg.seed)
        self.constraints = Constraints(self.tokenizer, self.model_config.vocab_size)
        self.stats = EngineStats()

    def _scheduler_config(self) -> SchedulerConfig:
        sched = self.config.scheduler
        if sched.max_model_len is None:
            sched = SchedulerConfig(**{**sched.__dict__, "max_model_len": self.max_model_len})
        return sched

    def close(self) -> None:
        """Release what the engine started (pipeline stage processes); nothing in-process."""

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len or self.model_config.context_length

    def _size_pool(self) -> PoolSize:
        cfg = self.config
        need = cpu_pool_need(self.max_model_len, cfg.scheduler.max_num_seqs, cfg.block_size)
        return size_pool(
            self.model_config,
            len(self.model.layer_range),
            cfg.block_size,
            self.kv_dtype,
            self.runtime.device,
            cfg.kv_memory_fraction,
            cfg.num_kv_blocks,
            need,
        )

    def describe_kv(self) -> str:
        """The pool, and what a block costs in each KV dtype (reported at start)."""
        n = len(self.model.layer_range)
        costs = ", ".join(
            f"{d} {block_bytes(self.model_config, n, self.config.block_size, d) / 1024:.1f} KiB"
            for d in ("fp8", "fp16", "bf16")
        )
        tiers = "" if self.kv_tiers is None else f"; {self.kv_tiers.plan.describe()}"
        name = self._kv_dtype_name()
        cpu = ""
        if self.runtime.device == "cpu":  # the thread count chosen, and the kernels' ISA
            from hetero.kernels import cpu_threads

            cpu = f"; {cpu_threads.describe()}"
        return f"{self.pool_size.describe(name)}; one block costs {costs}{tiers}{cpu}"

    def _kv_dtype_name(self) -> str:
        if self.config.kv_dtype != "auto":
            return self.kv_dtype
        return f"{self.kv_dtype}, auto for {self.runtime.device}"

    def save_kv_cache(self) -> int:
        """Write the named KV blocks to the disk tier for the next start (0 without one)."""
        return 0 if self.kv_tiers is None else self.kv_tiers.persist(self.block_manager)

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.params:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                f"{self.max_model_len} tokens (room is needed for at least one output token)"
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        req = Request(request_id, prompt_ids, params, eos_token_id=self.tokenizer.eos_ids)
        self.scheduler.add(req)
        self.params[request_id] = params
        self.constraints.add(request_id, params)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks (no-op for an unknown or finished one)."""
        found = self.scheduler.abort(request_id)
        self.params.pop(request_id, None)
        if self.spec is not None:
            self.spec.forget(request_id)
        self.constraints.drop(request_id)
        return found

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        bind_device(self.runtime.device)  # steps may run on another thread than the load
        guesses = self._guesses()
        tiered = self.kv_tiers
        if tiered is not None:
            tiered.before_schedule(self.block_manager)
        out = self.scheduler.schedule(guesses)
        if tiered is not None:
            tiered.after_schedule()  # offloads and restores the schedule queued
        results: dict[str, StepOutput] = {}
        for req in out.finished:  # failed by the scheduler (e.g. cannot fit)
            results[req.request_id] = self._final(req)
        if out.scheduled:
            t0 = time.perf_counter()
            logits, producing = self.runner.run(out)
            sampled = self._sample(logits, producing, results)
            before = {s.req.request_id: len(s.req.output_ids) for s in producing}
            finished = self.scheduler.update(out, sampled)
            for s in producing:
                if s.spec_ids:  # a stop among accepted guesses drops the tokens after it
                    o = results[s.req.request_id]
                    kept = len(s.req.output_ids) - before[s.req.request_id]
                    del o.new_token_ids[kept:]
                    if o.logprobs is not None:
                        del o.logprobs[kept:]
            self.stats.record(out, time.perf_counter() - t0, self.runner.replayed)
            if self.spec is not None:
                self.spec.observe(out, sampled, finished)
            if tiered is not None:
                tiered.observe_step(out.num_batched_tokens, time.perf_counter() - t0)
            for req in finished:
                results[req.request_id].finished = True
                results[req.request_id].finish_reason = req.finish_reason
                self.params.pop(req.request_id, None)
                self.constraints.drop(req.request_id)
        elif tiered is not None:  # only requests waiting for restores: wait, do not spin
            tiered.idle(self.block_manager)
        return list(results.values())

    def _sample(self, logits, producing, results) -> dict[str, list[int]]:
        """Sample every logits row (one per request, 1 + k for one that speculated) and keep
        each request's accepted tokens (spec/verify.py); returns request id -> tokens."""
        if not producing:
            return {}
        reqs = [s.req for s in producing]
        params = [self.params[r.request_id] for r in reqs]
        rows = expand_rows(reqs, [s.spec_ids for s in producing], params)
        row_ids = [r.request_id for r, (lo, hi) in zip(reqs, rows.spans) for _ in range(lo, hi)]
        state = make_batch(
            rows.params,
            rows.prompts,
            rows.outputs,
            rows.steps,
            logits.device,
            self.constraints.masks(row_ids),  # constrained requests never guess: one row each
        )
        ids, lps, tops = sampled_lists(self.sampler(logits, state))
        if self.spec is None:
            accepted = accept_rows(producing, rows.spans, ids)
        else:
            accepted = self.spec.accept(producing, rows.spans, ids, logits, state, self.sampler)
        sampled = {}
        for s, p, (lo, hi), tokens in zip(producing, params, rows.spans, accepted):
            req = s.req
            sampled[req.request_id] = tokens
            for token in tokens:  # a completed JSON object ends its request now
                req.stop_now = self.constraints.accept(req.request_id, token)
            o = results[req.request_id] = StepOutput(
                req.request_id,
                list(tokens),
                None,
                False,
                None,
                req.num_prompt_tokens,
                req.num_cached_tokens,
            )
            if p.logprobs is not None:
                o.logprobs = [
                    TokenLogprob(
                        t,
                        lps[i] if t == ids[i] else float(logits[i].log_softmax(-1)[t]),
                        [] if tops is None else list(zip(tops[0][i], tops[1][i]))[: p.logprobs],
                    )
                    for i, t in zip(range(lo, hi), tokens)
                ]
        return sampled

    def _guesses(self) -> dict[str, list[int]] | None:
        """Speculative tokens of the decoding requests (none for JSON-constrained ones, whose
        mask follows the grammar one accepted token at a time)."""
        if self.spec is None:
            return None
        decoding = self.scheduler.decoding()
        limit = self.spec.max_decodes
        if limit is not None and len(decoding) > limit:
            return None  # "auto": a full batch keeps the device busy without guesses
        free = [r for r in decoding if not self.constraints.has(r.request_id)]
        guesses = self.spec.propose(free)
        graphs = self.runner.graphs
        if graphs is None:
            return guesses
        # a step of more rows than the largest graph would run eagerly (several times slower)
        return fit_rows(guesses, graphs.buckets[-1] - len(decoding))

    def _final(self, req: Request) -> StepOutput:
        self.params.pop(req.request_id, None)
        self.constraints.drop(req.request_id)
        return StepOutput(
            req.request_id,
            [],
            None,
            True,
            req.finish_reason,
            req.num_prompt_tokens,
            req.num_cached_tokens,
            req.error,
        )

    def cached_prompt_tokens(self, request_id: str) -> int:
        req = self.scheduler.get(request_id)
        return 0 if req is None else req.num_cached_tokens


def sampled_lists(so) -> tuple[list[int], list[float] | None, tuple[list, list] | None]:
    """A SamplerOutput as host lists: token ids, their logprobs, (top ids, top logprobs)."""
    ids = so.token_ids.tolist()
    lps = None if so.logprobs is None else so.logprobs.tolist()
    tops = None if so.top_ids is None else (so.top_ids.tolist(), so.top_logprobs.tolist())
    return ids, lps, tops


def token_output(req: Request, p: SamplingParams, i: int, ids, lps, tops) -> StepOutput:
    """The StepOutput of row i of a sampled step (with its logprobs when p asks for them)."""
    o = StepOutput(
        req.request_id, [ids[i]], None, False, None, req.num_prompt_tokens, req.num_cached_tokens
    )
    if p.logprobs is not None:
        top = [] if tops is None else list(zip(tops[0][i], tops[1][i]))[: p.logprobs]
        o.logprobs = [TokenLogprob(ids[i], lps[i], top)]
    return o


class EngineStats:
    """Counters the bench and the server's /metrics read.

    Decode-only steps are also counted apart, plain ones and verify ones (some request carried
    guesses; rows: tokens computed), so a benchmark can price a verify step against a plain one.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.busy_s = 0.0
        self.decode = [0, 0, 0.0]  # plain decode steps: steps, rows, seconds
        self.verify = [0, 0, 0.0]  # decode steps with guesses: steps, rows, seconds
        self.graphed = 0  # steps run through the CUDA graphs' static buffers (cuda_graph.py)

    def record(self, out, seconds: float, graphed: bool = False) -> None:
        self.steps += 1
        self.graphed += graphed
        self.tokens += out.num_batched_tokens
        self.busy_s += seconds
        sched = out.scheduled
        if all(s.produces_token and s.num_new_tokens == 1 + len(s.spec_ids) for s in sched):
            kind = self.verify if any(s.spec_ids for s in sched) else self.decode
            kind[0] += 1
            kind[1] += out.num_batched_tokens
            kind[2] += seconds
