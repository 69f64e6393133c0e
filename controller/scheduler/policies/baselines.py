"""The schedulers the paper compares Sarathi-Serve with (section 2.4 and the Table 4 ablation).

Where a policy adds "the running decodes", with PP > 1 that is the micro-batch's share of them:
BatchBuilder.add_decodes spreads decodes over the micro-batches in flight for every policy alike
(a pipeline matter, so the comparisons stay fair).

Whole-prompt policies compute every admitted prompt in one chunk; the one prompt token a forked
sequence of an n > 1 request computes itself (its last) goes through add_partial_prefills."""

from __future__ import annotations

from controller.scheduler.batch_builder import BatchBuilder
from controller.scheduler.policies.base import Policy, register


@register
class VllmPolicy(Policy):
    """Prefill-prioritizing iteration-level batching without mixing (Algorithm 2): whole
    prompts whenever one can be admitted, which stalls every running decode; decode-only
    batches otherwise."""

    name = "vllm"
    chunks_prompts = False

    def build(self, batch: BatchBuilder) -> None:
        if batch.add_partial_prefills() + batch.admit_new(chunked=False) == 0:
            batch.add_decodes(capped=False)


@register
class OrcaPolicy(Policy):
    """Iteration-level hybrid batches with whole prompts: decodes run beside full prefills, so
    they are not skipped but each such step takes as long as the prefill."""

    name = "orca"
    chunks_prompts = False

    def build(self, batch: BatchBuilder) -> None:
        batch.add_decodes(capped=False)
        batch.add_partial_prefills()
        batch.admit_new(chunked=False)


@register
class RequestLevelPolicy(Policy):
    """FasterTransformer-style request-level batching (Algorithm 1): a new batch of requests is
    admitted only once every running request has finished."""

    name = "request_level"
    chunks_prompts = False

    def build(self, batch: BatchBuilder) -> None:
        if batch.num_running == 0:
            batch.admit_new(chunked=False)
        else:
            batch.add_partial_prefills()
            batch.add_decodes(capped=False)


@register
class ChunkedOnlyPolicy(Policy):
    """The paper's chunked-prefills-only ablation: prompts in budget-sized chunks, but prefill
    micro-batches carry no decodes, so decodes still wait while any prompt is being processed."""

    name = "chunked_only"
    chunks_prompts = True

    def build(self, batch: BatchBuilder) -> None:
        if batch.add_partial_prefills() + batch.admit_new(chunked=True) == 0:
            batch.add_decodes(capped=True)
