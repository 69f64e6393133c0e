"""`python -m controller`: one serving replica's controller (the pod entry point)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from controller.admission import AdmissionConfig, WhileDown
from controller.app import read_model_config, serve
from controller.bind_error import BindError
from controller.budget_flags import add_budget_flags
from controller.config import ControllerConfig, ParallelConfig, ServerConfig
from controller.flag_types import (
    LayerCounts,
    Number,
    float_above,
    float_in,
    int_at_least,
    port,
    power_of_two,
)
from controller.memory_trace import MemoryTraceConfig, memory_trace
from controller.scheduler import CacheConfig, ConfigError, SchedulerConfig, policy_names
from controller.scheduler.config import CHUNKED_POLICIES
from controller.slo import choose_for_tbt_slo, parse_step_cost
from controller.task_watch import TaskFailed


def build_parser() -> argparse.ArgumentParser:
    """The controller's flags, one group after another; --help lists them in this order."""
    p = argparse.ArgumentParser(prog="python -m controller", description=__doc__)
    add_model_flags(p)
    add_scheduler_flags(p)
    add_api_flags(p)
    add_network_flags(p)
    add_request_and_startup_flags(p)
    add_reliability_flags(p)
    add_memory_trace_flags(p)
    return p


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model and its split into pipeline stages x tensor-parallel ranks."""
    positive = int_at_least(1)
    p.add_argument("--model", required=True, help="model folder (config.json, tokenizer.json)")
    p.add_argument("--pp", type=positive, default=1, help="pipeline stages")
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel ranks per stage")
    p.add_argument(
        "--layer-split",
        type=LayerCounts(),
        default=(),
        help="decoder layers per stage, e.g. 17,13 (default: the workers' split, which gives "
        "the LM head's stage fewer layers)",
    )


def add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    """How micro-batches are built (SchedulerConfig) and the KV cache's block size."""
    positive = int_at_least(1)
    p.add_argument("--policy", default="sarathi", choices=policy_names(), help="batching policy")
    p.add_argument(
        "--budget",
        type=positive,
        default=512,
        help="token budget per micro-batch (a multiple of --tile)",
    )
    p.add_argument(
        "--tile",
        type=power_of_two(),
        default=32,
        help="tile size the budget is a multiple of (a power of two)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive,
        default=None,
        help="most running sequences (default: 128, at most the budget for chunked policies)",
    )
    # The time budget and SLO mode refine the token budget above (sarathictl up shares them).
    add_budget_flags(p)
    p.add_argument(
        "--max-model-len",
        type=int_at_least(2),
        default=None,
        help="most tokens per sequence (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--block-size",
        type=power_of_two(),
        default=16,
        help="tokens per KV-cache block (a power of two)",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt from its first token (default: a prompt starts past its "
        "longest prefix still cached from earlier requests, in full KV blocks)",
    )
    p.add_argument(
        "--no-chunk-pipelining",
        action="store_true",
        help="wait for a prompt's chunk to leave the pipeline before sending its next one",
    )


def add_api_flags(p: argparse.ArgumentParser) -> None:
    """Where the gRPC and HTTP APIs listen, with the observability outputs (the Prometheus port,
    the step log) among them: every port and output file of the controller together in --help."""
    p.add_argument("--host", default="127.0.0.1", help="address of the gRPC and HTTP APIs")
    p.add_argument(
        "--port", type=port("any free port"), default=50051, help="gRPC port (0: any free port)"
    )
    p.add_argument("--metrics-port", type=port("off"), default=0, help="Prometheus port (0: off)")
    p.add_argument(
        "--step-log",
        default="",
        metavar="FILE",
        help="append one JSON line per micro-batch (its tokens, each stage's time) to FILE",
    )
    p.add_argument(
        "--http-port", type=port("off"), default=0, help="OpenAI-compatible HTTP API port (0: off)"
    )


def add_network_flags(p: argparse.ArgumentParser) -> None:
    """How workers reach this controller and one another: the ZeroMQ control plane and the
    torch.distributed rendezvous; in cluster mode, etcd (membership, the active controller's
    lease); and the interface NCCL/gloo use."""
    p.add_argument(
        "--control-addr", default="tcp://127.0.0.1:0", help="ZeroMQ address workers connect to"
    )
    p.add_argument(
        "--dist-host", default="", help="torch.distributed rendezvous host (default: rank 0's)"
    )
    p.add_argument(
        "--dist-port",
        type=port("a free port, or 29500 with --etcd"),
        default=0,
        help="rendezvous port (0: free port / 29500 with etcd)",
    )
    p.add_argument("--etcd", default="", help="etcd HOST:PORT: cluster mode (membership)")
    p.add_argument("--cluster", default="default", help="cluster name (etcd key prefix)")
    p.add_argument(
        "--advertise-host", default="", help="address workers reach this controller at (cluster)"
    )
    p.add_argument(
        "--leader-lease",
        type=Number(int, "in [2, 60]", lambda v: 2 <= v <= 60, ("abc", "1", "61")),
        default=3,
        help="cluster mode: seconds of the etcd lease that makes a controller the active one; "
        "a second controller of the same --cluster is a standby and takes over at most this "
        "long after the active one dies (default 3)",
    )
    p.add_argument("--socket-ifname", default="", help="NCCL/gloo network interface")


def add_request_and_startup_flags(p: argparse.ArgumentParser) -> None:
    """A request's default output length, and how long start-up waits for the workers. (Two
    unrelated flags, grouped only to keep their place in --help: between the network flags and
    the reliability ones.)"""
    p.add_argument(
        "--default-max-tokens",
        type=int_at_least(1),
        default=256,
        help="max_tokens of a gRPC or chat request that sets none (completions: OpenAI's 16), "
        "or what the model's context leaves after the prompt where that is less",
    )
    p.add_argument(
        "--worker-start-timeout",
        type=float_above(0.0),
        default=300.0,
        help="seconds workers have to register and load: at start (then the controller exits), "
        "and to rebuild the pipeline after a lost stage (then liveness fails)",
    )


def add_reliability_flags(p: argparse.ArgumentParser) -> None:
    """Admission under load, detection of dead workers and stalls, and who may connect."""
    add_admission_flags(p)
    add_liveness_flags(p)
    add_security_flags(p)


def add_admission_flags(p: argparse.ArgumentParser) -> None:
    """Bounds on the admission queue and what a refused or held request is told
    (AdmissionConfig, whose defaults these are)."""
    defaults = AdmissionConfig()
    p.add_argument(
        "--max-queued-requests",
        type=int_at_least(1),
        default=defaults.max_queued_requests,
        help="requests waiting for admission before new ones get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-queued-prompt-tokens",
        type=int_at_least(1),
        default=defaults.max_queued_prompt_tokens,
        help="prompt tokens waiting for admission before new requests are refused",
    )
    p.add_argument(
        "--retry-after",
        type=float_in(0.0, 3600.0, lo_open=True),
        default=defaults.retry_after_s,
        help="retry hint (s), in (0, 3600]",
    )
    p.add_argument(
        "--while-down",
        default=defaults.while_down.value,
        choices=[w.value for w in WhileDown],
        help="new requests while a stage is down: hold them, or fail them with UNAVAILABLE",
    )


def add_liveness_flags(p: argparse.ArgumentParser) -> None:
    """How long a silent worker takes to count as down (the pipeline is rebuilt), and a pipeline
    with requests but no completed step to count as stalled (health turns NOT_SERVING)."""
    p.add_argument(
        "--heartbeat-timeout",
        type=float_in(0.5, 3600.0),
        default=5.0,
        help="seconds before a silent worker counts as down",
    )
    p.add_argument(
        "--stall-timeout",
        type=float_in(0.5, 86400.0),
        default=30.0,
        help="seconds without a completed step (requests waiting) before health is NOT_SERVING",
    )


def add_security_flags(p: argparse.ArgumentParser) -> None:
    """TLS for the gRPC API, bearer tokens for both APIs, CurveZMQ for the control plane; each
    off unless set."""
    p.add_argument("--tls-cert", default="", help="PEM certificate of the gRPC and HTTP APIs (TLS)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument(
        "--curve-secret-key-file", default="", help="ZeroMQ certificate: require CurveZMQ"
    )
    p.add_argument(
        "--curve-client-keys-dir", default="", help="workers' public ZeroMQ certificates"
    )
    p.add_argument(
        "--auth-token-file", default="", help="bearer tokens, one per line (gRPC and HTTP API)"
    )


def add_memory_trace_flags(p: argparse.ArgumentParser) -> None:
    """Soak debugging (controller/memory_trace.py): off unless --memory-trace-dir is set."""
    defaults = MemoryTraceConfig()
    p.add_argument(
        "--memory-trace-dir",
        default="",
        help="debugging: trace Python allocations (tracemalloc) and write reports of what grew "
        "into this folder (empty: off; slows the controller)",
    )
    p.add_argument(
        "--memory-trace-interval",
        type=float_in(1.0, 86400.0),
        default=defaults.interval_s,
        help="seconds between memory reports, in [1, 86400]",
    )
    p.add_argument(
        "--memory-trace-frames",
        type=Number(int, "in [0, 64]", lambda v: 0 <= v <= 64, ("abc", "-1", "65")),
        default=defaults.frames,
        help="stack frames kept per traced allocation, in [0, 64] (0: no tracemalloc, only RSS, "
        "malloc's view and object counts)",
    )


def memory_trace_config(args: argparse.Namespace) -> MemoryTraceConfig:
    return MemoryTraceConfig(
        out_dir=args.memory_trace_dir,
        interval_s=args.memory_trace_interval,
        frames=args.memory_trace_frames,
    )


def scheduler_config(args: argparse.Namespace, max_model_len: int) -> SchedulerConfig:
    """The flags' scheduler; in SLO mode (--tbt-slo) the budget, the time budget and the cap on
    running sequences come from the cost profile instead (controller/slo.py)."""
    step_cost = parse_step_cost(args.step_cost) if args.step_cost else None
    if (args.tbt_slo or args.time_budget) and step_cost is None:
        flag = "tbt_slo" if args.tbt_slo else "time_budget"
        raise ConfigError(flag, args.tbt_slo or args.time_budget, "a --step-cost to predict with")
    budget, time_budget_s, max_num_seqs = args.budget, args.time_budget, args.max_num_seqs
    if args.tbt_slo:
        assert step_cost is not None
        choice = choose_for_tbt_slo(args.tbt_slo, step_cost, args.pp, args.tile, max_model_len)
        logging.getLogger(__name__).info("SLO mode: %s", choice.describe())
        budget, time_budget_s = choice.budget_tokens, choice.stage_time_s
        max_num_seqs = min(max_num_seqs or choice.max_num_seqs, choice.max_num_seqs)
    if max_num_seqs is None:
        max_num_seqs = min(128, budget) if args.policy in CHUNKED_POLICIES else 128
    return SchedulerConfig(
        policy=args.policy,
        budget_tokens=budget,
        idle_budget_tokens=args.idle_budget,
        tile_tokens=args.tile,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        pipeline_depth=args.pp,
        pipeline_prefill_chunks=not args.no_chunk_pipelining,
        spread_prompts=args.spread_prompts,
        decode_ahead=args.decode_ahead and args.pp == 1,
        time_budget_s=time_budget_s,
        step_cost=step_cost if time_budget_s else None,
        tbt_slo_s=args.tbt_slo,
    )


def config_from_args(args: argparse.Namespace) -> ControllerConfig:
    max_model_len = args.max_model_len
    if max_model_len is None:
        positions = read_model_config(args.model).get("max_position_embeddings")
        max_model_len = int(positions) if isinstance(positions, int) else 2048
    return ControllerConfig(
        model_dir=args.model,
        scheduler=scheduler_config(args, max_model_len),
        cache=CacheConfig(block_size=args.block_size, prefix_caching=not args.no_prefix_caching),
        parallel=ParallelConfig(pp=args.pp, tp=args.tp, layer_split=args.layer_split),
        server=ServerConfig(
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            http_port=args.http_port,
            control_addr=args.control_addr,
            dist_host=args.dist_host,
            dist_port=args.dist_port,
            socket_ifname=args.socket_ifname,
            etcd=args.etcd,
            cluster=args.cluster,
            advertise_host=args.advertise_host,
            leader_lease_s=args.leader_lease,
            default_max_tokens=args.default_max_tokens,
            worker_start_timeout_s=args.worker_start_timeout,
            heartbeat_timeout_s=args.heartbeat_timeout,
            stall_timeout_s=args.stall_timeout,
            step_log_file=args.step_log,
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
            auth_token_file=args.auth_token_file,
            curve_secret_key_file=args.curve_secret_key_file,
            curve_client_keys_dir=args.curve_client_keys_dir,
        ),
        admission=AdmissionConfig(
            max_queued_requests=args.max_queued_requests,
            max_queued_prompt_tokens=args.max_queued_prompt_tokens,
            retry_after_s=args.retry_after,
            while_down=WhileDown(args.while_down),
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s controller %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
        with memory_trace(memory_trace_config(args)):
            asyncio.run(serve(config))
    except ConfigError as err:
        print(f"controller: invalid configuration: {err}", file=sys.stderr)
        return 2
    except (BindError, TimeoutError, ConnectionError, TaskFailed) as err:
        print(f"controller: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
