"""`sarathictl up --local --pp 2 --tp 2` on a tiny random model, checked over gRPC.

Its 4 layers are split 3/1 (`--layer-split`): the oracle tests then check an uneven pipeline.

One cluster for the module (5 processes on a 2-core machine take a while to start); each test
asserts what a client of the API would notice.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from sarathi_proto import generate_pb2

from tests.integration.cluster_factories import make_tiny_served_model, oracle_greedy
from tests.integration.local_cluster import RunningCluster, generate, local_cluster

pytestmark = pytest.mark.integration


def _processes_using(marker: str) -> list[int]:
    """PIDs whose command line mentions marker (the test's unique model folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")
    up_args = [
        "--pp", "2", "--tp", "2", "--budget", "64", "--kv-cache-mb", "16", "--dtype", "float32",
        "--layer-split", "3,1",
    ]  # fmt: skip
    with local_cluster(model_dir, tmp_path_factory.mktemp("logs"), up_args) as running:
        yield running


PROMPTS = [[5, 17, 33, 80, 101, 7, 9], list(range(40, 140)), [250, 3, 3, 3], list(range(1, 70))]


def test_outputs_equal_the_transformers_oracle_with_requests_in_flight(
    cluster: RunningCluster,
) -> None:
    max_tokens = 12
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [
            pool.submit(
                generate, cluster, prompt_token_ids=p, max_tokens=max_tokens, ignore_eos=True
            )
            for p in PROMPTS
        ]
        streams = [f.result() for f in futures]
    for prompt, stream in zip(PROMPTS, streams, strict=True):
        tokens = [t for r in stream for t in r.token_ids]
        assert tokens == oracle_greedy(cluster.model_dir, prompt, max_tokens)
        assert stream[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert stream[-1].num_output_tokens == max_tokens
        assert stream[-1].num_prompt_tokens == len(prompt)
        assert stream[-1].ttft_s > 0


def test_prompts_that_start_like_an_earlier_one_hit_the_cache_and_equal_the_oracle(
    cluster: RunningCluster,
) -> None:
    # After the test above: PROMPTS[1] (100 tokens, 6 full blocks) and PROMPTS[3] (69, 4) are
    # cached; prefixes of them cut around a block edge, and one whole, start past them.
    before = cluster.stub.Status(generate_pb2.StatusRequest(), timeout=5).scheduler.prefix_cache
    asked = [[*PROMPTS[1][:31], 7, 8], PROMPTS[1][:33], PROMPTS[3][:64], PROMPTS[1]]
    for prompt in asked:
        stream = generate(cluster, prompt_token_ids=prompt, max_tokens=6, ignore_eos=True)
        assert [t for r in stream for t in r.token_ids] == oracle_greedy(
            cluster.model_dir, prompt, 6
        )
    after = cluster.stub.Status(generate_pb2.StatusRequest(), timeout=5).scheduler.prefix_cache
    assert after.enabled and after.num_hit_requests - before.num_hit_requests == 4
    assert after.num_cached_tokens - before.num_cached_tokens == 16 + 32 + 63 + 96


def test_streamed_text_equals_the_decoded_tokens(cluster: RunningCluster) -> None:
    from controller.tokenizer import Tokenizer

    stream = generate(cluster, prompt="The capital of France", max_tokens=16, ignore_eos=True)
    tokens = [t for r in stream for t in r.token_ids]
    assert len(stream) >= 2  # streamed, not one message at the end
    assert "".join(r.text for r in stream) == Tokenizer.from_dir(cluster.model_dir).decode(tokens)


def test_stop_string_ends_the_text_right_before_it(cluster: RunningCluster) -> None:
    free = generate(cluster, prompt="Chunked prefills", max_tokens=24, ignore_eos=True)
    text = "".join(r.text for r in free)
    stop = text[5:7]
    assert stop  # the tiny model produced some text to cut
    stopped = generate(
        cluster, prompt="Chunked prefills", max_tokens=24, ignore_eos=True, stop=[stop]
    )
    assert "".join(r.text for r in stopped) == text[: text.index(stop)]
    assert stopped[-1].finish_reason == generate_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": [1] * 1000, "max_tokens": 100}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
        ({"prompt": "hi", "sampling": generate_pb2.SamplingParams(temperature=-1)}, "temperature"),
        ({"prompt": "hi", "sampling": generate_pb2.SamplingParams(top_p=1.5)}, "top_p"),
        ({"prompt": "hi", "sampling": generate_pb2.SamplingParams(top_k=-2)}, "top_k"),
        ({"prompt": "hi", "stop": [f"s{i}" for i in range(20)]}, "stop"),
        ({"prompt_token_ids": [1, 99999]}, "prompt_token_ids"),
    ],
)
def test_bad_requests_end_with_invalid_argument_naming_the_field(
    cluster: RunningCluster, fields: dict[str, object], field_name: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(cluster, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in err.value.details()
    status = cluster.stub.Status(generate_pb2.StatusRequest(), timeout=5)
    assert status.scheduler.num_waiting == 0  # nothing was queued


def test_cancelled_stream_frees_its_kv_blocks(cluster: RunningCluster) -> None:
    call = cluster.stub.Generate(
        generate_pb2.GenerateRequest(prompt_token_ids=PROMPTS[1], max_tokens=400, ignore_eos=True)
    )
    next(call)  # the sequence holds KV blocks now
    running = cluster.stub.Status(generate_pb2.StatusRequest(), timeout=5).scheduler
    assert running.kv_usage_pct > 0
    call.cancel()
    deadline = time.monotonic() + 10
    while True:
        sched = cluster.stub.Status(generate_pb2.StatusRequest(), timeout=5).scheduler
        if sched.kv_usage_pct == 0 and sched.num_running == 0:
            break
        assert time.monotonic() < deadline, f"blocks still held: {sched}"
        time.sleep(0.05)


def test_status_shows_every_stage_with_its_ranks(cluster: RunningCluster) -> None:
    status = cluster.stub.Status(generate_pb2.StatusRequest(), timeout=5)
    assert [s.stage for s in status.stages] == [0, 1]
    assert all(list(s.tp_ranks) == [0, 1] for s in status.stages)
    assert status.scheduler.policy == "sarathi" and status.scheduler.pipeline_depth == 2
    assert status.scheduler.tensor_parallel == 2
    assert all(s.step_time_p50_s > 0 for s in status.stages)  # earlier tests ran steps


def test_each_stage_holds_the_layers_of_the_split(cluster: RunningCluster) -> None:
    for stage, layers in [(0, "layers 0..2 (3 of 4)"), (1, "layers 3..3 (1 of 4)")]:
        for rank in (0, 1):
            log = (cluster.log_dir / f"stage{stage}-rank{rank}.log").read_text()
            assert layers in log, log[-2000:]


def test_status_command_prints_a_table_and_json(cluster: RunningCluster) -> None:
    import json

    out = subprocess.run(
        [sys.executable, "-m", "sarathictl.cli", "status", "--addr", cluster.addr, "--json"],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    stages = json.loads(out)["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    assert [s["device"] for s in stages] == ["cpu", "cpu"]  # each stage's rank 0, as it said
    table = subprocess.run(
        [sys.executable, "-m", "sarathictl.cli", "status", "--addr", cluster.addr],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    assert "pipeline stages" in table and "sarathi" in table
    assert "prefix cache" in table and "token hit %" in table
    cache = json.loads(out)["scheduler"]["prefixCache"]
    assert cache["enabled"] and int(cache["numHitRequests"]) > 0  # the tests above hit


def test_generate_command_samples_n_answers_each_with_its_own_seed(
    cluster: RunningCluster,
) -> None:
    import json

    def sarathictl_generate(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sarathictl.cli", "generate", "The capital of France",
             "--addr", cluster.addr, "--max-tokens", "6", "--ignore-eos", *flags],
            capture_output=True, check=True, text=True, timeout=60,
        )  # fmt: skip

    sampled = ("--temperature", "0.9", "--seed", "11")
    many = json.loads(sarathictl_generate("--n", "3", *sampled, "--json").stdout)
    assert [c["seed"] for c in many["choices"]] == [11, 12, 13]
    assert [len(c["token_ids"]) for c in many["choices"]] == [6, 6, 6]
    assert {c["finish_reason"] for c in many["choices"]} == {"length"}
    one = json.loads(sarathictl_generate(*sampled, "--json").stdout)
    assert one["seed"] == 11 and len(one["token_ids"]) == 6 and "choices" not in one
    shown = sarathictl_generate("--n", "2", *sampled)
    assert "--- choice 0 ---" in shown.stdout and "--- choice 1 ---" in shown.stdout
    assert "choice 1: length: 6 tokens" in shown.stderr


def test_reflection_lists_the_generation_service(cluster: RunningCluster) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(cluster.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    names = {s.name for s in reply.list_services_response.service}
    assert "sarathi.v1.Generation" in names and "grpc.health.v1.Health" in names


def test_tune_budget_profiles_the_pipeline_and_writes_a_loadable_profile(
    cluster: RunningCluster, tmp_path: Path
) -> None:
    import json

    from controller.simulator.profile import MeasuredProfile

    profile = tmp_path / "profile.csv"
    run = subprocess.run(
        [sys.executable, "-m", "sarathictl.cli", "tune-budget", "--addr", cluster.addr,
         "--tbt-slo", "30", "--tile", "16", "--repeats", "1", "--profile-out", str(profile),
         "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    # A generous SLO: the cluster's own budget (64) is the largest micro-batch it can form.
    assert result["budget_tokens"] == 64
    assert [r["num_tokens"] for r in result["rows"]] == [16, 32, 48, 64]
    loaded = MeasuredProfile.from_csv(profile, num_stages=2)
    assert all(loaded.stage_time_s(n, n) > 0 for n in (16, 64))  # tiny model: no monotony
    impossible = subprocess.run(
        [sys.executable, "-m", "sarathictl.cli", "tune-budget", "--addr", cluster.addr,
         "--tbt-slo", "0.000001", "--tile", "16", "--repeats", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert impossible.returncode == 1 and "no micro-batch" in impossible.stdout


def test_zz_sigterm_stops_every_process(cluster: RunningCluster) -> None:
    # Runs last in this module (name order): the shutdown a user gets from Ctrl-C or SIGTERM.
    assert len(_processes_using(str(cluster.model_dir))) >= 6  # up, controller, 4 workers
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while _processes_using(str(cluster.model_dir)):
        assert time.monotonic() < deadline, "processes left behind"
        time.sleep(0.2)
