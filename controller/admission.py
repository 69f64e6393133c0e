"""Admission control: a bounded queue in front of the scheduler, and refusals while it is down.

Past the bound a request is refused at once (gRPC RESOURCE_EXHAUSTED, HTTP 429) with a retry
hint, so overload never turns into requests that hang or a controller whose memory grows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from controller.scheduler import ConfigError


class WhileDown(enum.Enum):
    """What new requests get while a stage is down and the pipeline is being rebuilt."""

    HOLD = "hold"  # queued (within the admission bound) and served once the pipeline is back
    FAIL = "fail"  # refused at once with UNAVAILABLE (HTTP 503)


@dataclass(frozen=True)
class AdmissionConfig:
    max_queued_requests: int = 1024
    """Most requests waiting for admission (holding no KV blocks); more are refused."""
    max_queued_prompt_tokens: int = 1 << 20
    """Most prompt tokens waiting for admission; a request that would exceed it is refused
    (unless the queue is empty: one long prompt alone is always accepted)."""
    retry_after_s: float = 1.0
    """The retry hint sent with a refusal, in seconds."""
    while_down: WhileDown = WhileDown.HOLD
    """New requests while a stage is down: hold them or fail them with UNAVAILABLE."""

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1:
            raise ConfigError("max_queued_requests", self.max_queued_requests, "at least 1")
        if self.max_queued_prompt_tokens < 1:
            raise ConfigError(
                "max_queued_prompt_tokens", self.max_queued_prompt_tokens, "at least 1"
            )
        if not 0.0 < self.retry_after_s <= 3600.0:
            raise ConfigError("retry_after_s", self.retry_after_s, "in (0, 3600]")


class AdmissionError(Exception):
    """A request refused before anything was queued; `retry_after_s` is the hint to clients."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFullError(AdmissionError):
    """The admission queue is at its bound (RESOURCE_EXHAUSTED / HTTP 429)."""


class PipelineDownError(AdmissionError):
    """A stage is down and the controller fails new requests (UNAVAILABLE / HTTP 503)."""


def check_admission(
    config: AdmissionConfig,
    num_queued: int,
    num_queued_prompt_tokens: int,
    num_prompt_tokens: int,
    pipeline_up: bool,
) -> None:
    """Raises an AdmissionError when a request of num_prompt_tokens must be refused now."""
    if not pipeline_up and config.while_down is WhileDown.FAIL:
        raise PipelineDownError(
            "a pipeline stage is down; the pipeline is being rebuilt", config.retry_after_s
        )
    if num_queued >= config.max_queued_requests:
        raise QueueFullError(
            f"the admission queue holds {num_queued} requests (max_queued_requests="
            f"{config.max_queued_requests}); retry in {config.retry_after_s:g} s",
            config.retry_after_s,
        )
    queued_tokens = num_queued_prompt_tokens + num_prompt_tokens
    if num_queued and queued_tokens > config.max_queued_prompt_tokens:
        raise QueueFullError(
            f"the admission queue holds {num_queued_prompt_tokens} prompt tokens; "
            f"{num_prompt_tokens} more exceed max_queued_prompt_tokens="
            f"{config.max_queued_prompt_tokens}; retry in {config.retry_after_s:g} s",
            config.retry_after_s,
        )


def overload_reason(config: AdmissionConfig, num_queued: int, num_queued_prompt_tokens: int) -> str:
    """Why the admission queue refuses requests of any size right now (it is at a bound); empty
    while it admits them. The bounds are check_admission's."""
    if num_queued >= config.max_queued_requests:
        return f"{num_queued} requests queued (max_queued_requests={config.max_queued_requests})"
    if num_queued and num_queued_prompt_tokens >= config.max_queued_prompt_tokens:
        return (
            f"{num_queued_prompt_tokens} prompt tokens queued "
            f"(max_queued_prompt_tokens={config.max_queued_prompt_tokens})"
        )
    return ""
