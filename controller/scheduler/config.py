"""Typed, validated configuration of the scheduler and the KV-cache accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.scheduler.errors import ConfigError
from controller.scheduler.step_cost import StepCostModel

POLICY_NAMES = ("sarathi", "vllm", "orca", "request_level", "chunked_only")
# Policies that split prompts into chunks and so must keep every micro-batch within the budget.
CHUNKED_POLICIES = frozenset({"sarathi", "chunked_only"})


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache seen from the controller: how many blocks exist and how big each is."""

    block_size: int = 16
    """Tokens per KV-cache block; a power of two."""
    num_blocks: int = 4096
    """KV-cache blocks per worker (the minimum over all workers of the pipeline)."""
    watermark: float = 0.01
    """Share of blocks kept free when admitting new requests, so running decodes can grow."""
    prefix_caching: bool = True
    """Keep full KV blocks named by a hash of their prefix, so a new request computes only what
    follows its longest cached prefix (a shared system prompt, earlier turns)."""
    prefix_salt: str = ""
    """What besides the tokens makes the KV (the model): cached prefixes under another salt
    never match."""

    def __post_init__(self) -> None:
        if not _is_power_of_two(self.block_size):
            raise ConfigError("block_size", self.block_size, "a power of two >= 1")
        if self.num_blocks < 1:
            raise ConfigError("num_blocks", self.num_blocks, "at least 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError("watermark", self.watermark, "in [0, 1)")
        if not isinstance(self.prefix_caching, bool):
            raise ConfigError("prefix_caching", self.prefix_caching, "true or false")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may put into one micro-batch and how many may be in flight."""

    policy: str = "sarathi"
    """Batching policy: one of sarathi, vllm, orca, request_level, chunked_only."""
    budget_tokens: int = 512
    """Tokens per micro-batch. Chunked policies never exceed it; whole-prompt policies exceed it
    only with a single prompt longer than the budget (that prompt then runs alone)."""
    idle_budget_tokens: int = 0
    """Chunked policies with one micro-batch in flight (PP = 1): tokens per micro-batch while no
    sequence decodes. Nobody then waits between tokens, so TBT is not at stake, and a prompt goes
    in fewer, larger chunks: each step's fixed cost is paid fewer times before its first token.
    The chunk schedule and the time budget bound TBT and so do not apply then. 0 (the default):
    budget_tokens always. With PP > 1 it must be 0: a pipeline overlaps a prompt's chunks
    instead, and one large chunk would leave the other stages idle."""
    tile_tokens: int = 32
    """Matmul tile size; the budget must be a multiple of it (tile quantization, paper 4.3)."""
    max_num_seqs: int = 128
    """Most sequences admitted (holding KV blocks) at once."""
    max_model_len: int = 4096
    """Most tokens (prompt plus output) one sequence may reach."""
    pipeline_depth: int = 1
    """Micro-batches in flight at most: the number of pipeline stages (PP). With PP > 1 the
    decoding sequences are spread over the micro-batches in flight (BatchBuilder.add_decodes)."""
    decode_ahead: bool = False
    """With one stage (pipeline_depth 1): schedule each decoding sequence's next decode while
    its current one is still in flight, so the stage finds its next plan waiting when it
    finishes a step instead of idling while the controller applies the result and schedules
    (vLLM's async scheduling). The worker feeds such a decode the token it sampled for the
    sequence last; a token past a sequence's end (a stop token, a stop string) is computed and
    dropped. Two micro-batches are in flight then. With PP > 1 it must be off: the stage that
    samples is not the one that embeds."""
    pipeline_prefill_chunks: bool = True
    """Let a prompt's next chunk follow its previous chunk in the very next micro-batch, before
    that chunk has left the pipeline (stages run micro-batches in order). Off: wait for it."""
    spread_prompts: bool = True
    """With PP > 1 and chunks pipelined: prompt tokens too few to fill PP micro-batches are
    shared out over the next PP micro-batches (BatchBuilder.prompt_left) instead of filling one
    and leaving the next with decodes alone, which idles a stage for the difference
    (BENCHMARKS.md, issue 15). On by default since session 34: measured live, a prompt's new
    tokens past a shared prefix reach their first token sooner and decodes beside them wait
    less; on long prompts it rarely engages. With PP = 1, chunks not pipelined or the
    whole-prompt policies, it changes nothing."""
    chunk_schedule: tuple[tuple[int, int], ...] = field(default=())
    """Optional shrinking chunks for sarathi: (computed_tokens_at_least, max_chunk_tokens) pairs,
    ascending; a prompt that has computed that many tokens gets chunks of at most that size, since
    attention over a long context makes each later chunk dearer."""
    time_budget_s: float = 0.0
    """Chunked policies: fill each micro-batch up to this predicted stage time (step_cost) as
    well as up to budget_tokens; 0 (the default) budgets tokens only. Decodes are never held
    back for it; prompts always get at least one tile per micro-batch, so they progress."""
    step_cost: StepCostModel | None = None
    """The stage's cost profile the time budget predicts with."""
    tbt_slo_s: float = 0.0
    """The P99 TBT target the budgets were chosen for (SLO mode, controller/slo.py), reported in
    status; 0: none. The scheduler itself only follows the budgets."""

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ConfigError("policy", self.policy, f"one of {', '.join(POLICY_NAMES)}")
        if not _is_power_of_two(self.tile_tokens):
            raise ConfigError("tile_tokens", self.tile_tokens, "a power of two >= 1")
        if self.budget_tokens <= 0 or self.budget_tokens % self.tile_tokens:
            raise ConfigError(
                "budget_tokens",
                self.budget_tokens,
                f"a positive multiple of tile_tokens={self.tile_tokens}",
            )
        self._check_idle_budget()
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", self.max_num_seqs, "at least 1")
        if self.policy in CHUNKED_POLICIES and self.max_num_seqs > self.budget_tokens:
            # Every running decode must fit into one micro-batch, or decodes would stall.
            raise ConfigError(
                "max_num_seqs",
                self.max_num_seqs,
                f"at most budget_tokens={self.budget_tokens} for policy {self.policy}",
            )
        if self.max_model_len < 2:
            raise ConfigError("max_model_len", self.max_model_len, "at least 2")
        if self.pipeline_depth < 1:
            raise ConfigError("pipeline_depth", self.pipeline_depth, "at least 1")
        if self.decode_ahead and self.pipeline_depth > 1:
            why = f"false with pipeline_depth={self.pipeline_depth} (no stage embeds and samples)"
            raise ConfigError("decode_ahead", self.decode_ahead, why)
        previous = -1
        for computed, chunk in self.chunk_schedule:
            if computed <= previous:
                raise ConfigError(
                    "chunk_schedule", self.chunk_schedule, "strictly ascending thresholds"
                )
            if chunk <= 0 or chunk % self.tile_tokens:
                raise ConfigError(
                    "chunk_schedule",
                    self.chunk_schedule,
                    f"chunk sizes positive multiples of tile_tokens={self.tile_tokens}",
                )
            previous = computed
        if not (self.time_budget_s >= 0 and self.time_budget_s < float("inf")):
            raise ConfigError("time_budget_s", self.time_budget_s, "seconds >= 0 (0: off)")
        if not self.tbt_slo_s >= 0:
            raise ConfigError("tbt_slo_s", self.tbt_slo_s, "seconds >= 0 (0: none)")
        if self.time_budget_s and self.step_cost is None:
            raise ConfigError("step_cost", None, "a StepCostModel when time_budget_s > 0")

    def _check_idle_budget(self) -> None:
        idle = self.idle_budget_tokens
        if not idle:
            return
        if self.policy not in CHUNKED_POLICIES:
            why = f"0 for policy {self.policy} (it does not chunk prompts)"
            raise ConfigError("idle_budget_tokens", idle, why)
        if self.pipeline_depth > 1:
            why = f"0 with pipeline_depth={self.pipeline_depth} (a pipeline overlaps the chunks)"
            raise ConfigError("idle_budget_tokens", idle, why)
        if idle < self.budget_tokens or idle % self.tile_tokens:
            raise ConfigError(
                "idle_budget_tokens",
                idle,
                f"0, or a multiple of tile_tokens={self.tile_tokens} "
                f"and at least budget_tokens={self.budget_tokens}",
            )

    @property
    def max_inflight_batches(self) -> int:
        """Micro-batches in flight at most: one per stage, and one more queued at the only
        stage when decodes go ahead."""
        return self.pipeline_depth + int(self.decode_ahead)

    def max_chunk_tokens(self, num_computed_tokens: int, idle: bool = False) -> int:
        """Largest chunk a prompt may take next, given how far its prefill has come; idle (no
        sequence decodes, idle_budget_tokens set): the idle budget, since the chunk schedule
        bounds TBT, which is not at stake then."""
        if idle:
            return self.idle_budget_tokens
        limit = self.budget_tokens
        for computed, chunk in self.chunk_schedule:
            if num_computed_tokens < computed:
                break
            limit = chunk
        return limit
