"""The policy interface and its registry: a policy only decides what goes into a micro-batch."""

from __future__ import annotations

import abc
from typing import ClassVar

from controller.scheduler.batch_builder import BatchBuilder


class Policy(abc.ABC):
    name: ClassVar[str]
    chunks_prompts: ClassVar[bool]
    """Whether prompts are split into chunks (and every micro-batch kept within the budget)."""

    @abc.abstractmethod
    def build(self, batch: BatchBuilder) -> None:
        """Fills one micro-batch through the builder's moves."""


_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    _REGISTRY[cls.name] = cls
    return cls


def make_policy(name: str) -> Policy:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


def policy_names() -> list[str]:
    return sorted(_REGISTRY)
