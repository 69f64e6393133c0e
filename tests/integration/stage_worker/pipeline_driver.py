"""Plays the controller for real `python -m stage_worker` processes: binds a ZeroMQ ROUTER on a
random loopback port, starts PP x TP workers, does the start-up handshake, and drives the real
Scheduler with up to PP micro-batches in flight. Reusable by any test (and by hand)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from sarathi_proto import stage_pb2

from controller.executor.plan_codec import decode_result, encode_plan
from controller.scheduler import CacheConfig, RequestParams, Scheduler, SchedulerConfig

REPO_ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunResult:
    tokens: dict[int, list[int]]
    num_preemptions: int
    num_batches: int
    heartbeats: list[stage_pb2.Heartbeat] = field(default_factory=list)


_PING = stage_pb2.ControllerMessage(ping=stage_pb2.Ping()).SerializeToString()


class LocalPipeline:
    """PP x TP stage workers on this machine. Use as a context manager."""

    def __init__(
        self,
        model_dir: Path,
        pp: int,
        tp: int,
        *,
        dtype: str = "float32",
        block_size: int = 16,
        max_kv_blocks: int | None = None,
        kv_cache_bytes: int = 16 << 20,
        extra_args: Sequence[str] = (),
        timeout_s: float = 120.0,
    ) -> None:
        self.pp, self.tp, self.block_size, self.timeout_s = pp, tp, block_size, timeout_s
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        # Worker output, kept for the failure message; closed with the pipeline.
        self._logs = [tempfile.TemporaryFile() for _ in range(pp * tp)]  # noqa: SIM115
        paths = [str(REPO_ROOT), str(REPO_ROOT / "proto"), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
        args = [
            "--controller", f"tcp://127.0.0.1:{port}",
            "--model", str(model_dir),
            "--dtype", dtype,
            "--num-threads", "1",
            "--kv-cache-bytes", str(kv_cache_bytes),
            "--block-size", str(block_size),
            *extra_args,
        ]  # fmt: skip
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "stage_worker",
                    *args,
                    "--stage",
                    str(rank // tp),
                    "--tp-rank",
                    str(rank % tp),
                ],
                stdout=self._logs[rank],
                stderr=subprocess.STDOUT,
                env=env,
            )
            for rank in range(pp * tp)
        ]
        self.identities: dict[tuple[int, int], bytes] = {}
        self.ready: dict[tuple[int, int], stage_pb2.WorkerReady] = {}
        self.heartbeats: list[stage_pb2.Heartbeat] = []
        self.num_kv_blocks = 0
        self.max_kv_blocks = max_kv_blocks

    # ---- plumbing --------------------------------------------------------------------------
    def logs(self) -> str:
        out = []
        for rank, f in enumerate(self._logs):
            f.seek(0)
            out.append(f"--- worker {rank} ---\n" + f.read().decode(errors="replace")[-3000:])
        return "\n".join(out)

    def _recv(self) -> tuple[bytes, stage_pb2.WorkerMessage]:
        """The next message; meanwhile every worker known is pinged, as a controller does: a
        worker that hears nothing for its --controller-timeout leaves."""
        deadline = time.monotonic() + self.timeout_s
        while not self.sock.poll(200):
            dead = [p.returncode for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"workers exited {dead} or timed out\n{self.logs()}")
            for identity in self.identities.values():
                self.sock.send_multipart([identity, _PING])
        identity, frame = self.sock.recv_multipart()
        msg = stage_pb2.WorkerMessage()
        msg.ParseFromString(frame)
        return identity, msg

    def send(self, key: tuple[int, int], msg: stage_pb2.ControllerMessage) -> None:
        self.sock.send_multipart([self.identities[key], msg.SerializeToString()])

    def start(self) -> LocalPipeline:
        """Handshake: hello -> assignment -> ready -> cache, for every worker."""
        init = f"tcp://127.0.0.1:{free_port()}"
        while len(self.identities) < self.pp * self.tp:
            identity, msg = self._recv()
            if msg.HasField("hello"):
                key = (msg.hello.stage, msg.hello.tp_rank)
                self.identities[key] = identity
                assignment = stage_pb2.WorkerAssignment(
                    stage=key[0], tp_rank=key[1], pp=self.pp, tp=self.tp, dist_init_method=init
                )
                self.send(key, stage_pb2.ControllerMessage(assignment=assignment))
        by_identity = {v: k for k, v in self.identities.items()}
        while len(self.ready) < self.pp * self.tp:
            identity, msg = self._recv()
            if msg.HasField("ready"):
                self.ready[by_identity[identity]] = msg.ready
        self.num_kv_blocks = min(r.num_kv_blocks for r in self.ready.values())
        if self.max_kv_blocks is not None:
            self.num_kv_blocks = min(self.num_kv_blocks, self.max_kv_blocks)
        cache = stage_pb2.CacheAssignment(
            num_kv_blocks=self.num_kv_blocks, block_size=self.block_size
        )
        for key in self.identities:
            self.send(key, stage_pb2.ControllerMessage(cache=cache))
        return self

    def send_plan(self, plan_stage0: stage_pb2.StepPlan, plan_rest: stage_pb2.StepPlan) -> None:
        for key in self.identities:
            plan = plan_stage0 if key[0] == 0 else plan_rest
            self.send(key, stage_pb2.ControllerMessage(plan=plan))

    def wait_result(self) -> stage_pb2.StepResult:
        while True:
            _identity, msg = self._recv()
            if msg.HasField("result"):
                return msg.result
            if msg.HasField("heartbeat"):
                self.heartbeats.append(msg.heartbeat)

    # ---- generation ------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        *,
        budget_tokens: int = 32,
        tile_tokens: int = 8,
        params: list[RequestParams] | None = None,
        scheduler: Scheduler | None = None,
        first_seq_id: int = 0,
    ) -> RunResult:
        """scheduler: one kept from an earlier call (its prefix cache names KV the workers still
        hold); then first_seq_id must pass the ids used before. Tokens by seq id."""
        if scheduler is None:
            scheduler = self.make_scheduler(budget_tokens, tile_tokens)
        for i, prompt in enumerate(prompts):
            p = params[i] if params else RequestParams(max_tokens=max_tokens)
            scheduler.add_request(first_seq_id + i, prompt, p, now=time.monotonic())
        tokens: dict[int, list[int]] = {first_seq_id + i: [] for i in range(len(prompts))}
        num_batches = 0
        while scheduler.has_unfinished:
            while (batch := scheduler.schedule(time.monotonic())) is not None:
                self.send_plan(encode_plan(batch, True), encode_plan(batch, False))
                num_batches += 1
            if scheduler.num_inflight_batches == 0:
                raise RuntimeError("scheduler stalled with nothing in flight")
            result = self.wait_result()
            for seq in scheduler.on_result(
                result.batch_id, decode_result(result), time.monotonic()
            ):
                tokens[seq.seq_id] = list(seq.output_token_ids)
        return RunResult(tokens, scheduler.num_preemptions, num_batches, list(self.heartbeats))

    def make_scheduler(
        self, budget_tokens: int = 32, tile_tokens: int = 8, prefix_caching: bool = True
    ) -> Scheduler:
        return Scheduler(
            SchedulerConfig(
                budget_tokens=budget_tokens,
                tile_tokens=tile_tokens,
                max_num_seqs=min(16, budget_tokens),
                pipeline_depth=self.pp,
            ),
            CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_kv_blocks,
                watermark=0.0,
                prefix_caching=prefix_caching,
            ),
        )

    def close(self) -> list[int]:
        """Sends shutdown and returns the workers' exit codes."""
        for key in self.identities:
            self.send(key, stage_pb2.ControllerMessage(shutdown=True))
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=30))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        self.sock.close()
        self._ctx.term()
        for f in self._logs:
            f.close()
        return codes

    def __enter__(self) -> LocalPipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if any(p.poll() is None for p in self.procs):
            self.close()
