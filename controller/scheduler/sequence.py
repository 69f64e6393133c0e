"""The sequence record: one per request, with num_computed_tokens as its one progress counter."""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field
from typing import Protocol

from controller.scheduler.errors import InvalidRequestError
from controller.scheduler.request_bounds import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    SEED_END,
    check_in,
)


class RosterColumns(Protocol):
    """The decode roster's per-slot columns a decoding Sequence reads and writes through its
    properties (decode_roster.DecodeRoster has them); a protocol, so that the roster imports
    this module and not the other way round."""

    py_computed: array[int]
    py_num_tokens: array[int]
    py_inflight: array[int]
    py_last_token_time: array[float]
    py_last_token: array[int]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks (new, or preempted for recompute)
    RUNNING = "running"  # admitted: holds KV blocks; may be in flight or paused between steps
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # a stop token id (end of sequence) or a stop string
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # its step failed on a worker, alone (quarantine.py)


@dataclass(frozen=True)
class SamplingParams:
    """How the last stage picks the next token; validated here so nothing bad gets queued."""

    temperature: float = 0.0
    """In [0, 2]; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """0 disables top-k."""
    seed: int = 0
    """Per-request generator seed."""
    top_logprobs: int | None = None
    """None: no log-probabilities; k: each token's and its k most likely alternatives."""
    presence_penalty: float = 0.0
    """OpenAI's, in [-2, 2]: subtracted from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """OpenAI's, in [-2, 2]: subtracted once per time a token is already in the output."""
    repetition_penalty: float = 1.0
    """vLLM's (CTRL's), in (0, 2]: the logits of tokens in the prompt or output are divided by
    it (multiplied where negative); 1 is off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in [-100, 100]) added to that token's logit."""
    min_tokens: int = 0
    """The stop tokens cannot be sampled before this many output tokens."""
    grammar: str | None = None
    """Structured output: an llguidance grammar (controller/grammar.py) the output must match."""
    prompt_logprobs: int | None = None
    """None, or the prompt tokens' log-probabilities with this many alternatives (echo)."""

    @property
    def needs_history(self) -> bool:
        """The last stage adjusts this request's logits before sampling (penalties, bias,
        min_tokens, a grammar), counting from its tokens so far."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.grammar is not None
            or self.prompt_logprobs is not None
        )

    def __post_init__(self) -> None:
        """The bounds of request_bounds.py; each float's also refuses NaN and infinity."""
        check_in("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        check_in("top_k", self.top_k, 0, MAX_TOP_K)
        if not 0 <= self.seed < SEED_END:
            raise InvalidRequestError("seed", f"must be in [0, 2**64), got {self.seed}")
        check_in("presence_penalty", self.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        check_in("frequency_penalty", self.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        check_in(
            "repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY,
            low_open=True,
        )  # fmt: skip
        for token_id, bias in self.logit_bias:
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise InvalidRequestError(
                    "logit_bias",
                    f"bias {bias} for token {token_id} is outside "
                    f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]",
                )
        if self.min_tokens < 0:
            raise InvalidRequestError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.prompt_logprobs is not None:
            check_in("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs is not None:
            check_in("logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)


@dataclass(frozen=True)
class RequestParams:
    """Per-request limits the scheduler enforces itself."""

    max_tokens: int
    """Most tokens to generate."""
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    """Generation ends after any of these (the engine adds end-of-sequence unless ignore_eos)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)


class Sequence:
    """One request's state in the scheduler.

    `num_computed_tokens` counts the tokens whose KV is computed or being computed by a micro-batch
    in flight; it catches up with `num_tokens` (prompt plus output). Prefill, chunked prefill,
    decode and recompute after preemption are all the same rule: schedule the tokens in between.

    While the sequence decodes, the scheduler's decode roster holds `num_computed_tokens`,
    `num_inflight_batches` and `last_token_time` (see decode_roster.py); the properties below
    read and write whichever holds them.
    """

    __slots__ = (
        "_admit_no",
        "_last_token_time",
        "_num_computed_tokens",
        "_num_inflight_batches",
        "_roster",
        "_slot",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "finish_reason",
        "first_scheduled_time",
        "first_token_time",
        "max_tokens",
        "needs_worker_state",
        "num_named_blocks",
        "num_preemptions",
        "num_step_faults",
        "output_token_ids",
        "params",
        "prompt_token_ids",
        "seq_id",
        "status",
        "stop_token_ids",
    )

    def __init__(
        self, seq_id: int, prompt_token_ids: list[int], params: RequestParams, arrival_time: float
    ) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        # Copies of hot fields, read once per step per sequence.
        self.max_tokens = params.max_tokens
        self.stop_token_ids = params.stop_token_ids
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self._num_computed_tokens = 0
        self._num_inflight_batches = 0
        self._last_token_time: float | None = None
        self._roster: RosterColumns | None = None
        self._slot = -1
        self._admit_no = -1  # the scheduler's admission counter, set when admitted
        self.block_ids: list[int] = []
        # Prefix caching (prefix_cache.py): the names of its leading full blocks of tokens so far
        # (they stay right across preemption), and how many of block_ids are named or offered.
        self.block_hashes: list[bytes] = []
        self.num_named_blocks = 0
        # True until the workers have seen this sequence's first chunk (again after a preemption).
        self.needs_worker_state = True
        self.num_preemptions = 0
        self.num_step_faults = 0
        """Micro-batches it was in whose step failed on a worker (quarantine.py)."""
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus max_tokens: the sequence finishes by length when num_tokens reaches it."""
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def num_computed_tokens(self) -> int:
        roster = self._roster
        if roster is None:
            return self._num_computed_tokens
        return roster.py_computed[self._slot]

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        roster = self._roster
        if roster is None:
            self._num_computed_tokens = value
        else:
            roster.py_computed[self._slot] = value

    @property
    def num_inflight_batches(self) -> int:
        roster = self._roster
        if roster is None:
            return self._num_inflight_batches
        return roster.py_inflight[self._slot]

    @num_inflight_batches.setter
    def num_inflight_batches(self, value: int) -> None:
        roster = self._roster
        if roster is None:
            self._num_inflight_batches = value
        else:
            roster.py_inflight[self._slot] = value

    @property
    def last_token_time(self) -> float | None:
        roster = self._roster
        if roster is None:
            return self._last_token_time
        return roster.py_last_token_time[self._slot]

    @last_token_time.setter
    def last_token_time(self, value: float) -> None:
        roster = self._roster
        if roster is None:
            self._last_token_time = value
        else:
            roster.py_last_token_time[self._slot] = value

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        roster = self._roster
        if roster is not None:
            roster.py_num_tokens[self._slot] += 1
            roster.py_last_token[self._slot] = token_id

    @property
    def is_decoding(self) -> bool:
        """Its next work is one token that yields the next one (prompt fully computed)."""
        return self.num_uncomputed_tokens == 1 and bool(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt followed by output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, computed={self.num_computed_tokens}"
            f"/{self.num_tokens}, out={len(self.output_token_ids)}/{self.params.max_tokens})"
        )
