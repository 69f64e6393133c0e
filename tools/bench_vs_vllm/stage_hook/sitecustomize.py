"""Each pipeline stage's busy time in a vLLM server, for the bubble comparison (bubbles.py).

bench_vs_vllm starts a vLLM pipeline with this folder first on PYTHONPATH and
SARATHI_BENCH_STAGE_LOG set to a folder, so every Python process of the server runs this file
at start-up (Python's `sitecustomize` hook). Where that variable is unset it does nothing.

It wraps two methods of vLLM's `Worker` (vllm/v1/worker/gpu_worker.py, which the CPU worker
inherits) and the calls a stage waits in, once their modules are imported, and each stage's
process appends one line per step to `stage-<pid>.tsv` there: `rank  end_s  busy_s`, where
- busy is the call's wall time less its waits: for the previous step's sends to complete (which
  `execute_model` waits on first) and for this step's activations to arrive: the receive of
  their metadata, which blocks until the stage before sends (`irecv_tensor_dict`,
  vllm/distributed/parallel_state.py), and of the tensors themselves (the lazy
  `AsyncIntermediateTensors.wait_for_comm`). What is left is the stage computing, as our
  workers' step time less their wait for activations (controller/step_log.py's `work_s`); a
  send counts as busy on both servers;
- `sample_tokens`, the last stage's sampling after its forward, is a step line of its own;
- times are `time.perf_counter()`: CLOCK_MONOTONIC, one clock for every process on the
  machine, the client's request start times included.
Nothing of vLLM's changes but the timing around those calls: the steps run as they would.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import IO, Any

FOLDER = os.environ.get("SARATHI_BENCH_STAGE_LOG", "")


class _StageLog:
    """This process's lines (its file opened at its first step: the server's other processes
    write none), and the wait seconds of the call under way."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.out: IO[str] | None = None
        self.rank = -1
        self.waited_s = 0.0

    def step(self, started: float, work: Callable[[], Any]) -> Any:
        self.waited_s = 0.0
        try:
            return work()
        finally:
            end = time.perf_counter()
            busy = max(0.0, end - started - self.waited_s)
            if self.out is None:
                # open for the rest of the process's life, a line at a time
                path = os.path.join(self.folder, f"stage-{os.getpid()}.tsv")
                self.out = open(path, "a", buffering=1)  # noqa: SIM115
            self.out.write(f"{self.rank}\t{end:.6f}\t{busy:.6f}\n")


def _not_as_expected(module: ModuleType) -> None:
    # another vLLM than this was written for: leave it as it is, and say so
    print(f"stage_hook: {module.__name__} is not as expected; stages not timed", file=sys.stderr)


def _patch_receive(module: ModuleType, log: _StageLog) -> None:
    group: Any = getattr(module, "GroupCoordinator", None)
    if not hasattr(group, "irecv_tensor_dict"):
        _not_as_expected(module)
        return
    receive = group.irecv_tensor_dict

    def timed_receive(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return receive(self, *args, **kwargs)
        finally:
            log.waited_s += time.perf_counter() - started

    group.irecv_tensor_dict = timed_receive


def _patch_worker(module: ModuleType, log: _StageLog) -> None:
    worker: Any = getattr(module, "Worker", None)
    tensors: Any = getattr(module, "AsyncIntermediateTensors", None)
    if not (
        hasattr(worker, "execute_model")
        and hasattr(worker, "sample_tokens")
        and hasattr(tensors, "wait_for_comm")
    ):
        _not_as_expected(module)
        return
    execute, sample, wait_for_comm = (
        worker.execute_model,
        worker.sample_tokens,
        tensors.wait_for_comm,
    )

    def timed_wait(self: Any) -> None:
        started = time.perf_counter()
        try:
            wait_for_comm(self)
        finally:
            log.waited_s += time.perf_counter() - started

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if log.rank < 0:
            from vllm.distributed import get_pp_group  # type: ignore[import-not-found]

            log.rank = get_pp_group().rank_in_group
        started = time.perf_counter()

        def work() -> Any:
            # The sends of the step before, waited for as execute_model would at its top.
            sends = getattr(self, "_pp_send_work", None)
            if sends:
                for handle in sends:
                    handle.wait()
                self._pp_send_work = []
                log.waited_s += time.perf_counter() - started
            return execute(self, scheduler_output, *args, **kwargs)

        if scheduler_output.total_num_scheduled_tokens == 0:
            return execute(self, scheduler_output, *args, **kwargs)  # no forward: not a step
        return log.step(started, work)

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        return log.step(time.perf_counter(), lambda: sample(self, *args, **kwargs))

    tensors.wait_for_comm = timed_wait
    worker.execute_model = execute_model
    worker.sample_tokens = sample_tokens


PATCHES: dict[str, Callable[[ModuleType, _StageLog], None]] = {
    "vllm.v1.worker.gpu_worker": _patch_worker,
    "vllm.distributed.parallel_state": _patch_receive,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds each module of PATCHES as the other finders would, and patches it once it has
    run."""

    def __init__(self, log: _StageLog) -> None:
        self.log = log
        self.left = dict(PATCHES)

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        patch = self.left.pop(name, None)
        if patch is None:
            return None
        sys.meta_path.remove(self)  # the real spec, from the finders after this one
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if self.left:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, log = spec.loader, self.log
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module, log)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if FOLDER:
    sys.meta_path.insert(0, _PatchOnImport(_StageLog(FOLDER)))
