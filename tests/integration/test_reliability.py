"""Issue 7 against a real local cluster (`sarathictl up --local`, pp=2): cancellation storms,
overload, a stage killed with SIGKILL mid-stream, a hung stage, and fuzzed requests.

One cluster for the module; the kill test runs last but one (the supervisor restarts the worker
and the pipeline is rebuilt), so later tests also prove the rebuilt pipeline serves.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sarathi_proto import generate_pb2, generate_pb2_grpc
from sarathictl.client import Client, RetryPolicy

from tests.integration.cluster_factories import make_tiny_served_model
from tests.integration.local_cluster import free_port as _free_port
from tests.integration.test_local_cluster import _processes_using

pytestmark = pytest.mark.integration

MAX_QUEUED = 8


@dataclass
class Cluster:
    proc: subprocess.Popen[bytes]
    model_dir: Path
    channel: grpc.Channel
    addr: str

    @property
    def stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(self.channel)

    def status(self) -> generate_pb2.StatusResponse:
        return self.stub.Status(generate_pb2.StatusRequest(), timeout=5)

    def healthy(self) -> bool:
        health = health_pb2_grpc.HealthStub(self.channel)
        try:
            reply = health.Check(
                health_pb2.HealthCheckRequest(service="sarathi.v1.Generation"), timeout=1
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def worker_pid(self, stage: int) -> int:
        marker = f"--stage {stage} "
        pids = [
            pid
            for pid in _processes_using(str(self.model_dir))
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        ]
        assert len(pids) == 1, pids
        return pids[0]


def wait_until(predicate: object, timeout_s: float, what: str) -> float:
    """Polls predicate() until true; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() - start < timeout_s, f"{what} not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-reliable")
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "sarathictl.cli", "up", "--local", "--pp", "2",
            "--model", str(model_dir), "--port", str(port), "--budget", "64",
            "--kv-cache-mb", "16", "--log-dir", str(tmp_path_factory.mktemp("logs")),
            "--max-queued-requests", str(MAX_QUEUED), "--heartbeat-timeout", "4",
            "--stall-timeout", "1.5", "--dtype", "float32",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    addr = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(addr)
    running = Cluster(proc, model_dir, channel, addr)
    try:
        deadline = time.monotonic() + 240
        while not running.healthy():
            assert proc.poll() is None, proc.stdout.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "cluster did not become healthy"
            time.sleep(0.5)
        yield running
    finally:
        channel.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


def greedy_stream(
    cluster: Cluster,
    prompt: list[int],
    max_tokens: int,
    sampling: generate_pb2.SamplingParams | None = None,
) -> list[int]:
    """The token ids of one stream (greedy unless sampling is given)."""
    request = generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, sampling=sampling
    )
    responses = list(cluster.stub.Generate(request, timeout=120))
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    return [t for r in responses for t in r.token_ids]


def test_a_hundred_cancelled_streams_leave_no_kv_block_in_use(cluster: Cluster) -> None:
    streams = []
    for i in range(100):
        request = generate_pb2.GenerateRequest(
            prompt_token_ids=[1 + i % 200, 7, 9, 11], max_tokens=400, ignore_eos=True
        )
        streams.append(cluster.stub.Generate(request, timeout=60))
        if len(streams) == MAX_QUEUED:  # stay within the admission bound
            for call in streams:
                next(call)  # the request runs
                call.cancel()
            streams.clear()
    wait_until(
        lambda: (
            (s := cluster.status().scheduler).kv_usage_pct == 0.0
            and s.num_running == 0
            and s.num_waiting == 0
        ),
        10,
        "KV usage back to zero",
    )


def test_overload_is_refused_at_once_with_a_retry_hint_and_nothing_hangs(
    cluster: Cluster,
) -> None:
    # More calls at once than can run (max_num_seqs is the budget, 64) plus MAX_QUEUED: the
    # surplus must be refused whatever the machine's speed. Distinct prompts defeat the prefix
    # cache, and 32 tokens each keep the running ones in the batch while the rest arrive (with
    # 64 callers and shared prompts, a fast machine admitted every call and refused none).
    num_calls = 160
    start_together = threading.Barrier(num_calls)

    def call(i: int) -> str:
        request = generate_pb2.GenerateRequest(
            prompt_token_ids=[1 + i % 250, *range(1, 59)], max_tokens=32, ignore_eos=True
        )
        start_together.wait(timeout=60)
        try:
            responses = list(cluster.stub.Generate(request, timeout=120))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            hints = dict(err.trailing_metadata() or ())
            assert float(hints["retry-after"]) > 0
            return "refused"
        assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        return "served"

    with concurrent.futures.ThreadPoolExecutor(num_calls) as pool:
        outcomes = list(pool.map(call, range(num_calls)))
    assert outcomes.count("served") >= MAX_QUEUED
    assert outcomes.count("refused") > 0
    assert greedy_stream(cluster, [5, 6, 7], 4)  # still serving normally


def test_a_hung_stage_turns_health_not_serving_and_status_names_it(cluster: Cluster) -> None:
    pid = cluster.worker_pid(stage=1)
    request = generate_pb2.GenerateRequest(
        prompt_token_ids=[3, 4, 5], max_tokens=300, ignore_eos=True
    )
    call = cluster.stub.Generate(request, timeout=60)
    next(call)
    os.kill(pid, signal.SIGSTOP)  # alive, socket open, answering nothing
    try:
        # The stall shows 1.5 s in (--stall-timeout), until the heartbeat timeout (4 s) takes
        # the pipeline down; a status, not the health check (whose 1 s RPC deadline a busy
        # machine can miss), says when.
        wait_until(lambda: [s.stage for s in cluster.status().stages if s.stalled] == [1], 5,
                   "stage 1 stalled")  # fmt: skip
        status = cluster.status()
        assert not status.serving and "stage 1" in status.problem
        assert not cluster.healthy()
    finally:
        os.kill(pid, signal.SIGCONT)
    call.cancel()
    wait_until(cluster.healthy, 30, "health SERVING again")


def test_y_killed_stage_recovers_and_every_stream_equals_an_undisturbed_run(
    cluster: Cluster,
) -> None:
    prompts = [[5, 17, 33, 80, 101, 7, 9], list(range(40, 90)), [250, 3, 3, 3], [9, 8, 7, 6]]
    max_tokens = 120
    # The last stream samples (temperature 0.8, top-p 0.9): its draws depend on its seed and
    # positions alone, so the recompute after the rebuild draws them again the same.
    sampled = generate_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=77)
    kinds = [None, None, None, sampled]
    work = list(zip(prompts, kinds, strict=True))
    undisturbed = [greedy_stream(cluster, p, max_tokens, k) for p, k in work]
    assert undisturbed[3] != greedy_stream(cluster, prompts[3], max_tokens)  # it does sample
    hits_before = cluster.status().scheduler.prefix_cache.num_hit_requests
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(greedy_stream, cluster, p, max_tokens, k) for p, k in work]
        wait_until(lambda: cluster.status().scheduler.num_running == len(prompts), 20, "running")
        time.sleep(0.3)  # tokens are streaming
        # The second prompt (3 full KV blocks) started from the undisturbed run's cached prefix;
        # the rebuilt workers hold no KV: a recompute that found a cached block now would
        # read zeros, and its stream would differ.
        cache = cluster.status().scheduler.prefix_cache
        assert cache.num_hit_requests > hits_before and cache.num_cached_blocks > 0
        killed_at = time.monotonic()
        os.kill(cluster.worker_pid(stage=1), signal.SIGKILL)
        wait_until(lambda: not cluster.status().serving, 10, "stage noticed down")
        detect_s = time.monotonic() - killed_at
        assert any(not s.up for s in cluster.status().stages) or not cluster.healthy()
        wait_until(cluster.healthy, 120, "pipeline rebuilt")
        recover_s = time.monotonic() - killed_at
        streams = [f.result(timeout=120) for f in futures]
    print(f"\nkill -9 of stage 1: detected in {detect_s:.2f} s, serving again {recover_s:.2f} s")
    assert streams == undisturbed  # no token missing or repeated, every request completed


def test_x_a_cut_stream_resumed_with_its_tokens_and_seed_is_the_uncut_stream(
    cluster: Cluster,
) -> None:
    prompt, max_tokens = [11, 12, 13, 14, 15], 60
    for sampling in (None, generate_pb2.SamplingParams(temperature=0.8, top_p=0.9)):
        request = generate_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, sampling=sampling
        )
        call = cluster.stub.Generate(request, timeout=60)
        first = next(call)
        received = list(first.token_ids)
        while len(received) < 20:
            received += next(call).token_ids
        call.cancel()  # the cut
        # The seed the server drew for the first call, given back, makes the draws the same.
        request.sampling.seed = first.seed
        whole = greedy_stream(cluster, prompt, max_tokens, request.sampling)
        request.resume_token_ids.extend(received)
        rest = list(cluster.stub.Generate(request, timeout=60))
        assert received + [t for r in rest for t in r.token_ids] == whole
        assert rest[-1].num_output_tokens == max_tokens
    assert cluster.status().scheduler.kv_usage_pct == 0.0


request_fields = st.fixed_dictionaries(
    {},
    optional={
        "request_id": st.text(max_size=40),
        "prompt": st.text(max_size=300),
        "prompt_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=80),
        "max_tokens": st.integers(0, 2**32 - 1),
        "stop": st.lists(st.text(max_size=300), max_size=12),
        "stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=10),
        "resume_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=20),
        "ignore_eos": st.booleans(),
        "apply_chat_template": st.booleans(),
        "sampling": st.builds(
            generate_pb2.SamplingParams,
            temperature=st.floats(width=32, allow_nan=True, allow_infinity=True),
            top_p=st.floats(width=32, allow_nan=True, allow_infinity=True),
            top_k=st.integers(-(2**31), 2**31 - 1),
            seed=st.integers(0, 2**64 - 1),
        ),
    },
)
CLEAN_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
}
FUZZ_CASES = int(os.environ.get("SARATHI_FUZZ_CASES", "150"))


def test_z_fuzzed_requests_end_cleanly_and_the_server_survives(cluster: Cluster) -> None:
    tried = []

    @settings(
        max_examples=FUZZ_CASES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(fields=request_fields)
    def one_call(fields: dict[str, object]) -> None:
        tried.append(1)
        request = generate_pb2.GenerateRequest(**fields)  # type: ignore[arg-type]
        try:
            responses = list(cluster.stub.Generate(request, timeout=60))
        except grpc.RpcError as err:
            assert err.code() in CLEAN_ERRORS, (err.code(), err.details())
            return
        assert responses and responses[-1].finish_reason != 0

    one_call()
    print(f"\nfuzz: {len(tried)} Generate calls, server alive")
    assert cluster.proc.poll() is None and cluster.healthy()
    assert len(greedy_stream(cluster, [5, 6, 7], 4)) == 4


def test_zz_controller_restart_workers_re_register_and_old_clients_get_unavailable(
    cluster: Cluster,
) -> None:
    controller = [
        pid
        for pid in _processes_using(str(cluster.model_dir))
        if b"-m\0controller" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(controller) == 1
    request = generate_pb2.GenerateRequest(
        prompt_token_ids=[3, 4, 5], max_tokens=500, ignore_eos=True
    )
    call = cluster.stub.Generate(request, timeout=60)
    next(call)
    # A sampled stream with no seed of its own, through the client that resumes by itself.
    sampled = generate_pb2.GenerateRequest(
        prompt_token_ids=[21, 22, 23],
        max_tokens=300,
        ignore_eos=True,
        sampling=generate_pb2.SamplingParams(temperature=0.8, top_p=0.9),
    )
    retries: list[int] = []
    with Client(cluster.addr) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        responses = client.generate_resumable(
            sampled,
            120,
            RetryPolicy(max_retries=30),
            lambda n, limit, got, err: retries.append(got),
        )
        first = next(responses)
        resumed = pool.submit(lambda: [first, *responses])
        killed_at = time.monotonic()
        os.kill(controller[0], signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_until(cluster.healthy, 120, "a new controller serving with re-registered workers")
        print(f"\ncontroller kill -9: serving again after {time.monotonic() - killed_at:.2f} s")
        streamed = resumed.result(timeout=120)
    assert retries and 0 < retries[0] < 300  # it was cut mid-stream, and resumed
    tokens = [t for r in streamed for t in r.token_ids]
    assert len(tokens) == 300  # no token lost or repeated across the cut
    # What follows the cut continues what came before it, with the same draws: a resume of the
    # same tokens now, alone like the resumed one, streams the same. (test_x compares a resume
    # with a fresh run; here, over 300 tokens, a float rounding that differs between the tokens
    # recomputed in chunks and decoded one at a time flipped a draw once in ~30 runs.)
    cut = retries[0]
    sampled.sampling.seed = first.seed
    sampled.resume_token_ids.extend(tokens[:cut])
    continuation = list(cluster.stub.Generate(sampled, timeout=120))
    assert [t for r in continuation for t in r.token_ids] == tokens[cut:]
