"""The Sarathi scheduler core: pure and deterministic (no torch, zmq, grpc, clock or env)."""

from controller.scheduler.batch import MicroBatch, ScheduledChunk
from controller.scheduler.block_manager import BlockManager
from controller.scheduler.config import CacheConfig, SchedulerConfig
from controller.scheduler.errors import ConfigError, InvalidRequestError
from controller.scheduler.policies import make_policy, policy_names
from controller.scheduler.scheduler import Scheduler
from controller.scheduler.sequence import (
    FinishReason,
    RequestParams,
    SamplingParams,
    Sequence,
    SequenceStatus,
)

__all__ = [
    "BlockManager",
    "CacheConfig",
    "ConfigError",
    "FinishReason",
    "InvalidRequestError",
    "MicroBatch",
    "RequestParams",
    "SamplingParams",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
    "make_policy",
    "policy_names",
]
