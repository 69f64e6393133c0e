"""The controller's configuration tree: frozen dataclasses, validated at construction.

Each field has a default and a one-line help; `controller/__main__.py` maps flags onto them and
the Helm chart's values map onto the flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.admission import AdmissionConfig
from controller.scheduler import CacheConfig, ConfigError, SchedulerConfig


@dataclass(frozen=True)
class ParallelConfig:
    pp: int = 1
    """Pipeline stages (one node each in a cluster)."""
    tp: int = 1
    """Tensor-parallel ranks per stage (GPUs per node)."""
    layer_split: tuple[int, ...] = ()
    """Decoder layers per stage, stage 0 first; empty: the workers' default split, which gives
    the LM head's stage fewer layers (stage_worker/layer_split.py). Its sum is checked by the
    workers, which read the model's config.json."""

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ConfigError("pp", self.pp, "at least 1")
        if self.tp < 1:
            raise ConfigError("tp", self.tp, "at least 1")
        if self.layer_split and (len(self.layer_split) != self.pp or min(self.layer_split) < 1):
            raise ConfigError(
                "layer_split", self.layer_split, f"empty or {self.pp} counts of at least 1 (pp)"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.tp


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address the gRPC API binds to (0.0.0.0 in a pod)."""
    port: int = 50051
    """gRPC port; 0 picks a free one (printed at start-up)."""
    metrics_port: int = 0
    """Prometheus /metrics port; 0 disables the endpoint."""
    http_port: int = 0
    """OpenAI-compatible HTTP API port (on `host`); 0 disables it."""
    control_addr: str = "tcp://127.0.0.1:0"
    """ZeroMQ address the workers connect to; port 0 picks a free one."""
    dist_host: str = ""
    """Host of the torch.distributed rendezvous; empty: stage 0 rank 0's host (it hosts it)."""
    dist_port: int = 0
    """Port of the torch.distributed rendezvous; 0: a free one (local mode) or 29500 (cluster)."""
    etcd: str = ""
    """etcd client endpoint HOST:PORT for cluster mode; empty: local mode (no etcd)."""
    cluster: str = "default"
    """Cluster name: the etcd key prefix /sarathi/<cluster>/."""
    advertise_host: str = ""
    """Address workers use to reach this controller (cluster mode; its pod IP)."""
    leader_lease_s: int = 3
    """Cluster mode: TTL of the lease that makes this controller the active one; a standby
    takes over at most this long after the active one died."""
    socket_ifname: str = ""
    """Network interface for NCCL/gloo sockets (NCCL_SOCKET_IFNAME); empty: the library's choice."""
    default_max_tokens: int = 256
    """max_tokens of a request that does not set it."""
    max_stop_strings: int = 8
    """Most stop strings one request may carry."""
    max_stop_string_chars: int = 256
    """Longest stop string accepted, in characters."""
    worker_start_timeout_s: float = 300.0
    """How long to wait for every worker to register and load its weights."""
    heartbeat_timeout_s: float = 5.0
    """A worker unheard of for this long is down: the pipeline is rebuilt."""
    stall_timeout_s: float = 30.0
    """Requests waiting or running and no step completed for this long: health NOT_SERVING."""
    tls_cert_file: str = ""
    """PEM certificate chain of the gRPC and HTTP APIs; with tls_key_file, they speak only TLS
    (the metrics port stays plaintext: it carries no tokens)."""
    tls_key_file: str = ""
    """PEM private key of tls_cert_file."""
    curve_secret_key_file: str = ""
    """ZeroMQ certificate with the controller's secret key: the control plane requires CurveZMQ
    (with curve_client_keys_dir). Empty: plain TCP (trusted network only)."""
    curve_client_keys_dir: str = ""
    """Folder of the workers' public ZeroMQ certificates; only they may connect."""
    auth_token_file: str = ""
    """File with one bearer token per line; when set, every API call must carry
    `authorization: Bearer <token>` (gRPC metadata, HTTP header)."""
    step_log_file: str = ""
    """Append one JSON line per micro-batch here (controller/step_log.py); empty: none."""

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "http_port", "dist_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ConfigError(name, value, "a TCP port in [0, 65535]")
        if not self.control_addr.startswith(("tcp://", "ipc://")):
            raise ConfigError("control_addr", self.control_addr, "a tcp:// or ipc:// address")
        if self.default_max_tokens < 1:
            raise ConfigError("default_max_tokens", self.default_max_tokens, "at least 1")
        if self.max_stop_strings < 0:
            raise ConfigError("max_stop_strings", self.max_stop_strings, "at least 0")
        if self.etcd and not self.advertise_host:
            raise ConfigError("advertise_host", self.advertise_host, "set in cluster mode (--etcd)")
        if not 2 <= self.leader_lease_s <= 60:  # etcd grants nothing shorter than ~2 s
            raise ConfigError("leader_lease_s", self.leader_lease_s, "in [2, 60] seconds")
        if not self.cluster or "/" in self.cluster:
            raise ConfigError("cluster", self.cluster, "a non-empty name without '/'")
        if self.worker_start_timeout_s <= 0:
            raise ConfigError("worker_start_timeout_s", self.worker_start_timeout_s, "positive")
        if not 0.5 <= self.heartbeat_timeout_s <= 3600:
            raise ConfigError("heartbeat_timeout_s", self.heartbeat_timeout_s, "in [0.5, 3600]")
        if not 0.5 <= self.stall_timeout_s <= 86400:
            raise ConfigError("stall_timeout_s", self.stall_timeout_s, "in [0.5, 86400]")
        if bool(self.curve_secret_key_file) != bool(self.curve_client_keys_dir):
            raise ConfigError(
                "curve_client_keys_dir",
                self.curve_client_keys_dir,
                "set together with curve_secret_key_file",
            )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_key_file", self.tls_key_file, "set together with tls_cert_file")


@dataclass(frozen=True)
class ControllerConfig:
    model_dir: str
    """Folder with config.json, tokenizer.json and safetensors (the workers load the weights)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    """block_size is used as is; num_blocks is replaced by the workers' minimum."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ConfigError("model_dir", self.model_dir, "a model folder")
        if self.scheduler.pipeline_depth != self.parallel.pp:
            raise ConfigError(
                "scheduler.pipeline_depth",
                self.scheduler.pipeline_depth,
                f"equal to parallel.pp={self.parallel.pp}",
            )
