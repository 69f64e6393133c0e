"""Errors a worker raises: at start-up each names the field or tensor and the numbers involved;
while serving, a plan refused or a step that failed."""

from __future__ import annotations


class CheckpointError(ValueError):
    """The checkpoint (config.json or a safetensors tensor) cannot be served as requested."""


class PlanError(ValueError):
    """A StepPlan the worker refuses to run (unknown sequence, block beyond the cache, ...)."""


class StepFaulted(Exception):
    """A step raised on this worker, not on a broken link to a peer: the controller is told
    which micro-batch (a StepFault) before the worker exits, to quarantine its requests."""

    def __init__(self, batch_id: int, cause: BaseException) -> None:
        super().__init__(f"micro-batch {batch_id}: {type(cause).__name__}: {cause}")
        self.batch_id = batch_id
        self.cause = cause
