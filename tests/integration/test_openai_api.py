"""The OpenAI-compatible HTTP API of a real local cluster (controller + 2 stages) on a tiny random
Llama, called with the official `openai` client, and checked against gRPC `Generate`; and its
Prometheus metrics, as Grafana and an inference gateway read them.

One cluster for the module (start-up costs seconds on a 2-core machine).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from sarathi_proto import generate_pb2, generate_pb2_grpc
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig, free_port, pinned_cpus

from controller.metrics import INFERENCE_GATEWAY_METRICS
from controller.tokenizer import Tokenizer
from stage_worker.cpu_pinning import format_cpu_list
from tests.integration.cluster_factories import make_tiny_served_model

pytestmark = pytest.mark.integration

QUESTION_TEXT = "The capital of France"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION_TEXT}]


@dataclass
class Served:
    cluster: LocalCluster
    model_dir: Path
    metrics_port: int
    client: OpenAI
    grpc_stub: generate_pb2_grpc.GenerationStub

    @property
    def model(self) -> str:
        return self.model_dir.name

    @property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_dir(self.model_dir)

    def status(self) -> generate_pb2.SchedulerStatus:
        return self.grpc_stub.Status(generate_pb2.StatusRequest(), timeout=5).scheduler

    def grpc_text(self, **fields: Any) -> tuple[str, generate_pb2.GenerateResponse]:
        stream = list(self.grpc_stub.Generate(generate_pb2.GenerateRequest(**fields), timeout=120))
        return "".join(r.text for r in stream), stream[-1]


@contextlib.contextmanager
def start_served(tmp_path_factory: pytest.TempPathFactory, pp: int) -> Iterator[Served]:
    model_dir = make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")
    metrics_port = free_port()
    config = LocalClusterConfig(
        model_dir=str(model_dir),
        pp=pp,
        budget_tokens=64,
        port=0,
        http_port=0,
        kv_cache_bytes=16 << 20,
        log_dir=str(tmp_path_factory.mktemp("logs")),
        extra_controller_args=("--metrics-port", str(metrics_port)),
    )
    cluster = LocalCluster(config)
    cluster.start(timeout_s=240)
    channel = grpc.insecure_channel(cluster.addr)
    client = OpenAI(base_url=cluster.http_base_url, api_key="unused", timeout=120, max_retries=0)
    try:
        yield Served(
            cluster, model_dir, metrics_port, client, generate_pb2_grpc.GenerationStub(channel)
        )
    finally:
        client.close()
        channel.close()
        cluster.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with start_served(tmp_path_factory, pp=2) as running:
        yield running


@pytest.fixture(scope="module")
def served_pp1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with start_served(tmp_path_factory, pp=1) as running:
        yield running


@pytest.fixture(params=[1, 2], ids=["pp1", "pp2"])
def any_pp(request: pytest.FixtureRequest) -> Served:
    """The request-field tests (issue 22) run against PP=1 and PP=2."""
    served: Served = request.getfixturevalue("served_pp1" if request.param == 1 else "served")
    return served


def test_health_and_models(served: Served) -> None:
    assert httpx.get(f"http://127.0.0.1:{served.cluster.http_port}/health").status_code == 200
    assert [m.id for m in served.client.models.list().data] == [served.model]


def test_an_idle_connection_outlives_a_pooling_client_s_pause(served: Served) -> None:
    """A client that pools connections (aiohttp keeps them 60 s in `vllm bench serve`) sends
    its next request on the connection it last used, however long it was idle: the server must
    not have closed it after uvicorn's default 5 s."""
    conn = http.client.HTTPConnection("127.0.0.1", served.cluster.http_port, timeout=30)
    try:
        for pause_s in (0.0, 6.0):
            time.sleep(pause_s)
            conn.request("GET", "/health")  # on the same socket: http.client reopens none
            response = conn.getresponse()  # RemoteDisconnected where the server closed it
            assert (response.status, response.read()) == (200, b'{"status":"ok"}')
    finally:
        conn.close()


def test_chat_streamed_equals_non_streamed_equals_grpc_with_usage(served: Served) -> None:
    args: dict[str, Any] = {
        "model": served.model,
        "messages": QUESTION,
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = served.client.chat.completions.create(**args)
    stream = served.client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    grpc_text, grpc_last = served.grpc_text(
        prompt=QUESTION_TEXT, apply_chat_template=True, max_tokens=24, ignore_eos=True
    )

    text = whole.choices[0].message.content
    assert text and len([c for c in chunks if c.choices]) > 3  # streamed in pieces
    assert streamed == text == grpc_text
    assert whole.choices[0].finish_reason == "length"
    tokenizer = served.tokenizer
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    assert whole.usage is not None and chunks[-1].usage is not None
    assert whole.usage.prompt_tokens == len(prompt_ids) == grpc_last.num_prompt_tokens
    assert whole.usage.completion_tokens == 24 == grpc_last.num_output_tokens
    assert whole.usage.total_tokens == len(prompt_ids) + 24
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completion_streamed_equals_non_streamed_equals_grpc_with_usage(served: Served) -> None:
    prompt = "Chunked prefills split"
    args: dict[str, Any] = {
        "model": served.model,
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = served.client.completions.create(**args)
    chunks = list(
        served.client.completions.create(
            **args, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    grpc_text, grpc_last = served.grpc_text(prompt=prompt, max_tokens=20, ignore_eos=True)

    assert whole.choices[0].text
    assert streamed == whole.choices[0].text == grpc_text
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(served.tokenizer.encode(prompt))
    assert whole.usage.prompt_tokens == grpc_last.num_prompt_tokens
    assert whole.usage.completion_tokens == 20
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    )


def test_stop_string_ends_the_text_before_it(served: Served) -> None:
    args: dict[str, Any] = {
        "model": served.model,
        "prompt": "Pipelines keep",
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    text = served.client.completions.create(**args).choices[0].text
    stop = text[5:7]
    assert stop  # the tiny model produced text to cut
    stopped = served.client.completions.create(**args, stop=[stop]).choices[0]
    assert stopped.text == text[: text.index(stop)]
    assert stopped.finish_reason == "stop"


def test_seed_makes_sampled_answers_repeatable(served: Served) -> None:
    def sample(seed: int) -> str | None:
        reply = served.client.chat.completions.create(
            model=served.model, messages=QUESTION, max_tokens=16, temperature=1.0, seed=seed
        )
        return reply.choices[0].message.content

    assert sample(1234) == sample(1234)


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 129}, "n"),
        ({"max_tokens": 5000}, "max_tokens"),  # prompt + 5000 > max_model_len (1024)
        ({"messages": [{"role": "user", "content": "ab" * 1500}]}, "messages"),  # no room left
        ({"stop": [f"s{i}" for i in range(20)]}, "stop"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_request_is_400_naming_the_field(
    served: Served, fields: dict[str, Any], field_name: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        served.client.chat.completions.create(
            **{"model": served.model, "messages": QUESTION, **fields}
        )
    assert err.value.status_code == 400
    assert isinstance(err.value.body, dict)
    assert err.value.body["param"] == field_name
    assert field_name in err.value.body["message"]
    assert served.status().num_waiting == 0  # nothing was queued


def test_another_model_name_is_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)


def _aborted_count(served: Served) -> float:
    text = httpx.get(f"http://127.0.0.1:{served.metrics_port}/metrics").text
    found = re.search(
        r'^sarathi:request_success_total\{finished_reason="abort"\} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


def test_closing_a_stream_early_frees_its_kv_blocks(served: Served) -> None:
    aborted_before = _aborted_count(served)
    stream = served.client.chat.completions.create(
        model=served.model,
        messages=QUESTION,
        max_tokens=900,  # far more than can run before the checks below
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break  # the sequence is decoding and holds KV blocks now
    assert served.status().kv_usage_pct > 0
    stream.close()  # drops the HTTP connection mid-answer
    deadline = time.monotonic() + 10
    while True:
        sched = served.status()
        if sched.kv_usage_pct == 0 and sched.num_running == 0:
            break
        assert time.monotonic() < deadline, f"blocks still held: {sched}"
        time.sleep(0.05)
    assert _aborted_count(served) == aborted_before + 1  # ended by the abort, not by finishing


# ---- Prometheus metrics: where users and inference gateways look --------------------------------
DASHBOARD = (
    Path(__file__).resolve().parents[2]
    / "deploy"
    / "helm"
    / "sarathi-cluster"
    / "dashboards"
    / "sarathi-cluster.json"
)


def _exposition(url: str) -> dict[str, Metric]:
    """Metric families by name, as Prometheus parses them (counters lose `_total` here)."""
    text = httpx.get(url, timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def _sample_names(families: dict[str, Metric]) -> set[str]:
    return {sample.name for family in families.values() for sample in family.samples}


def _dashboard_series(node: object) -> set[str]:
    """Every `sarathi:` series named in the dashboard's queries."""
    if isinstance(node, dict):
        found = set(re.findall(r"sarathi:[a-z_]+", node.get("expr", "")))
        return found.union(*(_dashboard_series(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_dashboard_series(v) for v in node))
    return set()


@pytest.fixture(scope="module")
def exposition(served: Served) -> dict[str, Metric]:
    """The HTTP port's /metrics after one finished request and a stage-gauge refresh."""
    served.grpc_text(prompt="Hello", max_tokens=4)
    url = f"http://127.0.0.1:{served.cluster.http_port}/metrics"
    deadline = time.monotonic() + 10
    families = _exposition(url)
    while not families["sarathi:stage_idle_ratio"].samples and time.monotonic() < deadline:
        time.sleep(0.2)  # the stage gauges are refreshed once a second
        families = _exposition(url)
    return families


def test_metrics_on_the_openai_port_as_on_the_metrics_port(
    served: Served, exposition: dict[str, Metric]
) -> None:
    own_port = _exposition(f"http://127.0.0.1:{served.metrics_port}/metrics")
    assert set(own_port) == set(exposition)
    assert exposition["sarathi:generation_tokens"].samples[0].value >= 4
    assert exposition["sarathi:prompt_tokens"].samples[0].value >= 1


def test_the_inference_gateway_finds_its_gauges(exposition: dict[str, Metric]) -> None:
    for role, name in INFERENCE_GATEWAY_METRICS.items():
        assert name in exposition, f"{role} ({name}) is not exported"
        assert exposition[name].type == "gauge", f"{role} must be a gauge"
    kv_usage = exposition[INFERENCE_GATEWAY_METRICS["KVCacheUtilization"]].samples[0].value
    assert 0.0 <= kv_usage <= 1.0


def test_every_series_the_dashboard_queries_is_exported(exposition: dict[str, Metric]) -> None:
    used = _dashboard_series(json.loads(DASHBOARD.read_text()))
    assert {"sarathi:stage_bubble_ratio", "sarathi:stage_idle_ratio"} <= used
    missing = sorted(used - _sample_names(exposition))
    assert missing == [], f"the dashboard queries series the controller does not export: {missing}"


def test_each_cpu_worker_runs_on_its_own_core_every_thread_of_it(served: Served) -> None:
    """PP=2 on a machine of 2 cores or more: worker k on core k alone (its ZeroMQ, keepalive
    and torch threads too), the controller free to run anywhere."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one core: two workers' shares do not go round, and neither is pinned")
    workers = [proc for name, proc in served.cluster.procs if name.startswith("stage")]
    assert len(workers) == 2
    shares = [pinned_cpus(served.cluster.config, rank) for rank in range(2)]
    assert shares[0] and not set(shares[0]) & set(shares[1])  # each its own, none shared
    for rank, proc in enumerate(workers):
        masks = set()
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                status = (task / "status").read_text()
                masks.add(status.split("Cpus_allowed_list:")[1].split()[0])
        assert masks == {format_cpu_list(shares[rank])}, (rank, masks)
        assert len(list(Path(f"/proc/{proc.pid}/task").iterdir())) > 2  # not the main alone
    controller = next(proc for name, proc in served.cluster.procs if name == "controller")
    assert os.sched_getaffinity(controller.pid) == set(allowed)


def test_each_stage_splits_its_time_into_busy_bubble_and_idle(
    exposition: dict[str, Metric],
) -> None:
    shares: dict[str, float] = {}
    for name in ("stage_utilization_ratio", "stage_bubble_ratio", "stage_idle_ratio"):
        for sample in exposition[f"sarathi:{name}"].samples:
            shares[sample.labels["stage"]] = shares.get(sample.labels["stage"], 0.0) + sample.value
    assert sorted(shares) == ["0", "1"]
    assert all(total == pytest.approx(1.0, abs=1e-6) for total in shares.values())


def test_logprobs_through_grpc_and_the_openai_client_are_transformers_log_softmax(
    any_pp: Served,
) -> None:
    """PP 1 and 2, float32: each token's log-probability and its top alternatives, through gRPC and
    through the official client (completions and chat), equal transformers' log_softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = any_pp.tokenizer.encode("The pipeline")
    top = 3
    responses = list(
        any_pp.grpc_stub.Generate(
            generate_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=6, ignore_eos=True, logprobs=top
            ),
            timeout=120,
        )
    )
    tokens = [t for r in responses for t in r.token_ids]
    entries = [e for r in responses for e in r.logprobs]
    assert len(entries) == len(tokens) == 6
    model = AutoModelForCausalLM.from_pretrained(any_pp.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, dim=-1)  # [6, vocab]
    for i, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(float(expected[i, tokens[i]]), abs=1e-4)
        best = torch.topk(expected[i], top)
        assert list(entry.top_token_ids) == best.indices.tolist()
        assert list(entry.top_logprobs) == pytest.approx(best.values.tolist(), abs=1e-4)

    completion = any_pp.client.completions.create(
        model=any_pp.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=top,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    legacy = completion.choices[0].logprobs
    assert legacy is not None and legacy.token_logprobs is not None
    assert legacy.token_logprobs == pytest.approx([e.logprob for e in entries], abs=1e-6)
    assert legacy.top_logprobs is not None and all(len(m) <= top for m in legacy.top_logprobs)
    chat = any_pp.client.chat.completions.create(
        model=any_pp.model, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None and len(content.content) == 4
    assert all(len(entry.top_logprobs) == 2 for entry in content.content)
    assert all(entry.logprob <= 0.0 for entry in content.content)


def test_penalties_bias_and_min_tokens_through_grpc_and_the_openai_client(any_pp: Served) -> None:
    """PP 1 and 2: a +100 bias makes its token every token, on both APIs; min_tokens holds the
    end-of-sequence token back; frequency and presence penalties change a greedy stream."""
    prompt = any_pp.tokenizer.encode("The pipeline")
    token = 42
    completion = any_pp.client.completions.create(
        model=any_pp.model, prompt=prompt, max_tokens=5, temperature=0,
        logit_bias={str(token): 100}, extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert completion.choices[0].model_extra is not None
    assert completion.choices[0].model_extra["token_ids"] == [token] * 5
    sampling = generate_pb2.SamplingParams(logit_bias={token: 100.0})
    responses = list(
        any_pp.grpc_stub.Generate(
            generate_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=5, sampling=sampling),
            timeout=120,
        )
    )
    assert [t for r in responses for t in r.token_ids] == [token] * 5
    # The end-of-sequence token pushed to the top, held back for 3 tokens, then it ends the stream.
    eos = min(any_pp.tokenizer.eos_token_ids)
    sampling = generate_pb2.SamplingParams(logit_bias={eos: 100.0}, min_tokens=3)
    responses = list(
        any_pp.grpc_stub.Generate(
            generate_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=10, sampling=sampling),
            timeout=120,
        )
    )
    tokens = [t for r in responses for t in r.token_ids]
    assert len(tokens) == 4 and eos not in tokens[:3] and tokens[3] == eos
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_STOP

    def greedy(**penalties: float) -> str:
        answer = any_pp.client.completions.create(
            model=any_pp.model, prompt=prompt, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True}, **penalties,  # type: ignore[arg-type]
        )  # fmt: skip
        return answer.choices[0].text

    assert greedy(frequency_penalty=2.0) != greedy()
    assert greedy(presence_penalty=2.0) != greedy()


leaf_schemas = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda words: {"enum": words}
    ),
)  # fmt: skip
schemas = st.recursive(
    leaf_schemas,
    lambda inner: st.one_of(
        st.dictionaries(
            st.text("abcdef", min_size=1, max_size=4), inner, min_size=1, max_size=3
        ).map(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            }
        ),
        inner.map(lambda item: {"type": "array", "items": item, "maxItems": 3}),
    ),
    max_leaves=5,
)


def test_structured_output_always_parses_under_its_schema(any_pp: Served) -> None:
    """Hypothesis over JSON schemas (objects, arrays, bounded integers and strings, enums),
    through the official client's response_format at PP 1 and 2: every output is JSON valid
    under its schema, though the model (random weights) would rarely write JSON by itself."""
    import jsonschema

    @settings(max_examples=int(os.environ.get("SARATHI_SCHEMA_CASES", "12")), deadline=None,
              suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
    @given(schema=schemas)
    def one(schema: dict[str, Any]) -> None:
        answer = any_pp.client.chat.completions.create(
            model=any_pp.model, messages=QUESTION, max_tokens=300, temperature=0.8, seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        )  # fmt: skip
        text = answer.choices[0].message.content or ""
        assert answer.choices[0].finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)

    one()


def test_regex_choice_and_json_object_through_grpc_and_the_openai_client(any_pp: Served) -> None:
    def grpc_text(structured: generate_pb2.StructuredOutput) -> str:
        text, last = any_pp.grpc_text(
            prompt="Say something", max_tokens=64, structured_output=structured,
            sampling=generate_pb2.SamplingParams(temperature=0.8, seed=3),
        )  # fmt: skip
        assert last.finish_reason == generate_pb2.FINISH_REASON_STOP, text
        return text

    pattern = r"[a-c]{2,5}-\d\d"
    assert re.fullmatch(pattern, grpc_text(generate_pb2.StructuredOutput(regex=pattern)))
    choices = ["red", 'green "quoted"', "naïve"]
    picked = grpc_text(generate_pb2.StructuredOutput(choice=generate_pb2.Choices(choices=choices)))
    assert picked in choices
    assert isinstance(json.loads(grpc_text(generate_pb2.StructuredOutput(json_object=True))), dict)
    via_openai = any_pp.client.completions.create(
        model=any_pp.model, prompt="Pick", max_tokens=32, extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert via_openai.choices[0].text in choices
    with pytest.raises(openai.BadRequestError) as err:
        any_pp.client.completions.create(
            model=any_pp.model, prompt="x", extra_body={"guided_regex": "[a-"}
        )
    assert err.value.body["param"] == "guided_regex"  # type: ignore[index]


def test_echo_with_logprobs_scores_the_prompt_like_transformers(any_pp: Served) -> None:
    """What lm-evaluation-harness sends for loglikelihood: echo, logprobs, max_tokens 0. The
    prompt's log-probabilities (the first token has none) equal transformers' log_softmax, on
    the official client streamed and not, and on gRPC's prompt_logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    text = "The pipeline stays busy because every micro-batch carries the same work"
    prompt = any_pp.tokenizer.encode(text)
    model = AutoModelForCausalLM.from_pretrained(any_pp.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(prompt[1:])[:, None])
    expected_list = expected[:, 0].tolist()

    whole = any_pp.client.completions.create(
        model=any_pp.model, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = whole.choices[0]
    assert choice.text == text and choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None and choice.logprobs.top_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected_list, abs=1e-4)
    assert len(choice.logprobs.top_logprobs) == len(prompt)
    assert whole.usage is not None and whole.usage.completion_tokens == 0
    streamed = any_pp.client.completions.create(
        model=any_pp.model, prompt=text, max_tokens=3, echo=True, logprobs=1, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [c for c in streamed if c.choices]
    assert chunks[0].choices[0].text == text  # the prompt first, then the completion
    first = chunks[0].choices[0].logprobs
    assert first is not None and first.token_logprobs is not None
    assert first.token_logprobs[1:] == pytest.approx(expected_list, abs=1e-4)
    assert sum(
        len(c.choices[0].logprobs.tokens or []) for c in chunks if c.choices[0].logprobs
    ) == (len(prompt) + 3)
    responses = list(
        any_pp.grpc_stub.Generate(
            generate_pb2.GenerateRequest(prompt=text, max_tokens=1, prompt_logprobs=0), timeout=60
        )
    )
    scored = [e.logprob for e in responses[0].prompt_logprobs]
    assert scored == pytest.approx(expected_list, abs=1e-4)


WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"enum": [1, 2]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: Any = {"type": "function", "function": {"name": "get_time", "parameters": {}}}


def test_required_and_named_tool_calls_through_the_official_client(any_pp: Served) -> None:
    """PP 1 and 2, sampled: with tool_choice required or a named function the answer is a call, in
    OpenAI's shape, whose arguments parse under the function's schema, streamed or not."""
    import jsonschema

    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = any_pp.client.chat.completions.create(
            model=any_pp.model, messages=QUESTION, max_tokens=200, temperature=0.8, seed=5,
            tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice,  # type: ignore[arg-type]
        )  # fmt: skip
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls", message
        assert message.tool_calls
        for call in message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            schema = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, schema["function"]["parameters"] or {})
        if isinstance(choice, dict):
            assert {c.function.name for c in message.tool_calls} == {"get_weather"}
    stream = any_pp.client.chat.completions.create(
        model=any_pp.model, messages=QUESTION, max_tokens=200, temperature=0.8, seed=5,
        tools=[WEATHER_TOOL], tool_choice="required", stream=True,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function is not None and deltas[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_n_choices_share_the_prompt_and_each_replays_alone_with_its_seed(any_pp: Served) -> None:
    """PP 1 and 2: a prompt of several KV blocks (the full ones shared, the partial one copied)
    sampled n = 3 ways; each choice equals an n = 1 request with the seed plus its index, and
    so does each gRPC choice, streamed interleaved, with its own seed and index."""
    prompt = list(range(3, 3 + 37))  # blocks of 16: two full blocks shared, one copied
    args: dict[str, Any] = {
        "max_tokens": 12,
        "temperature": 0.9,
        "extra_body": {"ignore_eos": True},
    }
    answer = any_pp.client.completions.create(
        model=any_pp.model, prompt=prompt, n=3, seed=77, logprobs=0, **args
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert answer.usage is not None and answer.usage.completion_tokens == 36

    def alone(seed: int) -> str:
        reply = any_pp.client.completions.create(
            model=any_pp.model, prompt=prompt, n=1, seed=seed, **args
        )
        return reply.choices[0].text

    texts = [c.text for c in answer.choices]
    assert texts == [alone(77 + i) for i in range(3)]
    assert len(set(texts)) > 1, "three sampled choices came out the same"

    sampling = generate_pb2.SamplingParams(temperature=0.9, seed=77)
    stream = list(
        any_pp.grpc_stub.Generate(
            generate_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=12, ignore_eos=True, sampling=sampling, n=3
            ),
            timeout=120,
        )
    )
    by_index: dict[int, list[generate_pb2.GenerateResponse]] = {0: [], 1: [], 2: []}
    for response in stream:
        by_index[response.index].append(response)
    assert [by_index[i][0].seed for i in range(3)] == [77, 78, 79]
    assert ["".join(r.text for r in by_index[i]) for i in range(3)] == texts
    assert all(by_index[i][-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH for i in range(3))


def test_n_greedy_choices_equal_the_one_greedy_answer_streamed_or_not(any_pp: Served) -> None:
    """PP 1 and 2: greedy choices are all the greedy answer (the transformers-checked one of
    test_logprobs...), through chat streamed per index, and best_of picks among them."""
    args: dict[str, Any] = {"model": any_pp.model, "max_tokens": 10, "temperature": 0.0}
    one = any_pp.client.chat.completions.create(messages=QUESTION, **args)
    expected = one.choices[0].message.content
    many = any_pp.client.chat.completions.create(messages=QUESTION, n=2, **args)
    assert [c.message.content for c in many.choices] == [expected, expected]
    stream = any_pp.client.chat.completions.create(messages=QUESTION, n=2, stream=True, **args)
    texts = {0: "", 1: ""}
    finishes = {0: 0, 1: 0}
    for part in stream:
        for choice in part.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] += choice.finish_reason is not None
    assert texts == {0: expected, 1: expected} and finishes == {0: 1, 1: 1}
    best = any_pp.client.completions.create(
        model=any_pp.model, prompt=QUESTION_TEXT, max_tokens=6, temperature=1.0, seed=3,
        n=1, best_of=3,
    )  # fmt: skip
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.usage is not None and best.usage.completion_tokens == 18


def test_required_and_named_tool_calls_through_grpc(any_pp: Served) -> None:
    """PP 1 and 2: gRPC's tools_json and tool_choice; the last message lists calls whose
    arguments parse under their function's schema, read out of the streamed text."""
    import jsonschema

    tools = [WEATHER_TOOL, TIME_TOOL]
    for choice in ("required", "get_weather"):
        request = generate_pb2.GenerateRequest(
            prompt=QUESTION_TEXT, apply_chat_template=True, max_tokens=200,
            sampling=generate_pb2.SamplingParams(temperature=0.8, seed=5),
            tools_json=json.dumps(tools), tool_choice=choice,
        )  # fmt: skip
        stream = list(any_pp.grpc_stub.Generate(request, timeout=120))
        calls = stream[-1].tool_calls
        assert calls, "".join(r.text for r in stream)
        assert "<tool_call>" in "".join(r.text for r in stream)
        for call in calls:
            schema = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.name]
            jsonschema.validate(json.loads(call.arguments), schema["function"]["parameters"] or {})
            assert call.id.startswith("call_")
        if choice == "get_weather":
            assert {c.name for c in calls} == {"get_weather"}
