"""Starting and stopping the two servers: one at a time, each in a process group of its own so
that stopping it takes every child with it (vLLM's engine core, our stage workers)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

STAGE_HOOK = Path(__file__).resolve().parent / "stage_hook"
"""The sitecustomize that times a vLLM server's stages (put first on its PYTHONPATH)."""
STEP_LOG = "steps.jsonl"
"""Ours' step log in its stage_log folder."""


class ServerError(RuntimeError):
    """A server exited or never answered; the message names its log."""


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    """Set on top of the driver's environment, less the driver's PYTHONPATH (this may set
    one: vLLM's stage hook)."""
    stage_log: Path | None = None
    """The folder its stages' steps are written to (bubbles.py), made when it starts: vLLM's
    stage_hook files, or ours' step log (STEP_LOG). None: not timed."""
    start_timeout_s: float = 600.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def vllm_spec(
    vllm_bin: Path,
    model: Path,
    served_name: str,
    port: int,
    kv_cache_gib: int,
    dtype: str,
    prefix_caching: bool = True,
    pp: int = 1,
    stage_logs: Path | None = None,
) -> ServerSpec:
    """`vllm serve` on the CPU with its defaults but for the dtype (the one ours runs), no CPU
    reserved, and its KV cache size. PP=1 binds its OpenMP threads to every core; `pp` > 1 runs
    its pipeline (the `mp` executor over gloo), one core per stage (VLLM_CPU_OMP_THREADS_BIND
    "0|1"), the layout ours has by default. Prefix caching is on, as by default, unless asked.
    `stage_logs`: a folder under which a pipeline's stages write their steps
    (stage_hook/sitecustomize.py), in a folder named after the system; PP=1 is not timed."""
    cores = os.cpu_count() or 1
    if pp > 1 and cores < pp:
        raise ServerError(f"vLLM with -pp {pp} needs {pp} cores, this machine has {cores}")
    per_stage = cores // pp
    cpus = "|".join(f"{s * per_stage}-{(s + 1) * per_stage - 1}" for s in range(pp))
    command = [
        str(vllm_bin), "serve", str(model),
        "--dtype", dtype,
        "--served-model-name", served_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if pp > 1:
        command += ["--pipeline-parallel-size", str(pp), "--distributed-executor-backend", "mp"]
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": cpus,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
    }
    name = "vllm" if pp == 1 else f"vllm-pp{pp}"
    stage_log = None
    if stage_logs is not None and pp > 1:
        stage_log = stage_logs / name
        env |= {"PYTHONPATH": str(STAGE_HOOK), "SARATHI_BENCH_STAGE_LOG": str(stage_log)}
    return ServerSpec(name, command, port, env, stage_log)


def sarathi_spec(
    sarathictl: Path,
    model: Path,
    port: int,
    dtype: str,
    prefix_caching: bool = True,
    budget: int = 0,
    extra_args: tuple[str, ...] = (),
    label: str = "",
    stage_logs: Path | None = None,
) -> ServerSpec:
    """`sarathictl up --local` with its default layout (the rule's, or the one `sarathictl
    tune-layout` measured on this machine: up's first lines, in the server's log, say which and
    why), the OpenAI API on `port`. The served
    model name is the folder's name (as vLLM's --served-model-name is set to). A `budget` other
    than 0 replaces up's default token budget and names the system after it; `extra_args` go to
    `up` as they are, and `label` names such a system (sarathi-LABEL). `stage_logs`: a folder
    under which the controller's `--step-log` (each stage's time per micro-batch) goes, in a
    folder named after the system."""
    command = [
        str(sarathictl), "up", "--local",
        "--model", str(model),
        "--dtype", dtype,
        "--port", "0",  # gRPC on any free port: the benchmark uses only HTTP
        "--http-port", str(port),
        "--no-restart",  # a worker that dies fails the run instead of hiding in it
    ]  # fmt: skip
    if not prefix_caching:
        command.append("--no-prefix-caching")
    name = "sarathi"
    if budget:
        command += ["--budget", str(budget)]
        name = f"sarathi-budget{budget}"
    if extra_args and not label:
        raise ValueError("extra arguments for up need a label to name the system by")
    if label:
        name = f"sarathi-{label}"
    step_log = None
    if stage_logs is not None:
        step_log = stage_logs / name
        command += ["--step-log", str(step_log / STEP_LOG)]
    return ServerSpec(name, [*command, *extra_args], port, stage_log=step_log)


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def check_port_free(port: int) -> None:
    """ServerError when something already listens on the port: the run would measure it (a
    server left over from an interrupted run answers /health at once) instead of the new one."""
    with socket.socket() as probe:
        # As the servers bind: a closed connection's TIME_WAIT does not count as taken.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as err:
            raise ServerError(
                f"port {port} is taken ({err}): stop what serves there first"
            ) from None


def start(spec: ServerSpec, log_path: Path) -> subprocess.Popen[bytes]:
    check_port_free(spec.port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if spec.stage_log is not None:
        spec.stage_log.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            spec.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(spec.env),
            start_new_session=True,  # its own process group: stop() signals all of it
        )


def is_ready(base_url: str) -> bool:
    """/health answers 200: the server takes requests (both answer it; ours says 503 until its
    pipeline is up)."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(spec: ServerSpec, proc: subprocess.Popen[bytes], log_path: Path) -> float:
    """Seconds it took to answer; ServerError when it exits first or takes too long."""
    started = time.monotonic()
    while not is_ready(spec.base_url):
        if proc.poll() is not None:
            raise ServerError(
                f"{spec.name} exited with code {proc.returncode} before serving; see {log_path}"
            )
        if time.monotonic() - started > spec.start_timeout_s:
            raise ServerError(
                f"{spec.name} did not answer on {spec.base_url} within "
                f"{spec.start_timeout_s:.0f} s; see {log_path}"
            )
        time.sleep(1.0)
    return time.monotonic() - started


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGINT to the whole group (both servers shut down cleanly on it), then SIGKILL to what is
    left after `grace_s`."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGINT)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    _signal_group(proc.pid, signal.SIGKILL)  # stragglers in the group, if any
    proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pgid, sig)


@contextmanager
def serving(spec: ServerSpec, log_path: Path) -> Iterator[float]:
    """The server up for the block (yields its start-up seconds); stopped on the way out
    whatever happens, Ctrl-C included."""
    proc = start(spec, log_path)
    try:
        yield wait_ready(spec, proc, log_path)
    finally:
        stop(proc)
