"""Where a local cluster's workers run: the CPU, or this machine's GPUs shared out among them.

On the CPU, several workers (PP or TP > 1) each get a share of the cores of their own
(worker_cpus), and pin themselves to it (stage_worker/cpu_pinning.py says why).

A local cluster on GPUs gives worker i (stage * tp + tp_rank) GPU i mod the number of GPUs.
When a GPU holds more than one worker (PP=2 on one GPU, the usual case on a workstation), the
activations go over gloo, since NCCL refuses two ranks on one device, and the workers split
the KV-cache share of the GPU's memory between them.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from sarathictl.argtypes import DEVICE_PATTERN
from stage_worker.cpu_pinning import format_cpu_list


def check_device(device: str) -> None:
    if not DEVICE_PATTERN.fullmatch(device):
        raise ValueError(f"device={device!r}: expected cpu, cuda or cuda:N")


def count_cuda_gpus() -> int:
    """GPUs torch sees here (0 without CUDA); torch is imported only when a GPU is asked for."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_device_args(device: str, worker: int, num_workers: int, num_gpus: int) -> list[str]:
    """The stage_worker flags that place worker `worker` of `num_workers` on device, given the
    GPUs this machine has. Raises ValueError, naming device, when it asks for a GPU not here."""
    check_device(device)
    if device == "cpu":
        return []
    if device == "cuda":
        if num_gpus < 1:
            raise ValueError("device='cuda': no CUDA GPU is visible on this machine")
        gpu, workers_per_gpu = worker % num_gpus, -(-num_workers // num_gpus)
    else:
        gpu, workers_per_gpu = int(device.split(":")[1]), num_workers
        if gpu >= num_gpus:
            raise ValueError(f"device={device!r}: this machine has {num_gpus} CUDA GPUs")
    args = ["--device", f"cuda:{gpu}"]
    if workers_per_gpu > 1:
        # Imported here: it imports torch, which a CPU cluster's command line never needs.
        from stage_worker.kv_cache import GPU_CACHE_FRACTION  # one worker alone's share

        share = GPU_CACHE_FRACTION / workers_per_gpu
        args += ["--comm-backend", "gloo", "--gpu-memory-fraction", f"{share:.3f}"]
    return args


SYSFS_CPUS = Path("/sys/devices/system/cpu")


def physical_cores(allowed: Collection[int], sysfs: Path | None = None) -> list[list[int]]:
    """`allowed` grouped by physical core (the hardware threads of one core together), cores in
    order of package and core id as sysfs's topology says. Linux numbers a core's first thread
    before the siblings (8 cores of 2 threads: 0-7, then 8-15), so consecutive numbers are not
    one core's threads. Where sysfs says nothing (not Linux), each CPU is a core of its own."""
    root = SYSFS_CPUS if sysfs is None else sysfs

    def core_of(cpu: int) -> tuple[int, int]:
        topology = root / f"cpu{cpu}" / "topology"
        try:
            package = int((topology / "physical_package_id").read_text())
            return package, int((topology / "core_id").read_text())
        except (OSError, ValueError):
            return -1, cpu  # unknown: a core of its own, in number order

    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(allowed):
        cores.setdefault(core_of(cpu), []).append(cpu)
    return [cores[key] for key in sorted(cores)]


def worker_cpus(allowed: Collection[int], worker: int, num_workers: int, threads: int) -> list[int]:
    """The CPUs worker `worker` of `num_workers` is pinned to: the next `threads` of the
    `allowed` ones. Where every worker's threads fit on cores of their own, one thread a core
    (a core's siblings share its units); else whole cores, siblings together (a share that is
    not a whole number of cores shares its last core with the next worker). None (the worker
    floats) where one worker has every core, and where the shares do not go round (more threads
    asked for than there are CPUs)."""
    if num_workers < 2 or threads * num_workers > len(allowed):
        return []
    cores = physical_cores(allowed)
    if threads * num_workers <= len(cores):
        order = [core[0] for core in cores]
    else:
        order = [cpu for core in cores for cpu in core]
    return sorted(order[worker * threads : (worker + 1) * threads])


def cpu_args(cpus: Collection[int]) -> list[str]:
    """The stage_worker flag that pins a worker to `cpus` (none where empty)."""
    return ["--cpus", format_cpu_list(cpus)] if cpus else []
