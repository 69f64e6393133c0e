"""`sarathictl up --local --device cuda` (and `bench capacity --local --device`): each worker
gets a GPU, round robin; workers that share one link over gloo and split its KV-cache share;
a GPU that is not here is refused before any process starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from sarathictl import local_cluster
from sarathictl.commands import up
from sarathictl.local_cluster import LocalCluster, LocalClusterConfig
from sarathictl.local_devices import worker_device_args


def placements(device: str, num_workers: int, num_gpus: int) -> list[list[str]]:
    return [worker_device_args(device, w, num_workers, num_gpus) for w in range(num_workers)]


def test_cpu_workers_get_no_device_flags() -> None:
    assert placements("cpu", 2, 0) == [[], []]


def test_two_stages_on_one_gpu_share_it_over_gloo() -> None:
    shared = ["--device", "cuda:0", "--comm-backend", "gloo", "--gpu-memory-fraction", "0.425"]
    assert placements("cuda", 2, 1) == [shared, shared]


def test_one_worker_per_gpu_keeps_the_default_backend() -> None:
    assert placements("cuda", 2, 2) == [["--device", "cuda:0"], ["--device", "cuda:1"]]


def test_workers_go_round_robin_and_all_use_gloo_when_any_gpu_is_shared() -> None:
    devices = [p[1] for p in placements("cuda", 4, 2)]  # PP 2 x TP 2 on two GPUs
    assert devices == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert all(p[2:4] == ["--comm-backend", "gloo"] for p in placements("cuda", 4, 2))


def test_a_named_gpu_takes_every_worker() -> None:
    assert {p[1] for p in placements("cuda:1", 2, 2)} == {"cuda:1"}


@pytest.mark.parametrize(
    ("device", "num_gpus", "message"),
    [
        ("cuda", 0, "device='cuda': no CUDA GPU is visible"),
        ("cuda:2", 2, "device='cuda:2': this machine has 2 CUDA GPUs"),
        ("tpu", 0, "device='tpu': expected cpu, cuda or cuda:N"),
    ],
)
def test_a_device_not_here_is_refused_naming_it(device: str, num_gpus: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker_device_args(device, 0, 1, num_gpus)


def test_no_process_starts_when_the_gpu_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(local_cluster, "count_cuda_gpus", lambda: 0)
    cluster = LocalCluster(LocalClusterConfig(model_dir=str(tmp_path), device="cuda"))
    with pytest.raises(ValueError, match="no CUDA GPU"):
        cluster.start()
    assert cluster.procs == []


def test_the_config_names_a_bad_device(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="device='gpu0'"):
        LocalClusterConfig(model_dir=str(tmp_path), device="gpu0")


def test_up_on_a_gpu_defaults_to_bfloat16(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    parser = argparse.ArgumentParser()
    up.add_cluster_flags(parser)
    config = up.cluster_config(parser.parse_args(["--model", str(tmp_path), "--device", "cuda"]), 0)
    assert (config.device, config.dtype) == ("cuda", "bfloat16")
