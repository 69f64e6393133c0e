"""Pins a stage worker to the CPUs it was given (`--cpus`), every thread of it.

Why: on a machine whose cores are shared out among several workers (`sarathictl up --local`
with PP or TP > 1), a worker left to float migrates between cores mid-step, and the threads that
wake for its sockets (ZeroMQ's I/O thread, the keepalive) land on a core another stage is
computing on. Pinned, each stage computes on its own core and is interrupted only by its own
threads and the controller. Measured on the Zen 5 EPYC, PP=2 on 2 cores (BENCHMARKS.md, "Each
stage on its own core"). A worker alone on every core is not pinned: its OpenMP threads bound
to cores lost 1.8x on a prompt chunk there, since the controller's turns then stall a whole
parallel region.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable

logger = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`0-3,8` -> (0, 1, 2, 3, 8): CPU numbers and ranges, as Linux's cpulist files write them;
    empty: none. Raises ValueError saying what is wrong."""
    if not text.strip():
        return ()
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{part.strip()!r} is neither a CPU number nor a range in {text!r}")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"range {part.strip()!r} runs backwards in {text!r}")
        cpus.extend(range(lo, hi + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"a CPU is named twice in {text!r}")
    return tuple(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> `0-3,8`: the inverse of parse_cpu_list."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)


def pin_process(cpus: tuple[int, ...]) -> None:
    """Every thread of this process, and those it starts later, on `cpus` only. Raises
    ValueError, naming --cpus, where a CPU is not this process's to use or the platform cannot
    pin threads (not Linux)."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        raise ValueError(f"--cpus {format_cpu_list(cpus)}: this platform cannot pin threads")
    allowed = os.sched_getaffinity(0)
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise ValueError(
            f"--cpus {format_cpu_list(cpus)}: CPU(s) {format_cpu_list(outside)} not among those "
            f"this process may use ({format_cpu_list(allowed)})"
        )
    for task in os.listdir("/proc/self/task"):  # the threads already started (torch's, ...)
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)
    logger.info("pinned to CPU(s) %s", format_cpu_list(cpus))
