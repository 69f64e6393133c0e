"""Batching policies; importing this package registers all of them."""

from controller.scheduler.policies import baselines, sarathi
from controller.scheduler.policies.base import Policy, make_policy, policy_names

__all__ = ["Policy", "baselines", "make_policy", "policy_names", "sarathi"]
