"""Real `python -m stage_worker` processes over ZeroMQ and torch.distributed (gloo), driven by the
real scheduler with up to PP micro-batches in flight: the tokens equal transformers' greedy
generate for the PP x TP matrix, a preempted sequence is recomputed, bad input is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sarathi_proto import stage_pb2

from tests.integration.stage_worker.pipeline_driver import REPO_ROOT, LocalPipeline
from tests.unit.stage_worker.tiny_models import VOCAB_SIZE, load_oracle, oracle_greedy

pytestmark = pytest.mark.integration

PROMPT_LENGTHS = (37, 5, 70, 21)  # the budget of 32 divides none of them
MAX_TOKENS = 6


def make_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(5 * i + 11 * j + 2) % VOCAB_SIZE for j in range(n)] for i, n in enumerate(lengths)]


# Each architecture appears with TP=2 and at least two pipeline depths.
MATRIX = [
    (1, 1, "llama"),
    (1, 2, "falcon_new"),
    (2, 1, "falcon_mq"),
    (2, 2, "llama"),
    (3, 1, "falcon_new"),
    (3, 2, "falcon_mq"),
]


@pytest.mark.parametrize(("pp", "tp", "arch"), MATRIX)
def test_pipeline_tokens_equal_transformers_greedy(
    pp: int, tp: int, arch: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model_dir = tiny_checkpoint(arch)
    prompts = make_prompts(PROMPT_LENGTHS)
    with LocalPipeline(model_dir, pp, tp) as pipeline:
        run = pipeline.generate(prompts, MAX_TOKENS)
        codes = pipeline.close()

    oracle = load_oracle(model_dir)
    for seq_id, prompt in enumerate(prompts):
        assert run.tokens[seq_id] == oracle_greedy(oracle, prompt, MAX_TOKENS), seq_id
    assert codes == [0] * (pp * tp)
    # every worker reported its steps; busy time is compute only, within its uptime
    reporters = {(h.stage, h.tp_rank) for h in run.heartbeats if h.last_batch_id > 0}
    assert reporters == {(s, r) for s in range(pp) for r in range(tp)}
    assert all(0 < h.busy_s_total <= h.uptime_s for h in run.heartbeats if h.last_batch_id > 0)
    latest = {(h.stage, h.tp_rank): h for h in run.heartbeats}  # totals: the last says all
    for h in latest.values():
        assert_phases_split_the_step(h, pp)
    for worker in reporters:
        assert_cache_ready_before_the_first_step(
            [h for h in run.heartbeats if (h.stage, h.tp_rank) == worker]
        )


def assert_cache_ready_before_the_first_step(beats: list[stage_pb2.Heartbeat]) -> None:
    """One worker's heartbeats from its cache assignment on: not ready while it zeroes (none
    with a small cache), then ready in every one, from one sent before its first step."""
    flags = [h.cache_ready for h in beats]
    first_ready = flags.index(True)
    assert flags[first_ready:] == [True] * (len(flags) - first_ready)
    assert not any(flags[:first_ready]) and beats[first_ready].last_batch_id == 0


def assert_phases_split_the_step(h: stage_pb2.Heartbeat, pp: int) -> None:
    """A worker's step phases (CPU: the forward split too) are disjoint parts of its step time."""
    p = h.phases
    parts = (
        p.prepare_s + p.recv_wait_s + p.linear_s + p.attention_s + p.forward_other_s
        + p.logits_s + p.sample_s + p.send_s
    )  # fmt: skip
    assert 0 < parts <= p.step_s <= h.uptime_s
    assert p.num_tokens >= p.num_steps
    assert p.linear_s > 0 and p.attention_s > 0
    assert (p.recv_wait_s > 0) == (h.stage > 0)  # stage 0 embeds tokens: nothing to wait for
    assert (p.logits_s > 0 and p.sample_s > 0) == (h.stage == pp - 1)


def test_preempted_sequence_is_recomputed_across_processes(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    model_dir = tiny_checkpoint("falcon_new")
    prompts = make_prompts((30, 29, 31))
    max_tokens = 33
    with LocalPipeline(model_dir, pp=2, tp=2, max_kv_blocks=8, extra_args=["--send-slices"]) as p:
        run = p.generate(prompts, max_tokens)
    assert run.num_preemptions > 0
    oracle = load_oracle(model_dir)
    for seq_id, prompt in enumerate(prompts):
        assert run.tokens[seq_id] == oracle_greedy(oracle, prompt, max_tokens)


def test_a_refused_plan_is_said_by_each_stage_and_no_later_plan_runs(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """Each refusing stage answers at once (the controller takes the pipeline down); a later
    plan is not run, since a stage that took the refused one would read its activations as the
    refused one's. The workers wait to be told to leave, and leave cleanly."""
    model_dir = tiny_checkpoint("llama")
    with LocalPipeline(model_dir, pp=2, tp=1, max_kv_blocks=16) as pipeline:
        bad = stage_pb2.StepPlan(batch_id=1)
        bad.seqs.add(seq_id=42, first_position=0, num_tokens=1, yields_token=True, token_ids=[1])
        pipeline.send_plan(bad, bad)
        refusals = [pipeline.wait_result() for _ in range(2)]  # stage 0's and stage 1's
        assert [(r.batch_id, r.rejected, list(r.seq_ids)) for r in refusals] == [(1, True, [])] * 2
        good = stage_pb2.StepPlan(batch_id=2)
        good.seqs.add(
            seq_id=7, first_position=0, num_tokens=3, yields_token=True, token_ids=[1, 2, 3],
            sampling=stage_pb2.SamplingParams(),
        )  # fmt: skip
        pipeline.send_plan(good, good)
        kinds = []  # what the workers say for 2 s: heartbeats, answering the driver's pings
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if pipeline.sock.poll(100):
                _, frame = pipeline.sock.recv_multipart()
                kinds.append(stage_pb2.WorkerMessage.FromString(frame).WhichOneof("body"))
        assert "result" not in kinds and "heartbeat" in kinds, kinds
        assert all(p.poll() is None for p in pipeline.procs)
        assert pipeline.close() == [0, 0]


def test_bad_checkpoint_fails_at_start_up_naming_the_field(
    tmp_path: Path, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_attention_heads"] = 3  # hidden 64 over 3 heads, 2 KV heads: not a GQA layout
    (model_dir / "config.json").write_text(json.dumps(cfg))
    pipeline = LocalPipeline(model_dir, pp=1, tp=1)
    with pytest.raises(RuntimeError, match="num_attention_heads=3"):
        pipeline.start()
    assert pipeline.procs[0].wait(timeout=30) == 2
    pipeline.close()


def test_worker_help_runs_without_a_controller() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stage_worker", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
    )
    assert "--controller" in out.stdout and "--kv-cache-bytes" in out.stdout
