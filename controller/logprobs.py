"""Log-probabilities of output tokens, as the last stage reports them (StepResult's packed
columns) and as both APIs hand them on."""

from __future__ import annotations

from typing import NamedTuple

from sarathi_proto import stage_pb2


class TokenLogprobs(NamedTuple):
    logprob: float
    """The token's own log-probability."""
    top_token_ids: tuple[int, ...]
    """The most likely tokens at its position, most likely first."""
    top_logprobs: tuple[float, ...]


def decode_logprobs(result: stage_pb2.StepResult) -> dict[int, TokenLogprobs]:
    """seq_id -> its token's log-probabilities, for the sequences that asked."""
    out: dict[int, TokenLogprobs] = {}
    start = 0
    ids, values = result.top_token_ids, result.top_logprobs
    for row, logprob, count in zip(
        result.logprob_rows, result.logprobs, result.top_counts, strict=True
    ):
        end = start + count
        out[result.seq_ids[row]] = TokenLogprobs(
            logprob, tuple(ids[start:end]), tuple(values[start:end])
        )
        start = end
    return out


def decode_prompt_logprobs(result: stage_pb2.StepResult) -> dict[int, dict[int, TokenLogprobs]]:
    """seq_id -> prompt position -> that prompt token's log-probabilities."""
    out: dict[int, dict[int, TokenLogprobs]] = {}
    for chunk in result.prompt_logprobs:
        k = chunk.top_k
        entries = out.setdefault(chunk.seq_id, {})
        for i, logprob in enumerate(chunk.logprobs):
            ids = tuple(chunk.top_token_ids[i * k : (i + 1) * k])
            values = tuple(chunk.top_logprobs[i * k : (i + 1) * k])
            entries[chunk.first_position + i] = TokenLogprobs(logprob, ids, values)
    return out
