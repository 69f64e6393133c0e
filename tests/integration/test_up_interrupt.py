"""Ctrl-C on `sarathictl up --local`, as a terminal sends it (SIGINT to the whole foreground
process group): while starting, up says it was interrupted and leaves nothing behind, rather
than reporting a crashed controller with a KeyboardInterrupt in its log; while serving, it
stops everything in order and nothing is restarted on the way out."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.integration.cluster_factories import make_tiny_served_model
from tests.integration.process_lines import LineReader

pytestmark = pytest.mark.integration


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the cluster's children exec in place)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


@contextmanager
def started_up(model_dir: Path, log: Path, *flags: str) -> Iterator[subprocess.Popen[str]]:
    """`up` in a process group of its own, as a shell runs a foreground job; killed if a test
    fails with it still running (its children follow it: the parent-death signal)."""
    up = subprocess.Popen(
        [sys.executable, "-m", "sarathictl.cli", "up", "--local", "--port", "0",
         "--model", str(model_dir), "--kv-cache-mb", "16", "--log-dir", str(log), *flags],
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        yield up
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)


def until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition(), "timed out"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("served") / "tiny-llama")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_ctrl_c_while_starting_stops_quietly(model_dir: Path, tmp_path: Path) -> None:
    with started_up(model_dir, tmp_path) as up:
        until(lambda: len(children(up.pid)) >= 2, 60)  # the controller and a worker, not serving
        spawned = children(up.pid)
        os.killpg(up.pid, signal.SIGINT)
        err = up.communicate(timeout=60)[1]
    assert up.returncode == 130, err
    assert "interrupted while starting" in err and "stopped: no process left behind" in err
    assert "exited with code" not in err
    until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in spawned), 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat_completion_tokens(base_url: str) -> int:
    """Tokens of a chat completion that sets no max_tokens (and ignores EOS, which a random
    model may well pick first). The chat API takes --default-max-tokens then; completions
    take OpenAI's 16."""
    messages = [{"role": "user", "content": "Hello"}]
    body = json.dumps({"model": "tiny-llama", "messages": messages, "ignore_eos": True}).encode()
    request = urllib.request.Request(
        f"{base_url}/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(json.load(response)["usage"]["completion_tokens"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_ctrl_c_while_serving_stops_everything_and_restarts_nothing(
    model_dir: Path, tmp_path: Path
) -> None:
    """Served on every interface (--host 0.0.0.0) with --default-max-tokens, as a user serving
    other machines would; then Ctrl-C."""
    http_port = free_port()
    flags = ("--host", "0.0.0.0", "--http-port", str(http_port), "--default-max-tokens", "3")
    with started_up(model_dir, tmp_path, *flags) as up:
        assert up.stderr is not None
        output = LineReader(up.stderr)
        banner = output.until(lambda line: line.startswith("serving on"), 120)
        assert banner.startswith("serving on 127.0.0.1:"), banner
        output.until(lambda line: "listening on 0.0.0.0: other machines" in line, 10)
        controller_log = (tmp_path / "controller.log").read_text()
        assert f"HTTP API and /metrics on 0.0.0.0:{http_port}" in controller_log
        assert chat_completion_tokens(f"http://127.0.0.1:{http_port}/v1") == 3
        spawned = children(up.pid)
        os.killpg(up.pid, signal.SIGINT)
        err = output.rest(60)
        assert up.wait(10) == 0, err
    assert "stopped: no process left behind" in err and "restarted" not in err
    until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in spawned), 10)
