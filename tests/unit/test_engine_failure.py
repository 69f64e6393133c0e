"""A long-lived controller task that raises (the engine loop, the pipeline's receive loop, a
watch) is logged and stops the controller, so it is restarted, instead of leaving it up with
part of its work silently stopped."""

from __future__ import annotations

import asyncio
import logging
from typing import cast

import pytest

from controller.app import raise_why_stopped
from controller.config import ParallelConfig
from controller.executor.control_channel import ControlChannel
from controller.executor.pipeline import PipelineExecutor
from controller.task_watch import TaskFailed, start_watched


def run_watched(work: object, name: str) -> tuple[list[str], bool]:
    """(the names on_failure was called with, whether stop was set) once the task ended."""

    async def main() -> tuple[list[str], bool]:
        stop, failed = asyncio.Event(), []

        def on_failure(failed_name: str) -> None:
            failed.append(failed_name)
            stop.set()

        task = start_watched(work, name, on_failure)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        if name == "cancelled":
            task.cancel()
        await asyncio.wait({task})
        await asyncio.sleep(0)  # done callbacks run on the next turn
        return failed, stop.is_set()

    return asyncio.run(main())


@pytest.mark.parametrize("name", ["engine", "pipeline-recv", "health", "http-api"])
def test_a_task_that_raises_is_logged_and_stops_the_controller_non_zero(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def fails() -> None:
        raise ValueError("Value out of range: 4294967296")

    with caplog.at_level(logging.CRITICAL):
        failed, stopped = run_watched(fails(), name)
    assert failed == [name] and stopped
    assert f"the {name} task failed" in caplog.text and "4294967296" in caplog.text
    with pytest.raises(TaskFailed, match=name):
        raise_why_stopped(asyncio.Event(), failed)


def test_a_cancelled_task_is_an_ordinary_stop() -> None:
    failed, stopped = run_watched(asyncio.sleep(60), "cancelled")
    assert failed == [] and not stopped
    raise_why_stopped(asyncio.Event(), failed)


class BrokenChannel:
    """A control channel whose socket fails under the receive loop."""

    received_at = 0.0

    async def recv(self) -> object:
        raise RuntimeError("Socket operation on non-socket")


def test_the_pipeline_receive_loop_failing_is_logged_and_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> list[str]:
        pipeline = PipelineExecutor(
            cast(ControlChannel, BrokenChannel()), ParallelConfig(pp=1, tp=1), "m", "", 1
        )
        failed: list[str] = []
        pipeline.on_task_failed = failed.append
        with pytest.raises(TimeoutError):
            await pipeline.start(timeout_s=0.2)
        return failed

    with caplog.at_level(logging.CRITICAL):
        failed = asyncio.run(main())
    assert failed == ["pipeline-recv"]
    assert "the pipeline-recv task failed" in caplog.text and "non-socket" in caplog.text
