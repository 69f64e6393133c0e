"""Typed errors of the scheduler; the gRPC layer maps InvalidRequestError to INVALID_ARGUMENT."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration field holds a value outside its allowed range."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        super().__init__(f"{field}={value!r} is invalid: {allowed}")
        self.field = field


class InvalidRequestError(ValueError):
    """A request that can never be served as asked; nothing was queued."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
