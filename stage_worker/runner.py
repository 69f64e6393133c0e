"""One stage's step, independent of sockets: per-sequence state, plan validation, the forward
pass over the paged cache, and (last stage) logits and sampling. The worker loop and the
in-process tests both drive this."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

import torch
from sarathi_proto import stage_pb2

from stage_worker.attention import AttentionBackend, AttentionMetadata, SeqSlice
from stage_worker.attention.base import build_metadata
from stage_worker.cuda_graphs import DecodeGraphs
from stage_worker.errors import PlanError
from stage_worker.grammar import GrammarState, load_tokenizer, masked
from stage_worker.kv_cache import KVCache
from stage_worker.models import StageModel
from stage_worker.penalties import PenaltySpec, PenaltyState, adjusted
from stage_worker.sampler import SamplingSpec, TokenLogprobs, sample, token_logprobs

logger = logging.getLogger(__name__)


@dataclass
class SeqState:
    """What a worker remembers about a sequence between steps."""

    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingSpec
    penalties: PenaltyState | None = None
    """Last stage, for a request with penalties, logit bias or min_tokens."""
    grammar: GrammarState | None = None
    """Last stage, for a request with structured output."""
    prompt_token_ids: list[int] | None = None
    """Last stage, for a request that wants its prompt's log-probabilities (echo)."""
    prompt_top_k: int = 0
    last_sampled: int = -1
    """The stage that both embeds and samples (PP = 1): the token it sampled for the sequence
    last, the input of a decode that goes ahead (ScheduledSeq.ahead); -1 before the first."""


@dataclass
class PreparedStep:
    batch_id: int
    meta: AttentionMetadata
    token_ids: torch.Tensor | None
    """[num_tokens] int64 on stage 0; None elsewhere."""
    sample_rows: list[int]
    """Rows of the step's tokens whose next token is sampled (chunks with yields_token)."""
    sample_seq_ids: list[int]
    prompt_chunks: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(seq id, first row, first position, tokens) of the chunks whose prompt log-probabilities
    are wanted (last stage)."""


class StageRunner:
    def __init__(
        self,
        model: StageModel,
        kv_cache: KVCache,
        attention: AttentionBackend,
        graphs: DecodeGraphs | None = None,
        model_dir: str = "",
    ) -> None:
        """model_dir: where the last stage finds tokenizer.json for structured output."""
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.graphs = graphs
        """Decode steps replayed from CUDA graphs (None: every step runs eagerly)."""
        self.seqs: dict[int, SeqState] = {}
        self.model_dir = model_dir

    def prepare(self, plan: stage_pb2.StepPlan) -> PreparedStep:
        """Applies the plan's bookkeeping and builds the step's metadata. Raises PlanError,
        leaving every sequence's state and the cache as they were, for a plan naming an unknown
        sequence, a block beyond the cache, or positions that do not continue the sequence.
        The step's order: plan.seqs[:decodes_at], the decode columns, the other seqs."""
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        self._validate(plan)
        if plan.copy_from_blocks:
            self.kv_cache.copy_blocks(list(plan.copy_from_blocks), list(plan.copy_to_blocks))
        device = self.model.device
        for s in plan.seqs:
            if s.HasField("sampling"):
                sp = s.sampling
                top_logprobs = sp.top_logprobs if sp.HasField("top_logprobs") else -1
                spec = SamplingSpec(sp.temperature, sp.top_p, sp.top_k, sp.seed, top_logprobs)
                # A forked sequence (n > 1) starts past the prompt positions it shares.
                state = SeqState([], s.first_position, spec, self._penalties(sp), self._grammar(sp))
                if sp.HasField("prompt_logprobs") and self.model.shard.is_last:
                    state.prompt_token_ids = list(sp.prompt_token_ids)
                    state.prompt_top_k = sp.prompt_logprobs
                self.seqs[s.seq_id] = state
        step = _StepBuilder(self.seqs, self.model.shard.is_first)
        at = plan.decodes_at
        step.add_seqs(plan.seqs[:at])
        step.add_decodes(plan.decodes)
        step.add_seqs(plan.seqs[at:])
        token_ids = None
        if self.model.shard.is_first:
            token_ids = torch.tensor(step.token_ids, dtype=torch.int64, device=device)
        meta = build_metadata(step.slices, self.kv_cache.block_size, device)
        return PreparedStep(
            plan.batch_id,
            meta,
            token_ids,
            step.sample_rows,
            step.sample_seq_ids,
            step.prompt_chunks,
        )

    def _penalties(self, params: stage_pb2.SamplingParams) -> PenaltyState | None:
        spec = PenaltySpec.from_proto(params)
        if not (spec.active and self.model.shard.is_last):
            return None
        return PenaltyState(
            spec,
            self.model.spec.vocab_size,
            self.model.device,
            list(params.prompt_token_ids),
            list(params.output_token_ids),
        )

    def _grammar(self, params: stage_pb2.SamplingParams) -> GrammarState | None:
        if not (params.grammar and self.model.shard.is_last):
            return None
        tokenizer = load_tokenizer(self.model_dir)
        return GrammarState(tokenizer, params.grammar, list(params.output_token_ids))

    def _validate(self, plan: stage_pb2.StepPlan) -> None:
        seen: set[int] = set()
        for s in plan.seqs:
            self._validate_chunk(
                plan.batch_id, s.seq_id, s.first_position, s.num_tokens, list(s.new_block_ids),
                len(s.token_ids), s.HasField("sampling"), seen, s.ahead,
            )  # fmt: skip
        self._validate_decodes(plan, seen)
        copies = (plan.copy_from_blocks, plan.copy_to_blocks)
        if len(copies[0]) != len(copies[1]):
            raise PlanError(f"batch {plan.batch_id}: block copies of different lengths")
        bad = [b for b in (*copies[0], *copies[1]) if b >= self.kv_cache.num_blocks]
        if bad:
            raise PlanError(
                f"batch {plan.batch_id}: a block copy names block {bad[0]}, beyond the cache of "
                f"{self.kv_cache.num_blocks} blocks"
            )

    def _validate_decodes(self, plan: stage_pb2.StepPlan, seen: set[int]) -> None:
        d, batch_id = plan.decodes, plan.batch_id
        num = len(d.seq_ids)
        at = list(d.new_block_at)
        if len(d.positions) != num or len(at) != len(d.new_block_ids):
            raise PlanError(f"batch {batch_id}: decode columns of different lengths")
        if any(i >= num for i in at) or any(a >= b for a, b in pairwise(at)):
            raise PlanError(f"batch {batch_id}: decode new_block_at not ascending within {num}")
        if plan.decodes_at > len(plan.seqs):
            raise PlanError(f"batch {batch_id}: decodes_at {plan.decodes_at} past the seqs")
        if self.model.shard.is_first and len(d.token_ids) != num:
            raise PlanError(f"batch {batch_id}: {len(d.token_ids)} token ids for {num} decodes")
        ahead_at = list(d.ahead_at)
        if any(i >= num for i in ahead_at) or any(a >= b for a, b in pairwise(ahead_at)):
            raise PlanError(f"batch {batch_id}: decode ahead_at not ascending within {num}")
        new_blocks = dict(zip(at, d.new_block_ids, strict=True))
        ahead = set(ahead_at)
        for i, (seq_id, position) in enumerate(zip(d.seq_ids, d.positions, strict=True)):
            block = new_blocks.get(i)
            blocks = [] if block is None else [block]
            # A decode's token id is in the column (a 0 where it goes ahead).
            self._validate_chunk(batch_id, seq_id, position, 1, blocks, 1, False, seen, i in ahead)

    def _validate_chunk(
        self,
        batch_id: int,
        seq_id: int,
        first_position: int,
        num_tokens: int,
        new_block_ids: list[int],
        num_token_ids: int,
        is_new: bool,
        seen: set[int],
        ahead: bool = False,
    ) -> None:
        bs, num_blocks = self.kv_cache.block_size, self.kv_cache.num_blocks
        if seq_id in seen:
            raise PlanError(f"batch {batch_id}: sequence {seq_id} appears twice")
        seen.add(seq_id)
        state = None if is_new else self.seqs.get(seq_id)
        if state is None and not is_new:
            raise PlanError(f"batch {batch_id}: unknown sequence {seq_id}")
        bad = [b for b in new_block_ids if b >= num_blocks]
        if bad:
            raise PlanError(
                f"batch {batch_id}: sequence {seq_id} names block {bad[0]}, beyond the "
                f"cache of {num_blocks} blocks"
            )
        # A new sequence may start past 0: a forked one's earlier positions are in shared or
        # copied blocks, which its block table (all in this chunk) must cover.
        computed = state.num_computed_tokens if state else first_position
        num_blocks_after = (len(state.block_ids) if state else 0) + len(new_block_ids)
        if first_position != computed or num_tokens < 1:
            raise PlanError(
                f"batch {batch_id}: sequence {seq_id} chunk at position "
                f"{first_position} with {num_tokens} tokens; expected position {computed}"
            )
        if (first_position + num_tokens) > num_blocks_after * bs:
            raise PlanError(
                f"batch {batch_id}: sequence {seq_id} needs "
                f"{first_position + num_tokens} KV slots, has {num_blocks_after * bs}"
            )
        if ahead:
            self._validate_ahead(batch_id, seq_id, num_tokens, state)
        elif self.model.shard.is_first and num_token_ids != num_tokens:
            raise PlanError(
                f"batch {batch_id}: sequence {seq_id} has {num_token_ids} token "
                f"ids for a chunk of {num_tokens}"
            )

    def _validate_ahead(
        self, batch_id: int, seq_id: int, num_tokens: int, state: SeqState | None
    ) -> None:
        """A decode that goes ahead takes the token this worker sampled last: only a stage
        that embeds and samples has it, and only once it has sampled one for the sequence."""
        shard = self.model.shard
        if not (shard.is_first and shard.is_last):
            raise PlanError(
                f"batch {batch_id}: sequence {seq_id} goes ahead on stage {shard.stage}, which "
                "does not both embed and sample"
            )
        if num_tokens != 1 or state is None or state.last_sampled < 0:
            raise PlanError(
                f"batch {batch_id}: sequence {seq_id} goes ahead with no token sampled for it "
                "(or as more than one decode)"
            )

    @torch.inference_mode()
    def forward(self, step: PreparedStep, hidden_in: torch.Tensor | None) -> torch.Tensor:
        """-> hidden [num_tokens, hidden]; hidden_in is the previous stage's output (stage > 0)."""
        inputs = step.token_ids if hidden_in is None else hidden_in
        assert inputs is not None, "stage 0 needs token ids"
        if self.graphs is not None:
            hidden = self.graphs.run(step.meta, inputs)
            if hidden is not None:
                return hidden
        return self.model(inputs, step.meta, self.kv_cache, self.attention)

    @torch.inference_mode()
    def logits(self, step: PreparedStep, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage: [num_sampled, vocab] float32 at the rows that yield a token."""
        rows = torch.tensor(step.sample_rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def sample(self, step: PreparedStep, logits: torch.Tensor) -> list[tuple[int, int]]:
        """-> (seq_id, token_id) in plan order."""
        states = [self.seqs[i] for i in step.sample_seq_ids]
        # The sampled token's position: right after the tokens this step computed.
        positions = [s.num_computed_tokens for s in states]
        processed = adjusted(logits, [s.penalties for s in states])
        # logits stay as they are for the log-probabilities: copy once, whichever adjusts first.
        processed = masked(processed, [s.grammar for s in states], copy=processed is logits)
        tokens = sample(processed, [s.sampling for s in states], positions)
        for state, token in zip(states, tokens, strict=True):
            state.last_sampled = token
            if state.penalties is not None:
                state.penalties.observe(token)
            if state.grammar is not None:
                state.grammar.observe(token)
        return list(zip(step.sample_seq_ids, tokens, strict=True))

    def logprobs(
        self, step: PreparedStep, logits: torch.Tensor, tokens: list[int]
    ) -> list[TokenLogprobs | None]:
        """Per sampled row, its token's log-probabilities where its sequence asked (else None)."""
        counts = [self.seqs[i].sampling.top_logprobs for i in step.sample_seq_ids]
        if max(counts, default=-1) < 0:
            return [None] * len(tokens)
        return token_logprobs(logits, tokens, counts)


def prompt_logprobs(
    runner: StageRunner, step: PreparedStep, hidden: torch.Tensor
) -> list[tuple[int, int, list[TokenLogprobs]]]:
    """Last stage: (seq id, first position, entries) per chunk that wants them. Row j of a chunk
    starting at position p predicts the token at p + j + 1; only prompt tokens are scored."""
    out = []
    with torch.inference_mode():
        for chunk in step.prompt_chunks:
            entry = _chunk_prompt_logprobs(runner, hidden, *chunk)
            if entry is not None:
                out.append(entry)
    return out


def _chunk_prompt_logprobs(
    runner: StageRunner, hidden: torch.Tensor, seq_id: int, first_row: int, first_position: int,
    num_tokens: int,
) -> tuple[int, int, list[TokenLogprobs]] | None:  # fmt: skip
    state = runner.seqs[seq_id]
    prompt = state.prompt_token_ids
    assert prompt is not None
    targets = prompt[first_position + 1 : first_position + num_tokens + 1]
    if not targets:
        return None  # the chunk predicts output tokens only (a recompute's tail)
    rows = hidden[first_row : first_row + len(targets)]  # [len(targets), hidden]
    logits = runner.model.compute_logits(rows)  # [len(targets), vocab]
    entries = token_logprobs(logits, targets, [state.prompt_top_k] * len(targets))
    return seq_id, first_position + 1, [e for e in entries if e is not None]


class _StepBuilder:
    """The step's flat token batch, chunk after chunk, applied to the sequences' state."""

    def __init__(self, seqs: dict[int, SeqState], with_token_ids: bool) -> None:
        self.seqs = seqs
        self.with_token_ids = with_token_ids
        self.slices: list[SeqSlice] = []
        self.sample_rows: list[int] = []
        self.sample_seq_ids: list[int] = []
        self.prompt_chunks: list[tuple[int, int, int, int]] = []
        self.token_ids: list[int] = []
        self.num_tokens = 0

    def add_seqs(self, chunks: Iterable[stage_pb2.ScheduledSeq]) -> None:
        for s in chunks:
            state = self.seqs[s.seq_id]
            state.block_ids.extend(s.new_block_ids)
            state.num_computed_tokens = s.first_position + s.num_tokens
            blocks = tuple(state.block_ids)
            self.slices.append(
                SeqSlice(self.num_tokens, s.num_tokens, state.num_computed_tokens, blocks)
            )
            if state.prompt_token_ids is not None:
                self.prompt_chunks.append(
                    (s.seq_id, self.num_tokens, s.first_position, s.num_tokens)
                )
            self.num_tokens += s.num_tokens
            if s.yields_token:
                self.sample_rows.append(self.num_tokens - 1)
                self.sample_seq_ids.append(s.seq_id)
            if not self.with_token_ids:
                continue
            if s.ahead:
                self.token_ids.append(state.last_sampled)
            else:
                self.token_ids.extend(s.token_ids)

    def add_decodes(self, d: stage_pb2.DecodeColumns) -> None:
        """One token each, every one yielding: read as columns."""
        seq_ids = list(d.seq_ids)
        new_blocks = dict(zip(d.new_block_at, d.new_block_ids, strict=True))
        first_row = self.num_tokens
        seqs, slices = self.seqs, self.slices
        for i, (seq_id, position) in enumerate(zip(seq_ids, d.positions, strict=True)):
            state = seqs[seq_id]
            block = new_blocks.get(i)
            if block is not None:
                state.block_ids.append(block)
            state.num_computed_tokens = position + 1
            slices.append(SeqSlice(first_row + i, 1, position + 1, tuple(state.block_ids)))
        self.num_tokens += len(seq_ids)
        self.sample_rows.extend(range(first_row, self.num_tokens))
        self.sample_seq_ids.extend(seq_ids)
        if self.with_token_ids:
            start = len(self.token_ids)
            self.token_ids.extend(d.token_ids)
            for i in d.ahead_at:
                self.token_ids[start + i] = seqs[seq_ids[i]].last_sampled
