"""`python -m stage_worker --controller tcp://HOST:PORT --model DIR ...`: one stage worker."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sarathi_proto import stage_pb2

if TYPE_CHECKING:
    from stage_worker.etcd_registration import EtcdRegistration

from stage_worker.cpu_pinning import parse_cpu_list, pin_process
from stage_worker.errors import CheckpointError
from stage_worker.kv_cache import GPU_CACHE_FRACTION
from stage_worker.worker import (
    StageWorker,
    WorkerConfig,
    WorkerRejected,
    install_log_tag,
)


@dataclass(frozen=True)
class Checked:
    """An argparse `type=`: `convert` the text, then `ok` must accept it. A bad value fails at
    parse time naming the flag, the value and the rule (`argument --stage: must be at least -1,
    got -2`); the bounds are WorkerConfig's own, which checks them again."""

    convert: Callable[[str], Any]
    allowed: str
    ok: Callable[[Any], bool]
    bad_values: tuple[str, ...]
    """Values refused: tests/unit/test_cli_flags.py feeds them to the flag."""

    def __call__(self, text: str) -> Any:
        try:
            value = self.convert(text)
        except ValueError:
            value = None
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            noun = "an integer" if self.convert is int else "a number"  # str never fails here
            raise argparse.ArgumentTypeError(f"must be {noun} {self.allowed}, got {text!r}")
        if not self.ok(value):
            raise argparse.ArgumentTypeError(f"must be {self.allowed}, got {text}")
        return value


def int_at_least(lo: int) -> Checked:
    return Checked(int, f"at least {lo}", lambda v: v >= lo, ("abc", str(lo - 1)))


def float_above(lo: float) -> Checked:
    return Checked(float, f"above {lo:g}", lambda v: v > lo, ("abc", "nan", f"{lo:g}"))


def float_in(lo: float, hi: float) -> Checked:
    bad = ("abc", "nan", f"{lo - 1:g}", f"{hi + 1:g}")
    return Checked(float, f"in [{lo:g}, {hi:g}]", lambda v: lo <= v <= hi, bad)


def device() -> Checked:
    return Checked(
        str, "cpu, cuda or cuda:N", lambda v: re.fullmatch(r"cpu|cuda(:\d+)?", v) is not None,
        ("tpu", "cuda:x"),
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The worker's flags, one group after another; --help lists them in this order."""
    p = argparse.ArgumentParser(prog="python -m stage_worker", description=__doc__)
    add_discovery_flags(p)
    add_model_flags(p)
    add_device_flags(p)
    add_performance_flags(p)
    add_control_link_flags(p)
    return p


def add_discovery_flags(p: argparse.ArgumentParser) -> None:
    """How the worker finds its controller: its address (local mode) or etcd (cluster mode);
    parse_args requires exactly one of the two."""
    p.add_argument(
        "--controller", default="", help="controller ROUTER address, tcp://HOST:PORT (local mode)"
    )
    p.add_argument("--etcd", default="", help="etcd HOST:PORT: find the controller there (cluster)")
    p.add_argument("--cluster", default="default", help="cluster name (etcd key prefix)")
    p.add_argument(
        "--advertise-host",
        default="",
        help="address other nodes reach this worker at (default: the route to the controller)",
    )
    p.add_argument(
        "--controller-wait",
        type=float_above(0.0),
        default=600.0,
        help="seconds to wait for a controller",
    )


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The checkpoint, and the place in the PP x TP grid the worker asks for (the controller
    assigns one when it asks for none)."""
    p.add_argument("--model", required=True, help="folder with config.json and *.safetensors")
    p.add_argument(
        "--stage", type=int_at_least(-1), default=-1, help="requested stage (-1: assigned)"
    )
    p.add_argument(
        "--tp-rank", type=int_at_least(-1), default=-1, help="requested TP rank (-1: assigned)"
    )


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """Where the stage runs, in which precision, and its CPU resources: the KV-cache bytes
    (reported in blocks of --block-size) and torch threads."""
    p.add_argument("--device", type=device(), default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--kv-cache-bytes", type=int_at_least(0), default=1 << 30, help="CPU KV-cache budget"
    )
    p.add_argument(
        "--workers-on-host",
        type=int_at_least(1),
        default=1,
        help="workers loading on this machine at once, who share its memory (CPU bf16: each "
        "judges its share when it chooses whether to hold oneDNN's copies of the weights)",
    )
    p.add_argument(
        "--block-size", type=int_at_least(1), default=16, help="tokens per block for the report"
    )
    p.add_argument(
        "--num-threads", type=int_at_least(0), default=0, help="torch threads (0: default)"
    )
    p.add_argument(
        "--cpus",
        type=CpuList(),
        default=(),
        metavar="LIST",
        help="run every thread of this worker on these CPUs only, e.g. 0-3,8 (`sarathictl up "
        "--local` gives each of several CPU workers its own share; default: wherever the OS "
        "puts them)",
    )


class CpuList:
    """--cpus' type: parse_cpu_list, its complaint as argparse's."""

    bad_values = ("x", "3-1", "0,0", "1-")
    """Values refused: tests/unit/test_cli_flags.py feeds them to the flag."""

    def __call__(self, text: str) -> tuple[int, ...]:
        try:
            return parse_cpu_list(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(
                f"must be CPU numbers and ranges such as 0-3,8: {err}"
            ) from None


def add_performance_flags(p: argparse.ArgumentParser) -> None:
    """Speed and memory choices: kernels, CUDA graphs, the communication backend, the GPU's
    KV-cache share and how activations travel between stages."""
    p.add_argument("--attention", default="torch", choices=["torch", "flashinfer"])
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA, TP=1: replay decode steps from CUDA graphs captured per batch bucket "
        "(--no-cuda-graphs: every step eager)",
    )
    p.add_argument(
        "--comm-backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="torch.distributed backend (auto: nccl on CUDA, gloo on the CPU; gloo on CUDA lets "
        "several workers share one GPU)",
    )
    p.add_argument(
        "--gpu-memory-fraction",
        type=float_in(0.01, 1.0),
        default=GPU_CACHE_FRACTION,
        help="CUDA: share of the free GPU memory after loading that the KV cache takes",
    )
    p.add_argument(
        "--send-slices",
        action="store_true",
        help="send 1/TP of the activations per rank; the next stage all-gathers",
    )
    p.add_argument(
        "--small-batch-kernel",
        action="store_true",
        help="CPU bf16, one thread, with --no-cpu-matmul-kernel (the bf16 matmul kernel "
        "supersedes it): run steps of up to 2 tokens on a streaming GEMV kernel; holds the "
        "linear weights twice",
    )
    p.add_argument(
        "--fused-ops",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="norms, rotary and SiLU-times-up as fused kernels (Triton on CUDA, C on x86-64 "
        "CPUs with AVX2; --no-fused-ops: torch's own ops)",
    )
    p.add_argument(
        "--cpu-matmul-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: linear layers on the package's matmul kernels where they run: float32 "
        "on AVX2 with FMA, bf16 on AVX-512 with bf16 as far as it measures faster than oneDNN "
        "(--no-cpu-matmul-kernel: torch's F.linear, MKL or oneDNN)",
    )
    p.add_argument(
        "--cpu-layer-loop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU float32 or bf16, Llama family, TP=1: the layers as one loop over the C "
        "kernels and matmuls, without a module call per layer part (--no-cpu-layer-loop: "
        "the modules)",
    )


def add_control_link_flags(p: argparse.ArgumentParser) -> None:
    """The link to the controller once found: how long its silence is tolerated, and the
    CurveZMQ keys it is encrypted with (both files or neither)."""
    p.add_argument(
        "--controller-timeout",
        type=float_in(1.0, 3600.0),
        default=10.0,
        help="seconds without a message from the controller before exiting to re-register; "
        "also the longest wait on a neighbouring stage once the controller no longer says it "
        "is stepping (a peer behind a cut link never answers)",
    )
    p.add_argument(
        "--curve-server-key-file", default="", help="controller's public ZeroMQ certificate"
    )
    p.add_argument("--curve-key-file", default="", help="this worker's secret ZeroMQ certificate")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if bool(a.controller) == bool(a.etcd):
        p.error("give exactly one of --controller (local mode) and --etcd (cluster mode)")
    return a


def config_from(a: argparse.Namespace, controller: str) -> WorkerConfig:
    return WorkerConfig(
        controller=controller,
        advertise_host=a.advertise_host,
        model_dir=a.model,
        stage=a.stage,
        tp_rank=a.tp_rank,
        device=a.device,
        dtype=a.dtype,
        kv_cache_bytes=a.kv_cache_bytes,
        workers_on_host=a.workers_on_host,
        block_size_hint=a.block_size,
        num_threads=a.num_threads,
        attention=a.attention,
        cuda_graphs=a.cuda_graphs,
        comm_backend=a.comm_backend,
        gpu_cache_fraction=a.gpu_memory_fraction,
        send_slices=a.send_slices,
        small_batch_kernel=a.small_batch_kernel,
        fused_ops=a.fused_ops,
        cpu_matmul_kernel=a.cpu_matmul_kernel,
        cpu_layer_loop=a.cpu_layer_loop,
        controller_timeout_s=a.controller_timeout,
        curve_server_key_file=a.curve_server_key_file,
        curve_key_file=a.curve_key_file,
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(worker)s %(name)s: %(message)s"
    )
    install_log_tag()
    args = parse_args(argv)
    registration = None
    try:
        if args.cpus:  # first: the threads started from here on inherit it
            pin_process(args.cpus)
        controller = args.controller
        if args.etcd:
            registration, controller = find_controller(args)
        follow = registration.next_controller if registration is not None else None
        worker = StageWorker(config_from(args, controller), follow)
        if registration is not None:
            # A standby took over: join it in this process (weights kept), not after a restart.
            registration.on_controller_changed = lambda what: worker.controller_changed()
        return worker.run()
    except CheckpointError as err:
        print(f"stage_worker: bad checkpoint: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"stage_worker: error: {err}", file=sys.stderr)
        return 2
    except (ConnectionError, TimeoutError, WorkerRejected) as err:
        print(f"stage_worker: {err}", file=sys.stderr)
        return 1
    finally:
        if registration is not None:
            registration.close()


def find_controller(args: argparse.Namespace) -> tuple[EtcdRegistration, str]:
    """Registers in etcd under a lease and returns the controller's control address."""
    # Imported here: etcd's client brings gRPC, which a worker outside cluster mode does not
    # need (and no longer loads).
    from stage_worker.etcd_registration import EtcdRegistration

    model = os.path.basename(os.path.normpath(args.model))
    registration = EtcdRegistration(
        args.etcd,
        args.cluster,
        stage_pb2.WorkerRegistration(
            worker_id=f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
            host=args.advertise_host or socket.gethostname(),
            num_gpus=torch.cuda.device_count() if args.device.startswith("cuda") else 0,
            model=model,
            stage=args.stage,
            tp_rank=args.tp_rank,
        ),
    )
    endpoint = registration.start(args.controller_wait)
    if endpoint.model and endpoint.model != model:
        registration.close()
        raise ValueError(f"this worker serves model {model!r}, the cluster {endpoint.model!r}")
    return registration, endpoint.control_addr


if __name__ == "__main__":
    raise SystemExit(main())
