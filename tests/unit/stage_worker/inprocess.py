"""A pipeline of StageRunners chained in one process (tp=1), driven by the real scheduler: the
math of the stage workers without sockets or torch.distributed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from controller.executor.plan_codec import encode_plan
from controller.scheduler import (
    CacheConfig,
    MicroBatch,
    RequestParams,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from controller.scheduler.scheduler import VECTOR_DECODES_FROM
from stage_worker.attention import make_backend
from stage_worker.checkpoint import CheckpointReader
from stage_worker.comm import TPGroup
from stage_worker.config import ShardSpec, load_spec
from stage_worker.cuda_graphs import DecodeGraphs
from stage_worker.kv_cache import KVCache
from stage_worker.models import build_stage
from stage_worker.runner import StageRunner, prompt_logprobs
from stage_worker.sampler import TokenLogprobs


def make_runners(
    model_dir: Path,
    pp: int,
    num_blocks: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    cuda_graphs: bool = False,
    layer_split: tuple[int, ...] = (),
    attention: str = "torch",
) -> list[StageRunner]:
    spec = load_spec(model_dir)
    reader = CheckpointReader(model_dir)
    runners = []
    for stage in range(pp):
        shard = ShardSpec(pp=pp, tp=1, stage=stage, tp_rank=0, layer_split=layer_split)
        model = build_stage(spec, shard, TPGroup(), device, dtype, reader)
        cache = KVCache(
            len(model.layers),
            num_blocks,
            block_size,
            model.num_kv_heads_local,
            spec.head_dim,
            device,
            dtype,
        )
        graphs = DecodeGraphs(model, cache, attention) if cuda_graphs else None
        backend = make_backend(attention, device)
        runners.append(StageRunner(model, cache, backend, graphs, str(model_dir)))
    reader.close()
    return runners


@dataclass
class Outcome:
    tokens: dict[int, list[int]]
    """seq_id -> generated token ids."""
    last_logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """seq_id -> [vocab] logits of each sampled position, in order."""
    logprobs: dict[int, list[TokenLogprobs | None]] = field(default_factory=dict)
    """seq_id -> the last stage's log-probabilities of each sampled token (None: not asked)."""
    prompt_logprobs: dict[int, dict[int, TokenLogprobs]] = field(default_factory=dict)
    """seq_id -> prompt position -> the last stage's log-probabilities of that prompt token."""
    num_preemptions: int = 0
    num_batches: int = 0
    num_ahead: int = 0
    """Decodes that went ahead of their input token (decode_ahead)."""


def make_scheduler(
    runners: list[StageRunner],
    budget_tokens: int,
    tile_tokens: int,
    vector_decodes_from: int | None,
    decode_ahead: bool = False,
) -> Scheduler:
    """A scheduler sized to the runners' KV cache, one micro-batch in flight per stage (and one
    more with decode_ahead)."""
    cache = runners[0].kv_cache
    return Scheduler(
        SchedulerConfig(
            budget_tokens=budget_tokens,
            tile_tokens=tile_tokens,
            max_num_seqs=min(16, budget_tokens),
            pipeline_depth=len(runners),
            decode_ahead=decode_ahead,
        ),
        CacheConfig(block_size=cache.block_size, num_blocks=cache.num_blocks, watermark=0.0),
        VECTOR_DECODES_FROM if vector_decodes_from is None else vector_decodes_from,
    )


def run_through_stages(
    runners: list[StageRunner], batch: MicroBatch, out: Outcome
) -> dict[int, int]:
    """One micro-batch through every stage in order; keeps the last stage's logits, logprobs
    and prompt scores in out. Returns the sampled token of each sequence that yields one."""
    hidden = None
    for stage, runner in enumerate(runners):
        step = runner.prepare(encode_plan(batch, with_token_ids=stage == 0))
        hidden = runner.forward(step, hidden)
    assert hidden is not None
    last = runners[-1]
    logits = last.logits(step, hidden)
    for seq_id, first, entries in prompt_logprobs(last, step, hidden):
        scored = out.prompt_logprobs.setdefault(seq_id, {})
        scored.update(enumerate(entries, start=first))
    pairs = last.sample(step, logits)
    logprobs = last.logprobs(step, logits, [token for _, token in pairs])
    for seq_id, row, lp in zip(step.sample_seq_ids, logits, logprobs, strict=True):
        out.last_logits.setdefault(seq_id, []).append(row)
        out.logprobs.setdefault(seq_id, []).append(lp)
    return dict(pairs)


def generate(
    runners: list[StageRunner],
    prompts: list[list[int]],
    max_tokens: int,
    budget_tokens: int = 32,
    tile_tokens: int = 8,
    vector_decodes_from: int | None = None,
    sampling: SamplingParams | None = None,
    stop_token_ids: frozenset[int] = frozenset(),
    decode_ahead: bool = False,
) -> Outcome:
    """Runs the prompts to max_tokens tokens each. Up to pp micro-batches are scheduled before any
    result returns, as in a real pipeline, then each passes through every stage in order; logits
    of every sampled position are kept for comparison. vector_decodes_from: the scheduler's
    threshold for sending decodes as packed columns (1: always); sampling: greedy when None,
    else these parameters with the seed plus the request's index. decode_ahead: the engine's
    order instead, a micro-batch scheduled after each result (SchedulerConfig.decode_ahead)."""
    scheduler = make_scheduler(
        runners, budget_tokens, tile_tokens, vector_decodes_from, decode_ahead
    )
    for seq_id, prompt in enumerate(prompts):
        params = RequestParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids)
        if sampling is not None:  # each request its own seed: the base seed plus its index
            seeded = dataclasses.replace(sampling, seed=sampling.seed + seq_id)
            params = dataclasses.replace(params, sampling=seeded)
        scheduler.add_request(seq_id, prompt, params, now=0.0)
    out = Outcome({i: [] for i in range(len(prompts))})
    if decode_ahead:
        _run_as_the_engine(runners, scheduler, out)
        return out
    now = 0.0
    while scheduler.has_unfinished:
        batches = []
        while (batch := scheduler.schedule(now)) is not None:
            batches.append(batch)
        assert batches, "scheduler stalled"
        for batch in batches:
            sampled = run_through_stages(runners, batch, out)
            now += 1.0
            for seq in scheduler.on_result(batch.batch_id, sampled, now):
                out.tokens[seq.seq_id] = list(seq.output_token_ids)
            out.num_batches += 1
        scheduler.check_invariants()
    out.num_preemptions = scheduler.num_preemptions
    return out


def _run_as_the_engine(runners: list[StageRunner], scheduler: Scheduler, out: Outcome) -> None:
    """As the engine: schedule while the scheduler gives micro-batches, then complete the
    oldest in flight, apply its result and schedule again."""
    inflight: list[MicroBatch] = []
    now = 0.0
    while scheduler.has_unfinished:
        while (batch := scheduler.schedule(now)) is not None:
            inflight.append(batch)
        assert inflight, "scheduler stalled"
        batch = inflight.pop(0)
        sampled = run_through_stages(runners, batch, out)
        now += 1.0
        for seq in scheduler.on_result(batch.batch_id, sampled, now):
            out.tokens[seq.seq_id] = list(seq.output_token_ids)
        out.num_batches += 1
        out.num_ahead += sum(1 for c in batch.chunks if c.ahead)
        scheduler.check_invariants()
    out.num_preemptions = scheduler.num_preemptions
