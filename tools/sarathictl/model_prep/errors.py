"""The one error type of model preparation: the CLI prints its message as a single line."""

from __future__ import annotations


class ModelPrepError(ValueError):
    """The model folder could not be prepared; the message says why and what to try next."""
