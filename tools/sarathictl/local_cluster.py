"""A controller and PP x TP stage workers as processes on this machine (local mode).

Used by `sarathictl up --local`, `make demo`, the local benchmarks and the integration tests. Every
child gets SIGTERM if this process dies (PR_SET_PDEATHSIG), and `stop()` leaves no process behind.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sarathi_proto import generate_pb2

from sarathictl.local_devices import (
    check_device,
    count_cuda_gpus,
    cpu_args,
    worker_cpus,
    worker_device_args,
)
from stage_worker.config import load_spec
from stage_worker.layer_split import check_split, default_split

log = logging.getLogger(__name__)


API_HEALTH_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
"""The health name that says the controller serves requests (its readiness); the empty name
says only that its process lives."""


def _die_with_parent_prefix(parent_pid: int | None = None) -> list[str]:
    """What a child's command starts with so it gets SIGTERM when its parent (this process unless
    `parent_pid` says otherwise) goes away, even by SIGKILL: util-linux's setpriv sets the
    parent-death signal and execs the command (same pid). A parent that dies before setpriv gets
    there sends no signal, so a shell after it checks that its parent is still the one that
    spawned it and execs the command only then (CI once killed a parent inside that window).
    Not a preexec_fn: Python code between fork and exec in a process whose gRPC threads are busy
    (a test holding channels) made gRPC abort the child. Without setpriv (not Linux), children
    rely on stop()."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return []
    expected = os.getpid() if parent_pid is None else parent_pid
    # $PPID is read once when the shell starts, which is after setpriv's prctl.
    guard = f'[ "$PPID" = "{expected}" ] && exec "$@"'
    return [setpriv, "--pdeathsig", "TERM", "--", "/bin/sh", "-c", guard, "sh"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


LOCAL_BUDGET_TOKENS = 128
"""The token budget of a local (CPU) cluster. A micro-batch's stage time is what a decode riding
in it waits: on one CPU core a 512-token chunk of the demo model takes ~200 ms a stage, 128 tokens
~50 ms. Side by side with vLLM (BENCHMARKS.md, 2026-11-23 session 3) 128 against 512 cut P99 TBT
from ~500 to ~150 ms and TTFT by a third under load, at the same throughput within noise; GPU
deployments keep the paper's 512 (the Helm chart's own value)."""


@dataclass(frozen=True)
class LocalClusterConfig:
    model_dir: str
    """Model folder (config.json, safetensors, tokenizer.json)."""
    pp: int = 2
    """Pipeline stages, one process each per TP rank."""
    tp: int = 1
    """Tensor-parallel ranks per stage."""
    layer_split: tuple[int, ...] = ()
    """Decoder layers per stage; empty: the workers' default (the LM head's stage gets fewer)."""
    policy: str = "sarathi"
    """Batching policy."""
    budget_tokens: int = LOCAL_BUDGET_TOKENS
    """Token budget per micro-batch."""
    idle_budget_tokens: int = 0
    """Token budget while no sequence decodes (PP = 1; SchedulerConfig.idle_budget_tokens);
    0: budget_tokens always."""
    host: str = "127.0.0.1"
    """Where the controller's gRPC, HTTP and metrics ports listen (0.0.0.0: every interface, for
    clients on other machines). The workers' sockets stay on 127.0.0.1."""
    port: int = 50051
    """gRPC port of the controller; 0 picks a free one."""
    http_port: int | None = None
    """OpenAI-compatible HTTP API port (it serves /metrics too); None: no HTTP API; 0 picks a
    free one."""
    metrics_port: int = 0
    """Prometheus /metrics on a port of its own; 0: none."""
    dtype: str = "float32"
    """Weights and activations on the workers."""
    device: str = "cpu"
    """Where the workers run: cpu, cuda (this machine's GPUs shared out, local_devices.py) or
    cuda:N."""
    threads_per_worker: int = 1
    """torch threads per worker process (processes share this machine's cores)."""
    pin_cpus: bool = True
    """CPU workers, several of them: each pinned to its own threads_per_worker cores
    (pinned_cpus); False: wherever the OS puts them."""
    cpu_share: tuple[int, int] = (0, 1)
    """(k, n): this cluster is the k-th of n started side by side on this machine (`bench
    prefix-routing --pipelines n`), so its workers take the k-th n-th of the cores rather than
    the first ones, which every cluster would otherwise pin to."""
    kv_cache_bytes: int = 256 << 20
    """KV-cache memory per worker."""
    max_model_len: int = 0
    """Most tokens per sequence; 0: the model's max_position_embeddings."""
    max_num_seqs: int = 0
    """Most running sequences; 0: the controller's default."""
    log_dir: str = ""
    """Where the children's logs go; empty: a folder under the system temp dir."""
    prefix_caching: bool = True
    """Automatic prefix caching on the controller (False: --no-prefix-caching)."""
    step_log: bool = False
    """The controller logs one JSON line per micro-batch (`--step-log`) to
    LocalCluster.step_log_path, in log_dir."""
    extra_controller_args: tuple[str, ...] = ()
    """More flags for `python -m controller`."""
    extra_worker_args: tuple[str, ...] = ()
    """More flags for every `python -m stage_worker`."""
    max_restarts: int = 20
    """supervise(): most restarts of one child in a row before giving up (a crash loop). Each
    child counts its own: a lost stage restarts every worker once (all leave the broken
    pipeline), so it costs one of each child's, as one rebuild, whatever pp * tp."""
    restart_window_s: float = 600.0
    """A child's restart this long after its one before starts its count again: a cluster up
    for weeks is not taken down by its tenth unrelated crash, while a loop slower than the
    model's load (one crash a minute) still ends."""

    def __post_init__(self) -> None:
        if self.pp < 1 or self.tp < 1:
            raise ValueError(f"pp and tp must be at least 1, got pp={self.pp} tp={self.tp}")
        if self.layer_split and len(self.layer_split) != self.pp:
            raise ValueError(
                f"layer_split={self.layer_split} needs one count per stage (pp={self.pp})"
            )
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"model_dir={self.model_dir!r} has no config.json")
        check_device(self.device)
        if not self.host:
            raise ValueError("host must not be empty (0.0.0.0: every interface)")
        index, clusters = self.cpu_share
        if clusters < 1 or not 0 <= index < clusters:
            raise ValueError(f"cpu_share={self.cpu_share}: expected (k, n) with 0 <= k < n")


def pinned_cpus(cfg: LocalClusterConfig, worker: int) -> list[int]:
    """The CPUs worker `worker` (stage * tp + tp rank) is pinned to; empty: not pinned."""
    if cfg.device != "cpu" or not cfg.pin_cpus:
        return []
    allowed = os.sched_getaffinity(0)
    index, clusters = cfg.cpu_share
    workers = cfg.pp * cfg.tp
    return worker_cpus(
        allowed, index * workers + worker, clusters * workers, cfg.threads_per_worker
    )


def connect_host(host: str) -> str:
    """The address a client on this machine dials for a server listening on `host`: loopback
    for a wildcard, an IPv6 literal in brackets."""
    if host == "0.0.0.0":
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


@dataclass
class LocalCluster:
    config: LocalClusterConfig
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    port: int = 0
    http_port: int = 0
    """The HTTP API's port once started; 0: no HTTP API."""
    log_dir: Path = field(default_factory=Path)
    num_restarts: int = 0
    """Children restarted by supervise() so far."""
    restarts_in_a_row: dict[str, tuple[int, float]] = field(default_factory=dict)
    """By child: its restarts with less than restart_window_s between each and the one before,
    and time.monotonic() of the last."""
    _commands: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)

    @property
    def addr(self) -> str:
        return f"{connect_host(self.config.host)}:{self.port}"

    @property
    def step_log_path(self) -> Path:
        """Where the controller logs its micro-batches, with config.step_log."""
        return self.log_dir / "steps.jsonl"

    @property
    def http_base_url(self) -> str:
        """What the `openai` client takes as base_url."""
        return f"http://{connect_host(self.config.host)}:{self.http_port}/v1"

    def start(self, timeout_s: float = 300.0) -> None:
        cfg = self.config
        # Before anything starts, what would fail only once every worker has loaded: a GPU
        # that is not there, a depth or split the model cannot take, a port in use.
        placements = self._worker_placements()
        check_layers(cfg)
        for flag, port in (
            ("--port", cfg.port),
            ("--http-port", cfg.http_port),
            ("--metrics-port", cfg.metrics_port),
        ):
            check_port_free(flag, port, cfg.host)
        try:
            self._spawn_all(placements)
            self._wait_serving(timeout_s)
        except BaseException:  # Ctrl-C included: the children live in sessions of their own
            self.stop()
            raise

    def _spawn_all(self, placements: list[list[str]]) -> None:
        """The controller, then every worker with its device flags (by global rank)."""
        cfg = self.config
        self.port = cfg.port or free_port()
        self.http_port = 0 if cfg.http_port is None else cfg.http_port or free_port()
        control = f"tcp://127.0.0.1:{free_port()}"
        self.log_dir = Path(cfg.log_dir or _temp_log_dir())
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads_per_worker), PYTHONUNBUFFERED="1")
        split = ",".join(map(str, cfg.layer_split))
        self._spawn(
            "controller",
            [
                "-m", "controller", "--model", cfg.model_dir, "--pp", str(cfg.pp),
                "--tp", str(cfg.tp), "--policy", cfg.policy, "--budget", str(cfg.budget_tokens),
                *(["--idle-budget", str(cfg.idle_budget_tokens)] if cfg.idle_budget_tokens else []),
                *(["--layer-split", split] if split else []),
                "--host", cfg.host, "--port", str(self.port), "--control-addr", control,
                *(["--http-port", str(self.http_port)] if self.http_port else []),
                *(["--metrics-port", str(cfg.metrics_port)] if cfg.metrics_port else []),
                *(["--max-model-len", str(cfg.max_model_len)] if cfg.max_model_len else []),
                *(["--max-num-seqs", str(cfg.max_num_seqs)] if cfg.max_num_seqs else []),
                *([] if cfg.prefix_caching else ["--no-prefix-caching"]),
                *(["--step-log", str(self.step_log_path)] if cfg.step_log else []),
                *cfg.extra_controller_args,
            ],
            env,
        )  # fmt: skip
        for stage in range(cfg.pp):
            for rank in range(cfg.tp):
                self._spawn(
                    f"stage{stage}-rank{rank}",
                    [
                        "-m", "stage_worker", "--controller", control, "--model", cfg.model_dir,
                        "--stage", str(stage), "--tp-rank", str(rank), "--dtype", cfg.dtype,
                        "--num-threads", str(cfg.threads_per_worker),
                        "--kv-cache-bytes", str(cfg.kv_cache_bytes),
                        "--workers-on-host", str(cfg.pp * cfg.tp),
                        *placements[stage * cfg.tp + rank],
                        *cfg.extra_worker_args,
                    ],
                    env,
                )  # fmt: skip

    def _worker_placements(self) -> list[list[str]]:
        """Each worker's device flags, by global rank (stage * tp + tp rank)."""
        cfg = self.config
        num_workers = cfg.pp * cfg.tp
        num_gpus = 0 if cfg.device == "cpu" else count_cuda_gpus()
        return [
            worker_device_args(cfg.device, worker, num_workers, num_gpus)
            + cpu_args(pinned_cpus(cfg, worker))
            for worker in range(num_workers)
        ]

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        restart = name in self._commands
        self._commands[name] = (args, env)
        # A restarted child appends to its log, so the crash stays readable above the restart.
        log_file = open(self.log_dir / f"{name}.log", "ab" if restart else "wb")  # noqa: SIM115
        # A session of its own: a Ctrl-C at the terminal reaches this process alone, which
        # stops the children in order (stop(): the controller first). They still end with it
        # (the parent-death signal).
        proc = subprocess.Popen(
            [*_die_with_parent_prefix(), sys.executable, *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log_file.close()
        self.procs.append((name, proc))

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self.check_alive()
                try:
                    reply = stub.Check(
                        health_pb2.HealthCheckRequest(service=API_HEALTH_NAME), timeout=1.0
                    )
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(
            f"the local cluster did not start serving within {timeout_s:.0f} s; "
            f"logs: {self.log_dir}"
        )

    def check_alive(self) -> None:
        """Raises RuntimeError naming the first child that exited, with the end of its log."""
        for name, proc in self.procs:
            code = proc.poll()
            if code is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} {exit_reason(code)}; its log ends:\n{tail}")

    def supervise(self) -> list[str]:
        """Restarts every child that exited (a killed worker, or one that left a broken
        pipeline; the controller on its fixed ports). Returns the names restarted. Raises
        RuntimeError, as check_alive, once a child has spent max_restarts in a row."""
        restarted = []
        for index, (name, proc) in enumerate(self.procs):
            code = proc.poll()
            if code is None:
                continue
            now = time.monotonic()
            in_a_row, last_at = self.restarts_in_a_row.get(name, (0, -math.inf))
            if now - last_at > self.config.restart_window_s:
                in_a_row = 0
            if in_a_row >= self.config.max_restarts:
                self.check_alive()
            log.warning("%s %s: restarting it", name, exit_reason(code))
            args, env = self._commands[name]
            self._spawn(name, args, env)
            self.procs[index] = self.procs.pop()  # _spawn appended the new process
            self.num_restarts += 1
            self.restarts_in_a_row[name] = (in_a_row + 1, now)
            restarted.append(name)
        return restarted

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to every child (controller first: it tells the workers to exit), then
        SIGKILL whatever is left after grace_s."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit within %.0f s: killing it", name, grace_s)
                proc.kill()
                proc.wait()
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def check_layers(cfg: LocalClusterConfig) -> None:
    """ValueError unless the model's layers can be split into cfg.pp stages (cfg.layer_split,
    if given): the check every worker makes at start, made before spawning any."""
    spec = load_spec(cfg.model_dir)
    if cfg.layer_split:
        check_split(cfg.layer_split, spec, cfg.pp)
    else:
        default_split(spec, cfg.pp)


def check_port_free(flag: str, port: int | None, host: str = "127.0.0.1") -> None:
    """ValueError naming the flag when `host`:`port` cannot be bound, as when something listens
    there (0 and None: the port is picked, or there is none)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Like the servers: a port whose last connections linger in TIME_WAIT is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise ValueError(
                f"{flag} {port}: {err.strerror or err}{_bind_hint(err, host)}"
            ) from None


def _bind_hint(err: OSError, host: str) -> str:
    if err.errno == errno.EADDRINUSE:
        return " (is a cluster already up?)"
    if err.errno == errno.EADDRNOTAVAIL or isinstance(err, socket.gaierror):
        return f" (--host {host} is not an address of this machine)"
    return ""


def _temp_log_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="sarathi-local-")


def exit_reason(code: int) -> str:
    """How a child ended, as a user reads it: a SIGKILL nobody here sent is most often the
    kernel's out-of-memory killer (a model too large for the machine's memory)."""
    if code == -signal.SIGKILL:
        return (
            "was killed (SIGKILL: most often the system's out-of-memory killer; "
            "`dmesg | grep -i oom` says, and a smaller --kv-cache-mb or model may fit)"
        )
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:  # a real-time signal has no name
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
