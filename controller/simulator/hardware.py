"""GPU and interconnect presets: the datasheet numbers the cost model starts from.

Peak rates are NVIDIA datasheet dense BF16 tensor-core numbers (no structured sparsity); memory
bandwidths are datasheet HBM/GDDR numbers. Link bandwidths are per direction. What a kernel or a
collective actually reaches is a separate efficiency factor (controller/simulator/cost_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass


def _require_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float
    """Dense BF16 tensor-core FLOP/s (datasheet)."""
    memory_bandwidth_bytes_s: float
    """Device memory bandwidth in bytes/s (datasheet)."""
    memory_bytes: int
    """Device memory in bytes."""

    def __post_init__(self) -> None:
        _require_positive("peak_flops", self.peak_flops)
        _require_positive("memory_bandwidth_bytes_s", self.memory_bandwidth_bytes_s)
        _require_positive("memory_bytes", self.memory_bytes)


@dataclass(frozen=True)
class LinkSpec:
    name: str
    bandwidth_bytes_s: float
    """Per-direction bandwidth of the link one GPU (or one node, for network links) uses."""
    latency_s: float
    """One-way latency of a small message, software stack included (NCCL over it)."""

    def __post_init__(self) -> None:
        _require_positive("bandwidth_bytes_s", self.bandwidth_bytes_s)
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")


_GB = 1e9
_GIB = 1 << 30

GPUS: dict[str, GpuSpec] = {
    # A100 SXM4 80GB datasheet: 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e.
    "a100": GpuSpec("a100", 312e12, 2039 * _GB, 80 * _GIB),
    # H100 SXM5 80GB datasheet: 989 TFLOPS BF16 dense (1,979 with sparsity), 3.35 TB/s HBM3.
    "h100": GpuSpec("h100", 989e12, 3350 * _GB, 80 * _GIB),
    # A40 datasheet: 149.7 TFLOPS BF16 dense (299.4 with sparsity), 696 GB/s GDDR6, 48 GB.
    "a40": GpuSpec("a40", 149.7e12, 696 * _GB, 48 * _GIB),
}
GPU_ALIASES = {"a100-80gb": "a100", "h100-80gb": "h100"}

LINKS: dict[str, LinkSpec] = {
    # NVLink 3 (A100): 600 GB/s bidirectional per GPU, 300 GB/s each way; NCCL small-message
    # latency is a few microseconds per hop.
    "nvlink": LinkSpec("nvlink", 300 * _GB, 5e-6),
    # PCIe 4.0 x16: 32 GB/s each way; what GPUs that are only pairwise NVLinked (the paper's Azure
    # NC96ads v4 and its A40 server) fall back to between pairs.
    "pcie4": LinkSpec("pcie4", 32 * _GB, 10e-6),
    # Ethernet between nodes (NCCL over sockets/RoCE); 100 and 25 Gbit/s line rate.
    "eth-100g": LinkSpec("eth-100g", 100e9 / 8, 30e-6),
    "eth-25g": LinkSpec("eth-25g", 25e9 / 8, 30e-6),
}
LINK_ALIASES = {
    "eth100": "eth-100g",
    "eth-100": "eth-100g",
    "eth25": "eth-25g",
    "eth-25": "eth-25g",
}


def get_gpu(name: str) -> GpuSpec:
    key = GPU_ALIASES.get(name.lower(), name.lower())
    try:
        return GPUS[key]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}") from None


def get_link(name: str) -> LinkSpec:
    key = LINK_ALIASES.get(name.lower(), name.lower())
    try:
        return LINKS[key]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; known: {', '.join(sorted(LINKS))}") from None
