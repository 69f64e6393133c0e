"""Sarathi-Serve's stall-free batching (Algorithm 3 of arXiv 2403.02310)."""

from __future__ import annotations

from controller.scheduler.batch_builder import BatchBuilder
from controller.scheduler.policies.base import Policy, register


@register
class SarathiPolicy(Policy):
    """Every ready decode first, then the next chunk of ongoing prefills, then new requests, each
    chunk at most the budget left: decodes never wait behind a prompt, and every micro-batch
    carries about the budget's worth of work. With PP > 1, "every ready decode" is this
    micro-batch's share of the decoding sequences (BatchBuilder.add_decodes spreads them over
    the micro-batches in flight, whatever the policy), and prompt chunks fill the rest."""

    name = "sarathi"
    chunks_prompts = True

    def build(self, batch: BatchBuilder) -> None:
        batch.add_decodes(capped=True)
        batch.add_partial_prefills()
        batch.admit_new(chunked=True)
