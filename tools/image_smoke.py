"""Smoke test of a built image, run inside a container of it by the image's own python
(tools/build_images.sh mounts this file in; standard library only). The checks of
tests/integration/test_installed_wheel.py, on what the image installed:

- it runs as uid 1000, with no C compiler on PATH, and the C kernels (stage_worker._kernels)
  import from the image's virtual environment, built with OpenMP;
- the demo model the image carries (read-only for uid 1000) is served by `sarathictl up --local`
  at PP 2 and answers "Paris" over OpenAI HTTP (/v1/chat/completions) and over gRPC
  (`sarathictl generate --json`).

Exits 0 when every check passed, 1 with a message naming the first that failed."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODEL_DIR = Path(os.environ.get("SARATHI_SMOKE_MODEL", "/opt/sarathi/models/smollm2-135m-instruct"))
VENV = Path(os.environ.get("VIRTUAL_ENV", "/opt/venv"))
QUESTION = "What is the capital of France?"
EXPECTED = "Paris"
SERVE_TIMEOUT_S = 300.0


class SmokeFailure(Exception):
    pass


def check(ok: object, message: str) -> None:
    if not ok:
        raise SmokeFailure(message)


def step(message: str) -> None:
    print(f"image_smoke: {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_user_and_kernels() -> None:
    uid = os.getuid()
    step(f"uid {uid}, HOME {os.environ.get('HOME')}, python {sys.executable}")
    check(uid == 1000, f"runs as uid {uid}, not the image's user 1000")
    for compiler in ("cc", "gcc"):
        found = shutil.which(compiler)
        check(found is None, f"the image has a C compiler on PATH ({found}); it should not")
    probe = (
        "import json, torch, stage_worker._kernels as k; "
        "print(json.dumps([torch.__version__, k.__file__, k.openmp(), k.cpu_supported()]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False
    )
    check(done.returncode == 0, f"import stage_worker._kernels failed:\n{done.stderr[-2000:]}")
    torch_version, kernels_file, openmp, cpu_supported = json.loads(done.stdout)
    step(
        f"torch {torch_version}; stage_worker._kernels {kernels_file}: "
        f"k.openmp()={openmp}, k.cpu_supported()={cpu_supported}"
    )
    check(str(kernels_file).startswith(str(VENV)), f"kernels not from {VENV}: {kernels_file}")
    check(openmp, "stage_worker._kernels was built without OpenMP")
    if not cpu_supported:
        step("this CPU lacks AVX-512 with bf16: bf16 workers run the torch path (as designed)")


def check_model_dir() -> None:
    config = MODEL_DIR / "config.json"
    check(config.is_file(), f"no {config}: the image does not carry the demo model")
    json.loads(config.read_text())
    size_mib = sum(f.stat().st_size for f in MODEL_DIR.iterdir() if f.is_file()) / (1 << 20)
    step(f"model {MODEL_DIR}: {sorted(f.name for f in MODEL_DIR.iterdir())} ({size_mib:.0f} MiB)")
    check(not os.access(MODEL_DIR, os.W_OK), f"{MODEL_DIR} is writable by uid {os.getuid()}")


def get_json(url: str, timeout: float) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def wait_for_openai(up: subprocess.Popen[bytes], http_port: int, up_log: Path) -> str:
    """The served model's id, once /v1/models answers."""
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while time.monotonic() < deadline:
        code = up.poll()
        check(code is None, f"sarathictl up exited with {code}:\n{tail(up_log)}")
        try:
            get_json(f"http://127.0.0.1:{http_port}/health", timeout=2)
            models = get_json(f"http://127.0.0.1:{http_port}/v1/models", timeout=2)
            assert isinstance(models, dict)
            return str(models["data"][0]["id"])
        except OSError:
            time.sleep(1.0)
    raise SmokeFailure(f"the cluster did not serve within {SERVE_TIMEOUT_S:.0f} s:\n{tail(up_log)}")


def chat(http_port: int, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 24, "temperature": 0}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return str(json.load(response)["choices"][0]["message"]["content"])


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as err:
        return f"({path}: {err})"


def logs_tail(log_dir: Path) -> str:
    return "\n".join(
        f"--- {f.name}\n{tail(f, 1500)}" for f in sorted(log_dir.rglob("*")) if f.is_file()
    )


def check_serving(work: Path) -> None:
    sarathictl = shutil.which("sarathictl")
    check(sarathictl is not None, "no sarathictl on PATH")
    assert sarathictl is not None
    grpc_port, http_port = free_port(), free_port()
    log_dir = work / "logs"
    up_log = work / "up.log"
    command = [
        sarathictl, "up", "--local", "--pp", "2", "--model", str(MODEL_DIR),
        "--dtype", "float32", "--kv-cache-mb", "64", "--port", str(grpc_port),
        "--http-port", str(http_port), "--log-dir", str(log_dir),
    ]  # fmt: skip
    step(" ".join(command))
    started = time.monotonic()
    with up_log.open("wb") as out:
        up = subprocess.Popen(command, cwd=work, stdout=out, stderr=subprocess.STDOUT)
    try:
        model = wait_for_openai(up, http_port, up_log)
        step(f"serving {model!r} after {time.monotonic() - started:.1f} s")
        answer = chat(http_port, model)
        step(f"OpenAI HTTP /v1/chat/completions: {answer!r}")
        check(EXPECTED in answer, f"the HTTP answer lacks {EXPECTED!r}: {answer!r}")
        generated = subprocess.run(
            [sarathictl, "generate", QUESTION, "--chat", "--addr", f"127.0.0.1:{grpc_port}",
             "--max-tokens", "24", "--json"],
            cwd=work, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        check(generated.returncode == 0, f"sarathictl generate failed:\n{generated.stderr[-2000:]}")
        text = str(json.loads(generated.stdout)["text"])
        step(f"gRPC sarathictl generate: {text!r}")
        check(EXPECTED in text, f"the gRPC answer lacks {EXPECTED!r}: {text!r}")
    except SmokeFailure:
        print(logs_tail(log_dir), file=sys.stderr)
        raise
    finally:
        up.terminate()
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    step(f"sarathictl up stopped (exit {up.returncode})")


def main() -> int:
    started = time.monotonic()
    try:
        check_user_and_kernels()
        check_model_dir()
        with tempfile.TemporaryDirectory(prefix="sarathi-smoke-") as work:
            check_serving(Path(work))
    except SmokeFailure as failure:
        print(f"image_smoke: FAILED: {failure}", file=sys.stderr)
        return 1
    step(f"all checks passed in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
