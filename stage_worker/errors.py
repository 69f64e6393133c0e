"""Errors a worker raises at start-up: each names the field or tensor and the numbers involved."""

from __future__ import annotations


class CheckpointError(ValueError):
    """The checkpoint (config.json or a safetensors tensor) cannot be served as requested."""


class PlanError(ValueError):
    """A StepPlan the worker refuses to run (unknown sequence, block beyond the cache, ...)."""
