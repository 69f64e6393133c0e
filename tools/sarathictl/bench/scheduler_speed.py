"""`sarathictl bench scheduler`: the cost of one scheduling step plus applying its result.

With every sequence decoding, this is the controller's per-iteration overhead that a GPU
pipeline would wait on. Target (issue 2): at most 0.2 ms at 256 running and 1 ms at 4,096.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from controller.scheduler import (
    CacheConfig,
    RequestParams,
    Scheduler,
    SchedulerConfig,
    policy_names,
)
from sarathictl.argtypes import int_at_least

TARGETS_MS = {256: 0.2, 4096: 1.0}


def _decoding_scheduler(policy: str, num_seqs: int, prompt_len: int) -> Scheduler:
    budget = max(512, -(-num_seqs // 32) * 32)
    config = SchedulerConfig(
        policy=policy,
        budget_tokens=budget,
        max_num_seqs=num_seqs,
        max_model_len=1 << 20,
    )
    blocks_per_seq = (prompt_len + 4096) // 16 + 1
    sched = Scheduler(config, CacheConfig(num_blocks=num_seqs * blocks_per_seq, block_size=16))
    for seq_id in range(num_seqs):
        # An end-of-sequence id, as every served request has (unless ignore_eos); 2 is sampled.
        params = RequestParams(max_tokens=1 << 16, stop_token_ids=frozenset({0}))
        sched.add_request(seq_id, [1] * prompt_len, params, 0.0)
    # Run the prefills so that every sequence decodes from here on.
    while sched.num_waiting or any(not s.is_decoding for s in sched.running.values()):
        batch = sched.schedule(0.0)
        assert batch is not None
        sched.on_result(batch.batch_id, dict.fromkeys(batch.yielding_seq_ids(), 2), 0.0)
    return sched


def measure_step_ms(
    policy: str, num_seqs: int, num_steps: int, prompt_len: int = 16
) -> list[float]:
    """Milliseconds per (schedule + on_result) with num_seqs sequences decoding."""
    sched = _decoding_scheduler(policy, num_seqs, prompt_len)
    # As the engine does after start-up: long-lived objects leave the collector's young
    # generations, so a step does not pay for re-scanning thousands of sequences.
    gc.collect()
    gc.freeze()
    samples = []
    clock = time.perf_counter
    for step in range(num_steps):
        start = clock()
        batch = sched.schedule(float(step))
        assert batch is not None and batch.num_chunks == num_seqs
        # The result as the wire decoder hands it over: seq_id -> token for every yielding chunk.
        sampled = dict.fromkeys(batch.yielding_seq_ids(), 2)
        sched.on_result(batch.batch_id, sampled, float(step))
        samples.append((clock() - start) * 1e3)
    gc.unfreeze()
    return samples


def run(args: argparse.Namespace) -> int:
    rows = []
    for num_seqs in args.num_seqs:
        samples = measure_step_ms(args.policy, num_seqs, args.steps)
        median = statistics.median(samples)
        target = TARGETS_MS.get(num_seqs)
        rows.append(
            {
                "num_running": num_seqs,
                "median_ms": round(median, 4),
                "p90_ms": round(statistics.quantiles(samples, n=10)[-1], 4),
                "us_per_seq": round(median * 1e3 / num_seqs, 3),
                "target_ms": target,
                "meets_target": None if target is None else median <= target,
            }
        )
    if args.json:
        print(json.dumps({"policy": args.policy, "steps": args.steps, "rows": rows}, indent=2))
        return 0
    print(f"scheduler step + result, policy={args.policy}, {args.steps} steps each, all decoding")
    print(f"{'running':>8} {'median ms':>10} {'p90 ms':>8} {'us/seq':>7} {'target ms':>12}")
    for r in rows:
        verdict = ""
        if r["target_ms"] is not None:
            verdict = f"{r['target_ms']} {'ok' if r['meets_target'] else 'MISSED'}"
        print(
            f"{r['num_running']:>8} {r['median_ms']:>10.4f} {r['p90_ms']:>8.4f}"
            f" {r['us_per_seq']:>7.3f} {verdict:>12}"
        )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("scheduler", help="time one scheduling step plus applying its result")
    parser.add_argument(
        "--policy",
        default="sarathi",
        choices=policy_names(),
        help="scheduling policy (default sarathi)",
    )
    parser.add_argument(
        "--num-seqs",
        type=int_at_least(1),
        nargs="+",
        default=[64, 256, 1024, 4096],
        help="running sequences",
    )
    parser.add_argument(
        "--steps",
        type=int_at_least(2),
        default=200,
        help="steps timed per size (at least 2: the P90 needs two samples)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(run=run)
