"""`python -m controller`: one serving replica's controller (the pod entry point)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from controller.admission import AdmissionConfig, WhileDown
from controller.app import read_model_config, serve
from controller.config import ControllerConfig, ParallelConfig, ServerConfig
from controller.scheduler import CacheConfig, ConfigError, SchedulerConfig, policy_names
from controller.scheduler.config import CHUNKED_POLICIES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m controller", description=__doc__)
    p.add_argument("--model", required=True, help="model folder (config.json, tokenizer.json)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--policy", default="sarathi", choices=policy_names(), help="batching policy")
    p.add_argument("--budget", type=int, default=512, help="token budget per micro-batch")
    p.add_argument("--tile", type=int, default=32, help="tile size the budget is a multiple of")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most running sequences (default: 128, at most the budget for chunked policies)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="most tokens per sequence (default: the model's max_position_embeddings)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument(
        "--no-chunk-pipelining",
        action="store_true",
        help="wait for a prompt's chunk to leave the pipeline before sending its next one",
    )
    p.add_argument("--host", default="127.0.0.1", help="address of the gRPC and HTTP APIs")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    p.add_argument(
        "--http-port", type=int, default=0, help="OpenAI-compatible HTTP API port (0: off)"
    )
    p.add_argument(
        "--control-addr", default="tcp://127.0.0.1:0", help="ZeroMQ address workers connect to"
    )
    p.add_argument(
        "--dist-host", default="", help="torch.distributed rendezvous host (default: rank 0's)"
    )
    p.add_argument(
        "--dist-port", type=int, default=0, help="rendezvous port (0: free port / 29500 with etcd)"
    )
    p.add_argument("--etcd", default="", help="etcd HOST:PORT: cluster mode (membership)")
    p.add_argument("--cluster", default="default", help="cluster name (etcd key prefix)")
    p.add_argument(
        "--advertise-host", default="", help="address workers reach this controller at (cluster)"
    )
    p.add_argument("--socket-ifname", default="", help="NCCL/gloo network interface")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when unset")
    p.add_argument(
        "--worker-start-timeout", type=float, default=300.0, help="seconds to wait for workers"
    )
    add_reliability_flags(p)
    return p


def add_reliability_flags(p: argparse.ArgumentParser) -> None:
    defaults = AdmissionConfig()
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="requests waiting for admission before new ones get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-queued-prompt-tokens",
        type=int,
        default=defaults.max_queued_prompt_tokens,
        help="prompt tokens waiting for admission before new requests are refused",
    )
    p.add_argument(
        "--retry-after", type=float, default=defaults.retry_after_s, help="retry hint (s)"
    )
    p.add_argument(
        "--while-down",
        default=defaults.while_down.value,
        choices=[w.value for w in WhileDown],
        help="new requests while a stage is down: hold them, or fail them with UNAVAILABLE",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=5.0,
        help="seconds before a silent worker counts as down",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="seconds without a completed step (requests waiting) before health is NOT_SERVING",
    )
    p.add_argument("--tls-cert", default="", help="PEM certificate of the gRPC API (TLS)")
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


def config_from_args(args: argparse.Namespace) -> ControllerConfig:
    max_model_len = args.max_model_len
    if max_model_len is None:
        positions = read_model_config(args.model).get("max_position_embeddings")
        max_model_len = int(positions) if isinstance(positions, int) else 2048
    max_num_seqs = args.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = min(128, args.budget) if args.policy in CHUNKED_POLICIES else 128
    return ControllerConfig(
        model_dir=args.model,
        scheduler=SchedulerConfig(
            policy=args.policy,
            budget_tokens=args.budget,
            tile_tokens=args.tile,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            pipeline_depth=args.pp,
            pipeline_prefill_chunks=not args.no_chunk_pipelining,
        ),
        cache=CacheConfig(block_size=args.block_size),
        parallel=ParallelConfig(pp=args.pp, tp=args.tp),
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
            default_max_tokens=args.default_max_tokens,
            worker_start_timeout_s=args.worker_start_timeout,
            heartbeat_timeout_s=args.heartbeat_timeout,
            stall_timeout_s=args.stall_timeout,
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
        asyncio.run(serve(config))
    except ConfigError as err:
        print(f"controller: invalid configuration: {err}", file=sys.stderr)
        return 2
    except (TimeoutError, ConnectionError) as err:
        print(f"controller: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
