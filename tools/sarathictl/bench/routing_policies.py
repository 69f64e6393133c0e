"""How `bench prefix-routing` spreads requests over pipelines: the ways a user could put
several pipelines behind one endpoint, by name.

- `single`: everything to the first pipeline (one pipeline's hit rate, while its cache holds
  every conversation);
- `round-robin`: what a plain Service in front of the controllers gives;
- `load`: the endpoint picker with its queue and KV-cache scorers only (weights 2,2,0);
- `epp`: the endpoint picker as the chart configures it (queue 2, KV cache 2, prefix 1);
- `epp:Q,K,P`: the endpoint picker with these weights.
"""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sarathictl.bench.endpoint_picker import (
    CHART_WEIGHTS,
    EndpointLoad,
    PrefixIndex,
    Weights,
    pick,
    prompt_block_hashes,
)

SIMPLE_POLICIES = ("single", "round-robin")


@dataclass(frozen=True)
class RoutingPolicy:
    name: str
    weights: Weights | None = None
    """The endpoint picker's weights; None: a simple policy (SIMPLE_POLICIES)."""

    def __str__(self) -> str:
        return self.name  # what parse_policy reads back

    @property
    def needs_loads(self) -> bool:
        """It reads the endpoints' metrics before each pick."""
        return self.weights is not None


def parse_policy(text: str) -> RoutingPolicy:
    """A policy by name (the module's docstring); ValueError naming the choices."""
    if text in SIMPLE_POLICIES:
        return RoutingPolicy(text)
    if text == "load":
        return RoutingPolicy(text, Weights(CHART_WEIGHTS.queue, CHART_WEIGHTS.kv_cache, 0))
    if text == "epp":
        return RoutingPolicy(text, CHART_WEIGHTS)
    if text.startswith("epp:"):
        try:
            queue, kv_cache, prefix = (float(w) for w in text[4:].split(","))
            return RoutingPolicy(text, Weights(queue, kv_cache, prefix))
        except ValueError as err:
            raise ValueError(f"policy {text!r}: must be epp:Q,K,P, three weights ({err})") from None
    raise ValueError(f"policy {text!r}: must be {POLICY_NAMES}")


POLICY_NAMES = "single, round-robin, load, epp or epp:Q,K,P"


@dataclass(frozen=True, eq=False)  # hashed by identity: argparse looks types up in a dict
class PolicyArg:
    """--policies' type: a policy by name (parse_policy), argparse's error for anything else."""

    bad_values: tuple[str, ...] = ("no-such-policy", "epp:1,2", "epp:1,1,-1")

    def __call__(self, text: str) -> RoutingPolicy:
        try:
            return parse_policy(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None


class Router:
    """Picks the endpoint of each request under one policy; keeps the picker's prefix index
    (it starts empty, as a new gateway's does)."""

    def __init__(
        self, policy: RoutingPolicy, endpoints: Sequence[str], model: str, seed: int
    ) -> None:
        if not endpoints:
            raise ValueError("no endpoints to route to")
        self.policy = policy
        self.endpoints = list(endpoints)
        self.model = model
        self._cycle = itertools.cycle(self.endpoints)
        self._index = PrefixIndex()
        self._rng = random.Random(seed)

    def route(self, prompt: str, loads: Mapping[str, EndpointLoad]) -> str:
        """The endpoint for a prompt; `loads` is read only by the endpoint picker's policies."""
        weights = self.policy.weights
        if weights is None:
            if self.policy.name == "single":
                return self.endpoints[0]
            return next(self._cycle)
        hashes = prompt_block_hashes(self.model, prompt)
        return pick(hashes, loads, self._index, weights, self._rng)
