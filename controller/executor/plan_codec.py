"""MicroBatch <-> protobuf: the only place the scheduler's records meet the wire format."""

from __future__ import annotations

from sarathi_proto import stage_pb2

from controller.scheduler import MicroBatch, SamplingParams
from controller.scheduler.batch import TokenHistory


def encode_plan(batch: MicroBatch, with_token_ids: bool) -> stage_pb2.StepPlan:
    """The StepPlan for one micro-batch. Only stage 0 embeds tokens, so only its plan carries
    token ids (with_token_ids); later stages receive activations instead. The decode block goes
    as packed columns; other chunks as one record each."""
    plan = stage_pb2.StepPlan(batch_id=batch.batch_id, finished_seq_ids=batch.finished_seq_ids)
    if batch.block_copies:
        plan.copy_from_blocks.extend(src for src, _ in batch.block_copies)
        plan.copy_to_blocks.extend(dst for _, dst in batch.block_copies)
    add = plan.seqs.add
    for chunk in batch.other_chunks:
        seq = add(
            seq_id=chunk.seq_id,
            first_position=chunk.first_position,
            num_tokens=chunk.num_tokens,
            yields_token=chunk.yields_token,
            new_block_ids=chunk.new_block_ids,
            ahead=chunk.ahead,
        )
        if with_token_ids:
            seq.token_ids.extend(chunk.token_ids)
        if chunk.sampling is not None:
            seq.sampling.CopyFrom(encode_sampling(chunk.sampling, chunk.history))
    block = batch.decodes
    if block is not None:
        plan.decodes_at = batch.decodes_at
        columns = plan.decodes
        columns.seq_ids.extend(block.seq_ids)
        columns.positions.extend(block.positions.tolist())
        columns.new_block_at.extend(block.new_block_at)
        columns.new_block_ids.extend(block.new_block_ids)
        if with_token_ids:
            columns.token_ids.extend(block.tokens)
        columns.ahead_at.extend(block.ahead_at)
    return plan


def encode_sampling(s: SamplingParams, history: TokenHistory | None) -> stage_pb2.SamplingParams:
    params = stage_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
        top_logprobs=s.top_logprobs,
    )  # fmt: skip
    if history is not None:  # penalties: their settings and the tokens they count from
        params.presence_penalty = s.presence_penalty
        params.frequency_penalty = s.frequency_penalty
        params.repetition_penalty = s.repetition_penalty
        params.logit_bias_token_ids.extend(t for t, _ in s.logit_bias)
        params.logit_bias_values.extend(b for _, b in s.logit_bias)
        params.min_tokens = s.min_tokens
        params.stop_token_ids.extend(sorted(history.stop_token_ids))
        params.prompt_token_ids.extend(history.prompt_token_ids)
        params.output_token_ids.extend(history.output_token_ids)
        params.grammar = s.grammar or ""
        if s.prompt_logprobs is not None:
            params.prompt_logprobs = s.prompt_logprobs
    return params


def decode_result(result: stage_pb2.StepResult) -> dict[int, int]:
    """seq_id -> sampled token id, as Scheduler.on_result takes it."""
    return dict(zip(result.seq_ids, result.token_ids, strict=True))


def encode_plan_messages(batch: MicroBatch) -> tuple[bytes, bytes]:
    """The serialized ControllerMessage of a micro-batch for stage 0 (with token ids) and for
    every later stage (without)."""
    first = stage_pb2.ControllerMessage(plan=encode_plan(batch, with_token_ids=True))
    rest = stage_pb2.ControllerMessage(plan=encode_plan(batch, with_token_ids=False))
    return first.SerializeToString(), rest.SerializeToString()
