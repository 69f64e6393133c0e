"""An engine loop that raises stops the controller (so it is restarted) instead of leaving it
up with nothing served and nothing logged."""

from __future__ import annotations

import asyncio
import logging

import pytest

from controller.app import EngineFailed, _engine_ended, raise_why_stopped


class FakeApis:
    def __init__(self, tasks: list[asyncio.Task[None]]) -> None:
        self.tasks = tasks


def test_a_failed_engine_loop_is_logged_sets_stop_and_ends_the_process_non_zero(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> tuple[bool, asyncio.Task[None]]:
        stop = asyncio.Event()

        async def engine_loop() -> None:
            raise ValueError("Value out of range: 4294967296")

        task = asyncio.create_task(engine_loop(), name="engine")
        task.add_done_callback(lambda t: _engine_ended(stop, t))
        await asyncio.wait_for(stop.wait(), 5)
        return stop.is_set(), task

    with caplog.at_level(logging.CRITICAL):
        stopped, task = asyncio.run(main())
    assert stopped
    assert "the engine loop failed" in caplog.text and "4294967296" in caplog.text
    with pytest.raises(EngineFailed):
        raise_why_stopped(FakeApis([task]), asyncio.Event())  # type: ignore[arg-type]


def test_a_cancelled_engine_loop_is_an_ordinary_stop() -> None:
    async def main() -> tuple[bool, asyncio.Task[None]]:
        stop = asyncio.Event()
        task = asyncio.create_task(asyncio.sleep(60), name="engine")
        task.add_done_callback(lambda t: _engine_ended(stop, t))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0.01)
        return stop.is_set(), task

    stopped, task = asyncio.run(main())
    assert not stopped
    raise_why_stopped(FakeApis([task]), asyncio.Event())  # type: ignore[arg-type]
