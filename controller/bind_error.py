"""The error of an API port that cannot be bound: the controller says it in one line and exits,
since it is the user's to fix (another process on the port, a port it may not take)."""

from __future__ import annotations


class BindError(OSError):
    pass
