"""Opt-in view inside the controller's memory (`--memory-trace-dir`), for soaks.

When on, `tracemalloc` traces every Python allocation and a background thread writes, every
`--memory-trace-interval` seconds and once more at exit:

- `memory.jsonl`: one line a report: the process RSS, what tracemalloc traces (Python objects'
  memory) and its own overhead, glibc's malloc view (bytes in use, bytes free but held by the
  allocator, mmapped bytes) and the live object count, plus the ten allocation sites that grew
  most since the first report;
- `report-NNNN.txt`: the sites (file:line) that grew most since the first report and since the
  previous one, the call paths that grew most, the sites that hold most now, and the object
  types whose count grew most.

RSS growth that tracemalloc also sees is Python objects kept alive (a leak, or a window still
filling); growth it does not see is native (gRPC's core, torch, ZeroMQ) or the allocator
holding freed memory (the `malloc_free_mib` column).

Off by default and then free: nothing is started (`controller/__main__.py` only reads the
flags). On, Python allocations cost more (tracemalloc records a traceback for each) and every
report walks the traces while the engine waits for the GIL (3-6 s with a million live blocks on
the 2-core machine); the traces and each report's transient copy of them also inflate and
fragment the heap, so the RSS of a traced run is not the RSS of an untraced one. For RSS
figures, `--memory-trace-frames 0` skips tracemalloc and reports only RSS, malloc's view and
object counts. For soaks and debugging only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import json
import linecache
import logging
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from controller.scheduler import ConfigError

log = logging.getLogger(__name__)

MIB = 1 << 20

# tracemalloc's and this module's own bookkeeping, and the import machinery, are not the
# controller's memory.
_IGNORED_FILES = (
    tracemalloc.__file__,
    linecache.__file__,
    __file__,
    "<frozen importlib._bootstrap>",
)


@dataclass(frozen=True)
class MemoryTraceConfig:
    out_dir: str = ""
    """Folder the reports go to; empty: tracing off."""
    interval_s: float = 60.0
    """Seconds between reports."""
    frames: int = 4
    """Frames kept per allocation (1: only the allocating line; more: its callers too). 0: no
    tracemalloc, only RSS, malloc's view and object counts (for a soak whose RSS must not be
    disturbed by the tracing)."""
    top: int = 25
    """Sites listed per table of a report."""

    def __post_init__(self) -> None:
        if not 1.0 <= self.interval_s <= 86400.0:
            raise ConfigError("memory_trace_interval_s", self.interval_s, "in [1, 86400]")
        if not 0 <= self.frames <= 64:
            raise ConfigError("memory_trace_frames", self.frames, "in [0, 64]")
        if not 1 <= self.top <= 1000:
            raise ConfigError("memory_trace_top", self.top, "in [1, 1000]")

    @property
    def enabled(self) -> bool:
        return bool(self.out_dir)


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc); 0 where there is none."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    """glibc's mallinfo2 (glibc >= 2.33); None elsewhere (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        func = ctypes.CDLL(name).mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    func.restype = _MallInfo2
    func.argtypes = []
    return func


Stats = dict[tracemalloc.Traceback, tuple[int, int]]
"""Allocation site (or call path) -> (bytes, blocks) traced there."""


_Row = tuple[tracemalloc.Traceback, int, int]
"""(site or call path, bytes grown, blocks grown)."""


@dataclass(frozen=True)
class _Growth:
    """One report's growth rows, most bytes first."""

    since_first: list[_Row]
    since_previous: list[_Row]
    paths_since_first: list[_Row]
    """By call path (empty unless --memory-trace-frames is above 1)."""


def _growth(now: Stats, before: Stats) -> list[_Row]:
    """(site, bytes grown, blocks grown), most bytes first; sites that shrank last."""
    rows = []
    for key in now.keys() | before.keys():
        size, count = now.get(key, (0, 0))
        old_size, old_count = before.get(key, (0, 0))
        if size != old_size or count != old_count:
            rows.append((key, size - old_size, count - old_count))
    rows.sort(key=lambda row: row[1], reverse=True)
    return rows


def _site(traceback: tracemalloc.Traceback) -> str:
    frame = traceback[0]
    return f"{frame.filename}:{frame.lineno}"


def _path(traceback: tracemalloc.Traceback) -> str:
    """The call path, innermost frame last, one frame a line."""
    return "\n".join(f"      {f.filename}:{f.lineno}" for f in reversed(traceback))


class MemoryTracer:
    """Starts tracemalloc and writes reports; `report()` writes one now."""

    def __init__(self, config: MemoryTraceConfig) -> None:
        self.config = config
        self.out_dir = Path(config.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._mallinfo2 = _mallinfo2()
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: tuple[Stats, Stats] | None = None
        self._previous: Stats | None = None
        self._first_types: Counter[str] | None = None
        self.reports = 0

    def start(self) -> None:
        if self.config.frames and not tracemalloc.is_tracing():
            tracemalloc.start(self.config.frames)
        self._thread = threading.Thread(target=self._run, name="memory-trace", daemon=True)
        self._thread.start()
        log.info(
            "memory trace on: a report every %g s into %s", self.config.interval_s, self.out_dir
        )

    def stop(self) -> None:
        """Writes a last report and stops tracing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.report()
        if self.config.frames:
            tracemalloc.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.report()
            except Exception:  # a report must never take the controller down
                log.exception("memory trace report failed")

    def _snapshot(self) -> tuple[Stats, Stats]:
        """(by allocating line, by call path); only sums are kept, never the traces. (The
        ignored files are dropped from the sums: Snapshot.filter_traces matches every trace
        in Python, a minute with a million traces.)"""
        if not tracemalloc.is_tracing():
            return {}, {}
        snapshot = tracemalloc.take_snapshot()
        groups = ("lineno", "traceback") if self.config.frames > 1 else ("lineno",)
        by_line: Stats = {}
        by_path: Stats = {}
        for group, stats in zip(groups, (by_line, by_path), strict=False):
            for stat in snapshot.statistics(group):
                if stat.traceback[0].filename not in _IGNORED_FILES:
                    stats[stat.traceback] = (stat.size, stat.count)
        return by_line, by_path

    def _malloc(self) -> dict[str, float]:
        if self._mallinfo2 is None:
            return {}
        info = self._mallinfo2()
        return {
            "malloc_in_use_mib": round(info.uordblks / MIB, 2),
            "malloc_free_mib": round(info.fordblks / MIB, 2),
            "malloc_mmap_mib": round(info.hblkhd / MIB, 2),
        }

    def report(self) -> Path:
        """Writes report-NNNN.txt and a memory.jsonl line; returns the report's path."""
        with self._lock:
            return self._report()

    def _report(self) -> Path:
        began = time.monotonic()
        rss = rss_bytes()  # before the snapshot's own (transient) memory
        by_line, by_path = self._snapshot()
        types = Counter(type(obj).__qualname__ for obj in gc.get_objects())
        growth = self._growth_since_earlier_reports(by_line, by_path, types)
        line = self._summary(rss, types, growth.since_first, began)
        path = self._write_text_report(line, growth, by_line, types)
        with (self.out_dir / "memory.jsonl").open("a") as jsonl:
            jsonl.write(json.dumps(line) + "\n")
        return path

    def _growth_since_earlier_reports(
        self, by_line: Stats, by_path: Stats, types: Counter[str]
    ) -> _Growth:
        """What grew since the first report and since the previous one. The first report is
        the baseline of the later ones (its own growth is empty): growth since it is what the
        soak has accumulated, growth since the previous report what the last interval added."""
        if self._first is None:
            self._first, self._previous, self._first_types = (by_line, by_path), by_line, types
        assert self._previous is not None
        first_line, first_path = self._first
        growth = _Growth(
            since_first=_growth(by_line, first_line),
            since_previous=_growth(by_line, self._previous),
            paths_since_first=_growth(by_path, first_path),
        )
        self._previous = by_line
        return growth

    def _summary(
        self, rss: int, types: Counter[str], since_first: list[_Row], began: float
    ) -> dict[str, object]:
        """The report's memory.jsonl line (also the head of its text report), sizes in MiB."""
        line: dict[str, object] = {
            "t_s": round(time.monotonic() - self._started, 1),
            "rss_mib": round(rss / MIB, 2),
        }
        if tracemalloc.is_tracing():  # not with --memory-trace-frames 0
            traced, peak = tracemalloc.get_traced_memory()
            line["traced_mib"] = round(traced / MIB, 2)
            line["traced_peak_mib"] = round(peak / MIB, 2)
            line["tracemalloc_overhead_mib"] = round(tracemalloc.get_tracemalloc_memory() / MIB, 2)
        line |= {
            **self._malloc(),
            "gc_objects": sum(types.values()),  # tracked, outside the frozen start-up heap
            "gc_frozen": gc.get_freeze_count(),
            "report_s": round(time.monotonic() - began, 2),
            "top_growth_since_first": [
                {"site": _site(key), "kib": round(size / 1024, 1), "blocks": count}
                for key, size, count in since_first[:10]
            ],
        }
        return line

    def _write_text_report(
        self, line: dict[str, object], growth: _Growth, by_line: Stats, types: Counter[str]
    ) -> Path:
        """report-NNNN.txt: the summary's figures, then the tables of what grew and is held."""
        assert self._first_types is not None  # set by the first report's comparison
        number = self.reports
        self.reports += 1
        path = self.out_dir / f"report-{number:04d}.txt"
        with path.open("w") as out:
            out.write(f"memory report {number} at {line['t_s']} s\n")
            for name, value in line.items():
                if not isinstance(value, list):  # the top sites get a table of their own below
                    out.write(f"  {name}: {value}\n")
            _write_site_tables(out, growth, by_line, self.config.top)
            _write_type_growth(out, types, self._first_types, self.config.top)
        return path


def _write_site_tables(out: TextIO, growth: _Growth, by_line: Stats, top: int) -> None:
    """The allocation sites that grew (since the first report, since the previous one), the
    call paths that grew, and the sites holding most now; `top` rows a table."""
    tables = (
        ("grew most since the first report", growth.since_first),
        ("grew most since the previous report", growth.since_previous),
    )
    for title, rows in tables:
        out.write(f"\n{title} (KiB, blocks, site):\n")
        for key, size, count in rows[:top]:
            out.write(f"  {size / 1024:+12.1f} {count:+9d}  {_site(key)}\n")
    if growth.paths_since_first:
        out.write("\ncall paths that grew most since the first report:\n")
        # A path takes several lines: fewer of them keep the report readable.
        for key, size, count in growth.paths_since_first[: max(1, top // 3)]:
            out.write(f"  {size / 1024:+12.1f} KiB {count:+9d} blocks\n{_path(key)}\n")
    out.write("\nheld most now (KiB, blocks, site):\n")
    held = sorted(by_line.items(), key=lambda item: item[1][0], reverse=True)
    for key, (size, count) in held[:top]:
        out.write(f"  {size / 1024:12.1f} {count:9d}  {_site(key)}\n")


def _write_type_growth(
    out: TextIO, types: Counter[str], first_types: Counter[str], top: int
) -> None:
    """The object types whose live count grew most since the first report (what tracemalloc's
    sites do not say: which objects are kept)."""
    out.write("\nobject types whose count grew most since the first report:\n")
    type_growth = Counter(types)
    type_growth.subtract(first_types)
    for name, grown in type_growth.most_common(top):
        if grown <= 0:
            break
        out.write(f"  {grown:+9d}  {name} ({types[name]} now)\n")


@contextlib.contextmanager
def memory_trace(config: MemoryTraceConfig) -> Iterator[MemoryTracer | None]:
    """Traces while the block runs when config.enabled; does nothing otherwise."""
    if not config.enabled:
        yield None
        return
    tracer = MemoryTracer(config)
    tracer.start()
    try:
        yield tracer
    finally:
        tracer.stop()
