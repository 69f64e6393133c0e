"""CPU workers of a local cluster, several of them, each pinned to its own share of the cores
(`--cpus`, stage_worker/cpu_pinning.py), every thread of the worker included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sarathictl import local_devices
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig, pinned_cpus
from sarathictl.local_devices import cpu_args, physical_cores, worker_cpus

from stage_worker.cpu_pinning import format_cpu_list, parse_cpu_list, pin_process


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", (0,)), ("0-3,8", (0, 1, 2, 3, 8)), ("5,2", (5, 2)), ("1-2", (1, 2))],
)
def test_a_cpu_list_reads_as_linux_writes_it(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == tuple(sorted(cpus))


def test_a_cpu_list_is_written_in_ranges() -> None:
    assert format_cpu_list([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    assert parse_cpu_list("") == ()


@pytest.mark.parametrize(
    ("text", "why"),
    [("x", "neither a CPU number nor a range"), ("3-1", "runs backwards"), ("0,1,0", "twice")],
)
def test_a_bad_cpu_list_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_cpu_list(text)


def test_each_worker_gets_the_next_share_of_the_cores_in_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(local_devices, "SYSFS_CPUS", tmp_path / "absent")  # no topology known
    assert [worker_cpus({3, 1, 0, 2}, w, 2, 2) for w in range(2)] == [[0, 1], [2, 3]]
    assert [worker_cpus({0, 1, 2}, w, 2, 1) for w in range(2)] == [[0], [1]]  # one left over


def _fake_topology(root: Path, cores: dict[int, int]) -> Path:
    """A sysfs cpu folder where logical CPU -> physical core id, one package."""
    for cpu, core in cores.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    return root


def test_a_share_takes_whole_physical_cores_never_anothers_siblings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # 4 cores of 2 threads, numbered as Linux does: 0-3 the first threads, 4-7 their siblings.
    sysfs = _fake_topology(tmp_path, {cpu: cpu % 4 for cpu in range(8)})
    monkeypatch.setattr(local_devices, "SYSFS_CPUS", sysfs)
    assert physical_cores(range(8), sysfs) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    shares = [worker_cpus(set(range(8)), w, 2, 4) for w in range(2)]
    assert shares == [[0, 1, 4, 5], [2, 3, 6, 7]]  # stage 0 on cores 0-1, stage 1 on 2-3
    # threads that fit on cores of their own take one thread a core, never a sibling
    assert [worker_cpus(set(range(8)), w, 2, 1) for w in range(2)] == [[0], [1]]
    assert [worker_cpus(set(range(8)), w, 2, 2) for w in range(2)] == [[0, 1], [2, 3]]
    # where sysfs says nothing, each CPU a core of its own
    assert physical_cores({2, 0, 1}, tmp_path / "absent") == [[0], [1], [2]]


def test_a_worker_alone_or_shares_that_do_not_go_round_are_not_pinned() -> None:
    assert worker_cpus({0, 1}, 0, 1, 2) == []  # one worker on every core floats
    assert worker_cpus({0, 1}, 0, 4, 1) == []  # PP=2 x TP=2 on 2 cores: oversubscribed
    assert worker_cpus({0, 1}, 0, 2, 2) == []  # --threads 2 each on 2 cores
    assert cpu_args([]) == []
    assert cpu_args([2, 3]) == ["--cpus", "2-3"]


def test_a_local_cluster_pins_cpu_workers_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(local_devices, "SYSFS_CPUS", tmp_path / "absent")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    cfg = LocalClusterConfig(model_dir=str(tmp_path), pp=2, threads_per_worker=2)
    assert [pinned_cpus(cfg, w) for w in range(2)] == [[0, 1], [2, 3]]
    flags = LocalCluster(cfg)._worker_placements()
    assert flags == [["--cpus", "0-1"], ["--cpus", "2-3"]]
    off = LocalClusterConfig(model_dir=str(tmp_path), pp=2, threads_per_worker=2, pin_cpus=False)
    assert LocalCluster(off)._worker_placements() == [[], []]
    second = LocalClusterConfig(
        model_dir=str(tmp_path), pp=2, threads_per_worker=1, cpu_share=(1, 2)
    )  # the second of two clusters side by side: the other half of the cores
    assert [pinned_cpus(second, w) for w in range(2)] == [[2], [3]]
    with pytest.raises(ValueError, match="cpu_share"):
        LocalClusterConfig(model_dir=str(tmp_path), pp=2, cpu_share=(2, 2))
    gpu = LocalClusterConfig(model_dir=str(tmp_path), pp=2, threads_per_worker=2, device="cuda:0")
    assert [pinned_cpus(gpu, w) for w in range(2)] == [[], []]


PIN_SCRIPT = """
import os, threading
from stage_worker.cpu_pinning import pin_process
started = threading.Event()
stop = threading.Event()
def run():
    started.set()
    stop.wait()
before = threading.Thread(target=run)
before.start()
started.wait()
cpu = max(os.sched_getaffinity(0))
pin_process((cpu,))
after = threading.Thread(target=run)
after.start()
tasks = os.listdir("/proc/self/task")
masks = {",".join(map(str, sorted(os.sched_getaffinity(int(t))))) for t in tasks}
stop.set()
print(cpu, "|".join(sorted(masks)), len(tasks))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: every mask is it already")
def test_every_thread_is_pinned_those_started_before_and_after() -> None:
    """In a process of its own, as a worker: a thread started before pin_process and one after
    it run on the one CPU given, as the main thread does."""
    out = subprocess.run(
        [sys.executable, "-c", PIN_SCRIPT], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    cpu, masks, threads = int(out[0]), out[1], int(out[2])
    assert threads >= 3
    assert masks == str(cpu)  # one mask among all the threads: that CPU alone


def test_a_cpu_this_process_may_not_use_is_refused_naming_the_flag() -> None:
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"--cpus {outside}: CPU\(s\) {outside} not among"):
        pin_process((outside,))


def test_a_platform_that_cannot_pin_threads_is_refused_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(os, "sched_setaffinity")
    with pytest.raises(ValueError, match=r"--cpus 0: this platform cannot pin threads"):
        pin_process((0,))
