"""One stage's step, independent of sockets: per-sequence state, plan validation, the forward
pass over the paged cache, and (last stage) logits and sampling. The worker loop and the
in-process tests both drive this."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from sarathi_proto import stage_pb2

from stage_worker.attention import AttentionBackend, AttentionMetadata, SeqSlice
from stage_worker.attention.base import build_metadata
from stage_worker.cuda_graphs import DecodeGraphs
from stage_worker.errors import PlanError
from stage_worker.kv_cache import KVCache
from stage_worker.models import StageModel
from stage_worker.sampler import SamplingSpec, make_generator, sample

logger = logging.getLogger(__name__)


@dataclass
class SeqState:
    """What a worker remembers about a sequence between steps."""

    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingSpec
    generator: torch.Generator | None = field(default=None, repr=False)


@dataclass
class PreparedStep:
    batch_id: int
    meta: AttentionMetadata
    token_ids: torch.Tensor | None
    """[num_tokens] int64 on stage 0; None elsewhere."""
    sample_rows: list[int]
    """Rows of the step's tokens whose next token is sampled (chunks with yields_token)."""
    sample_seq_ids: list[int]


class StageRunner:
    def __init__(
        self,
        model: StageModel,
        kv_cache: KVCache,
        attention: AttentionBackend,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.graphs = graphs
        """Decode steps replayed from CUDA graphs (None: every step runs eagerly)."""
        self.seqs: dict[int, SeqState] = {}

    def prepare(self, plan: stage_pb2.StepPlan) -> PreparedStep:
        """Applies the plan's bookkeeping and builds the step's metadata. Raises PlanError,
        leaving every sequence's state and the cache as they were, for a plan naming an unknown
        sequence, a block beyond the cache, or positions that do not continue the sequence."""
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        self._validate(plan)
        device = self.model.device
        for s in plan.seqs:
            if s.HasField("sampling"):
                spec = SamplingSpec(
                    s.sampling.temperature, s.sampling.top_p, s.sampling.top_k, s.sampling.seed
                )
                gen = make_generator(spec.seed, device) if self.model.shard.is_last else None
                self.seqs[s.seq_id] = SeqState([], 0, spec, gen)
        slices: list[SeqSlice] = []
        sample_rows: list[int] = []
        sample_seq_ids: list[int] = []
        start = 0
        for s in plan.seqs:
            state = self.seqs[s.seq_id]
            state.block_ids.extend(s.new_block_ids)
            state.num_computed_tokens = s.first_position + s.num_tokens
            slices.append(
                SeqSlice(start, s.num_tokens, state.num_computed_tokens, tuple(state.block_ids))
            )
            start += s.num_tokens
            if s.yields_token:
                sample_rows.append(start - 1)
                sample_seq_ids.append(s.seq_id)
        token_ids = None
        if self.model.shard.is_first:
            ids = [t for s in plan.seqs for t in s.token_ids]
            token_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        meta = build_metadata(slices, self.kv_cache.block_size, device)
        return PreparedStep(plan.batch_id, meta, token_ids, sample_rows, sample_seq_ids)

    def _validate(self, plan: stage_pb2.StepPlan) -> None:
        bs, num_blocks = self.kv_cache.block_size, self.kv_cache.num_blocks
        seen: set[int] = set()
        for s in plan.seqs:
            if s.seq_id in seen:
                raise PlanError(f"batch {plan.batch_id}: sequence {s.seq_id} appears twice")
            seen.add(s.seq_id)
            state = None if s.HasField("sampling") else self.seqs.get(s.seq_id)
            if state is None and not s.HasField("sampling"):
                raise PlanError(f"batch {plan.batch_id}: unknown sequence {s.seq_id}")
            bad = [b for b in s.new_block_ids if b >= num_blocks]
            if bad:
                raise PlanError(
                    f"batch {plan.batch_id}: sequence {s.seq_id} names block {bad[0]}, beyond the "
                    f"cache of {num_blocks} blocks"
                )
            computed = state.num_computed_tokens if state else 0
            num_blocks_after = (len(state.block_ids) if state else 0) + len(s.new_block_ids)
            if s.first_position != computed or s.num_tokens < 1:
                raise PlanError(
                    f"batch {plan.batch_id}: sequence {s.seq_id} chunk at position "
                    f"{s.first_position} with {s.num_tokens} tokens; expected position {computed}"
                )
            if (s.first_position + s.num_tokens) > num_blocks_after * bs:
                raise PlanError(
                    f"batch {plan.batch_id}: sequence {s.seq_id} needs "
                    f"{s.first_position + s.num_tokens} KV slots, has {num_blocks_after * bs}"
                )
            if self.model.shard.is_first and len(s.token_ids) != s.num_tokens:
                raise PlanError(
                    f"batch {plan.batch_id}: sequence {s.seq_id} has {len(s.token_ids)} token "
                    f"ids for a chunk of {s.num_tokens}"
                )

    @torch.inference_mode()
    def forward(self, step: PreparedStep, hidden_in: torch.Tensor | None) -> torch.Tensor:
        """-> hidden [num_tokens, hidden]; hidden_in is the previous stage's output (stage > 0)."""
        inputs = step.token_ids if hidden_in is None else hidden_in
        assert inputs is not None, "stage 0 needs token ids"
        if self.graphs is not None and self.graphs.accepts(step.meta):
            return self.graphs.run(step.meta, inputs)
        return self.model(inputs, step.meta, self.kv_cache, self.attention)

    @torch.inference_mode()
    def logits(self, step: PreparedStep, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage: [num_sampled, vocab] float32 at the rows that yield a token."""
        rows = torch.tensor(step.sample_rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def sample(self, step: PreparedStep, logits: torch.Tensor) -> list[tuple[int, int]]:
        """-> (seq_id, token_id) in plan order."""
        states = [self.seqs[i] for i in step.sample_seq_ids]
        gens = [s.generator for s in states]
        assert all(g is not None for g in gens), "generators live on the last stage"
        tokens = sample(logits, [s.sampling for s in states], gens)  # type: ignore[arg-type]
        return list(zip(step.sample_seq_ids, tokens, strict=True))
