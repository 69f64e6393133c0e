"""A long-lived controller task that raises (the engine loop, the pipeline's receive loop, a
watch) is logged and stops the controller, so it is restarted, instead of leaving it up with
part of its work silently stopped."""

from __future__ import annotations

import asyncio
import logging

import pytest

from controller.app import raise_why_stopped
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
