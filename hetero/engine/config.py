"""Frozen configuration of the engine core: the scheduler's limits and the KV block layout.

The number of KV blocks is found at run time (it depends on the devices' free memory), so it
lives in the Plan and reaches the block manager as an argument, never through these configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# KV cache storage: auto (below), fp8 (e4m3 with a float32 scale per token and KV head), fp16,
# bf16, fp32 (exact, for tests).
KV_DTYPES = ("auto", "fp8", "fp16", "bf16", "fp32")
SPECULATIVE_MODES = ("auto", "ngram", "draft", "off")
OVERLAP_MODES = ("auto", "on", "off")  # EngineConfig.overlap_schedule


def kv_dtype_rule(asked: str, on_cpu: bool, fp8_hardware: bool) -> str:
    """The KV dtype a device stores for the asked one: the one rule the engine's pools, every
    pipeline stage and the planner follow.

    auto: fp8 where the device converts e4m3 in hardware (CUDA compute capability 8.9+), fp16
    elsewhere. On a CPU fp8 costs more than it saves: decode attention over it measured 2.3x
    slower per layer than over fp16 at one stream and 6x at 16 streams, whole steps 1.3-1.5x
    slower; fp32 took the same step time as fp16 at twice the memory (BENCHMARKS.md). fp8 asked
    of a GPU without e4m3 hardware stores fp16 (its Triton kernels cannot convert e4m3); a CPU
    stores fp8 in software when asked (slower, half the memory).
    """
    if asked not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {asked!r}")
    if asked == "auto" or (asked == "fp8" and not on_cpu):
        return "fp8" if fp8_hardware else "fp16"
    return asked


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    max_num_seqs: requests running at once (each holds KV blocks and a row of every decode).
    max_num_batched_tokens: the token budget of one step, decodes and prefill chunks together;
        a long prompt is cut into chunks that fit what the running decodes leave of it.
    long_prefill_token_threshold: the most tokens one prompt may take in one step (0: no cap but
        the budget); a cap lets several new prompts make progress side by side instead of the
        oldest one taking the whole budget.
    max_model_len: the longest sequence (prompt + output) the model serves; a request reaching it
        finishes with reason "length" (None: only max_tokens and the pool size bound it).
    admit_wait_ms: while decodes run, a new prompt waits until the oldest waiting one has waited
        this long (or enough wait to take every free seat), so prompts arriving a few ms apart
        are prefilled in one step instead of one step each. On CUDA a step with more prompt
        tokens than cuda_graph_max_tokens runs eagerly and costs several decode steps (TGI's
        max_waiting_tokens batches arrivals for the same reason); through HTTP on an H200,
        waiting measured slower (BENCHMARKS.md). 0: admit at once. Preempted requests never
        wait.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None
    admit_wait_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.admit_wait_ms >= 0:
            raise ValueError(f"admit_wait_ms must be >= 0, got {self.admit_wait_ms}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        # Every running request may need its decode token in one step: with fewer tokens than
        # sequences some decodes would have to wait, which the scheduler promises never happens.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running decode fits in one step"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 disables the cap), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine core is built from, besides the model and the Plan.

    block_size: tokens per KV block (the unit of allocation, sharing and prefix caching).
    enable_prefix_caching: reuse the KV of full blocks whose tokens (and all tokens before them)
        an earlier request already computed.
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_dtype: str = "auto"  # one of KV_DTYPES (kv_dtype_rule says what auto stands for)
    kv_memory_fraction: float = 0.9  # of the memory free after the weights, for the KV pool
    num_kv_blocks: int | None = None  # an upper bound on the pool, whatever memory is free
    seed: int | None = None  # for requests without a seed of their own
    # speculative decoding (engine/spec/): "ngram" guesses tokens from n-grams of the request
    # and of earlier requests, "draft" runs draft_model; each request stops speculating while
    # its guesses are rejected too often. "auto" (where it pays): ngram while at most
    # SPEC_AUTO_MAX_DECODES requests decode (past that the batch keeps the device busy and
    # guess rows cost real compute: 0.8x measured at 16 streams on a CPU); on CUDA the verify
    # steps replay the decode graphs (cuda_graph.py) and a request must average enough accepted
    # guesses to pay for the costlier step (spec/__init__.py)
    speculative: str = "auto"
    num_speculative_tokens: int = 8  # the most tokens proposed per request and step
    draft_model: str | None = None  # a small GGUF with the target's vocabulary
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly (cuda_graph.py)
    # steps with prompt chunks replay graphs too, up to this many rows (decodes + prompt tokens)
    # and within cuda_graph.PROMPT_ROW_CONTEXT; 0: decode steps only
    cuda_graph_max_tokens: int = 512
    # lower KV tiers (kv_tiers.py): host RAM in GiB (None: with a GPU half the free RAM, at
    # most 16 GiB, leaving 8 free; 0 on a CPU, whose pool is in RAM already), and an optional
    # disk directory capped at kv_disk_gb GiB (None: half the free space there)
    kv_ram_gb: float | None = None
    kv_disk_dir: str | None = None
    kv_disk_gb: float | None = None
    # steps each finished request reports in its timeline (engine/timeline.py), for request
    # traces (the server's --log-requests); 0: the phase sums only
    trace_steps: int = 0
    # overlapped steps (engine/overlap.py): the next step is submitted before this one's tokens
    # reach the host, hiding the host's work behind the device's (with n-gram speculation, while
    # no request has a guess); "auto": where the logits are on a GPU and no draft model guesses;
    # "on" also on a CPU (for tests: nothing runs there to hide)
    overlap_schedule: str = "auto"

    @property
    def prompt_graph_rows(self) -> int:
        """Rows of the largest graph for steps with prompt tokens (within a step's budget)."""
        return min(self.cuda_graph_max_tokens, self.scheduler.max_num_batched_tokens)

    def __post_init__(self) -> None:
        self._check_speculative()
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}"
            )
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.overlap_schedule not in OVERLAP_MODES:
            raise ValueError(
                f"overlap_schedule must be one of {', '.join(OVERLAP_MODES)}, "
                f"got {self.overlap_schedule!r}"
            )
        if self.overlap_schedule == "on" and self.speculative == "draft":
            raise ValueError(
                "overlap_schedule 'on' does not run with speculative 'draft' (whether a draft "
                "model has guesses costs its forward pass to find out)"
            )
        if self.trace_steps < 0:
            raise ValueError(f"trace_steps must be >= 0, got {self.trace_steps}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        for name in ("kv_ram_gb", "kv_disk_gb"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.kv_disk_gb is not None and self.kv_disk_dir is None:
            raise ValueError("kv_disk_gb needs kv_disk_dir (the directory of the disk tier)")

    def _check_speculative(self) -> None:
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, "
                f"got {self.speculative!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError(
                "speculative 'draft' needs draft_model (--draft-model small.gguf), and "
                "draft_model is used only with speculative 'draft'"
            )
