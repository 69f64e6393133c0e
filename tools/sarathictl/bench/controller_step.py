"""`sarathictl bench controller-step`: the controller's whole step with thousands of decodes.

One step is everything the engine thread does per micro-batch: schedule it, encode its StepPlan
for stage 0 and for the later stages, send it, receive the StepResult, decode it, apply it to
the scheduler, then stream each new token (detokenize it, check stop strings, queue its event).
The workers are a stand-in at the far end of a ZeroMQ socket that answers at once (one token per
yielding sequence); the time it spends parsing the plan and building its answer is worker time
and left out. Every sequence decodes (PP=1: all of them in each micro-batch).

Two figures per point: the *critical path*, what stands between a result's arrival and the next
plan's departure (receive, decode, apply, schedule, encode, send), which stages wait on; and the
*total*, with the streaming the engine does after the next plan is on its way. Target (issue
15): at most 1 ms median at 1,024 decodes, 3 ms at 4,096.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from sarathi_proto import stage_pb2

from controller.admission import AdmissionConfig
from controller.engine import Engine, GenerationRequest, TextStream
from controller.executor.plan_codec import decode_result, encode_plan_messages
from controller.scheduler import CacheConfig, MicroBatch, RequestParams, Scheduler, SchedulerConfig
from controller.tokenizer import TextStream as DetokenizingStream
from controller.tokenizer import Tokenizer
from sarathictl.argtypes import comma_list, int_at_least, int_in_range
from sarathictl.bench.random_model import write_byte_tokenizer

TARGETS_MS = {1024: 1.0, 4096: 3.0}
PROMPT_TOKENS = 16
MAX_OUTPUT = 4096
"""Tokens each sequence may generate: more than any run's steps, so none finishes."""
REPLY_TEXT = "Chunked prefills split long prompts; decodes never stall behind them. Café 東京."
BLOCK_SIZE = 16


class StandInWorker:
    """The last stage as the controller sees it: takes a plan off the socket, answers with one
    token per yielding sequence, in plan order. Knows the wire format, nothing else."""

    def __init__(self, sock: zmq.Socket[bytes], reply_tokens: list[int]) -> None:
        self.sock = sock
        self.reply_tokens = reply_tokens
        """Cycled through, one per step: text a model could write (random ids would often
        be pieces of multi-byte characters, which the detokenizer holds back)."""
        self.busy_s = 0.0

    def answer(self) -> None:
        data = self.sock.recv()
        start = time.perf_counter()
        plan = stage_pb2.ControllerMessage.FromString(data).plan
        seq_ids = yielding_seq_ids(plan)
        token = self.reply_tokens[plan.batch_id % len(self.reply_tokens)]
        result = stage_pb2.StepResult(
            batch_id=plan.batch_id, seq_ids=seq_ids, token_ids=[token] * len(seq_ids)
        )
        reply = stage_pb2.WorkerMessage(result=result).SerializeToString()
        self.busy_s += time.perf_counter() - start
        self.sock.send(reply)


def yielding_seq_ids(plan: stage_pb2.StepPlan) -> list[int]:
    """In plan order: seqs[:decodes_at], the decode columns (each yields), the other seqs."""
    at = plan.decodes_at
    ids = [s.seq_id for s in plan.seqs[:at] if s.yields_token]
    ids.extend(plan.decodes.seq_ids)
    ids.extend(s.seq_id for s in plan.seqs[at:] if s.yields_token)
    return ids


class _NoSubmit:
    async def submit(self, batch: MicroBatch) -> None:
        raise AssertionError("the benchmark drives the step itself")


@dataclass
class Link:
    """The controller's socket and the stand-in worker at the other end (inproc)."""

    controller: zmq.Socket[bytes]
    worker: StandInWorker


def open_link(ctx: zmq.Context[zmq.Socket[bytes]], tokenizer: Tokenizer) -> Link:
    controller, worker = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    addr = f"inproc://controller-step-{id(controller)}"
    controller.bind(addr)
    worker.connect(addr)
    reply_tokens = tokenizer.encode(REPLY_TEXT)
    return Link(controller, StandInWorker(worker, reply_tokens))


def decoding_engine(num_seqs: int, tokenizer: Tokenizer) -> Engine:
    """An engine whose scheduler holds num_seqs requests, all past their prompts."""
    config = SchedulerConfig(
        budget_tokens=max(512, num_seqs), max_num_seqs=num_seqs, max_model_len=1 << 20
    )
    blocks_per_seq = (PROMPT_TOKENS + MAX_OUTPUT) // BLOCK_SIZE + 1
    cache = CacheConfig(num_blocks=num_seqs * blocks_per_seq, block_size=BLOCK_SIZE)

    def text_stream(request: GenerationRequest) -> TextStream:
        return DetokenizingStream(tokenizer, request.stop)

    engine = Engine(
        Scheduler(config, cache),
        _NoSubmit(),
        text_stream,
        admission=AdmissionConfig(max_queued_requests=num_seqs),
    )
    for i in range(num_seqs):
        prompt = [(7 * i + j) % tokenizer.vocab_size for j in range(PROMPT_TOKENS)]
        engine.add(GenerationRequest(f"r{i}", prompt, RequestParams(max_tokens=MAX_OUTPUT)))
    return engine


def step(engine: Engine, link: Link) -> float | None:
    """One controller step; seconds of its critical path (None: nothing to schedule). The
    streaming follows, as in the engine's loop."""
    start = time.perf_counter()
    batch = engine.scheduler.schedule(engine.clock())
    if batch is None:
        return None
    first, _rest = encode_plan_messages(batch)  # PP=1: _rest goes to no one, but is built
    link.controller.send(first, copy=False)
    sent = time.perf_counter()
    link.worker.answer()
    received = time.perf_counter()
    reply = stage_pb2.WorkerMessage.FromString(link.controller.recv())
    engine.on_result(reply.result.batch_id, decode_result(reply.result))
    critical = (sent - start) + (time.perf_counter() - received)
    engine.stream_pending()
    return critical


def drain(engine: Engine) -> None:
    """The API side's part, outside the step: the streams take their events."""
    for choice in engine._choices.values():
        events = choice.request.events
        while not events.empty():
            events.get_nowait()


@dataclass
class StepTimes:
    critical_ms: list[float]
    total_ms: list[float]


def measure(num_seqs: int, num_steps: int, tokenizer: Tokenizer) -> StepTimes:
    """Milliseconds of controller work per step, num_seqs sequences decoding."""
    engine = decoding_engine(num_seqs, tokenizer)
    with zmq.Context() as ctx:
        link = open_link(ctx, tokenizer)
        while engine.scheduler.num_waiting or not all(
            s.is_decoding for s in engine.scheduler.running.values()
        ):
            step(engine, link)  # the prompts: not timed
        drain(engine)
        gc.collect()
        gc.freeze()  # as the engine does at start-up
        times = StepTimes([], [])
        clock = time.perf_counter
        for _ in range(num_steps):
            worker_before = link.worker.busy_s
            start = clock()
            critical = step(engine, link)
            assert critical is not None
            total = clock() - start - (link.worker.busy_s - worker_before)
            times.critical_ms.append(critical * 1e3)
            times.total_ms.append(total * 1e3)
            drain(engine)
        gc.unfreeze()
        link.controller.close(linger=0)
        link.worker.sock.close(linger=0)
    return times


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        write_byte_tokenizer(Path(tmp))
        tokenizer = Tokenizer.from_dir(tmp)
    rows = []
    for num_seqs in args.num_seqs:
        times = measure(num_seqs, args.steps, tokenizer)
        rows.append(
            {
                "decodes": num_seqs,
                "critical_median_ms": round(statistics.median(times.critical_ms), 3),
                "median_ms": round(statistics.median(times.total_ms), 3),
                "p90_ms": round(statistics.quantiles(times.total_ms, n=10)[-1], 3),
                "target_ms": TARGETS_MS.get(num_seqs),
            }
        )
    if args.json:
        print(json.dumps({"steps": args.steps, "rows": rows}, indent=1))
        return 0
    print("controller step: critical path (result in -> next plan out) and total (with streaming)")
    print("| decodes | critical ms | total median ms | total P90 ms | target ms |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        shown = "-" if r["target_ms"] is None else f"{r['target_ms']}"
        print(
            f"| {r['decodes']} | {r['critical_median_ms']} | {r['median_ms']} | {r['p90_ms']} "
            f"| {shown} |"
        )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "controller-step",
        help="the controller's whole step at N decodes, against a stand-in worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--num-seqs",
        type=comma_list(int_at_least(1)),
        default=(256, 1024, 4096),
        help="comma-separated numbers of decoding sequences",
    )
    p.add_argument(
        "--steps", type=int_in_range(5, MAX_OUTPUT - 1), default=50, help="timed steps per point"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)
