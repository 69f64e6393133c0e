"""The controller's long-lived asyncio tasks end only when cancelled. One that raises would stop
its work with nothing logged (asyncio reports an exception only when the task is garbage
collected, and these are held until shutdown): a receive loop that dies leaves a controller
that no longer hears its workers. Each is watched: its exception is logged with the traceback
and `on_failure` settles what follows (the controller stops, exits non-zero, is restarted)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)

# Called with the failed task's name.
FailureHandler = Callable[[str], None]


class TaskFailed(RuntimeError):
    """A long-lived task of the controller raised: the controller stops, to be restarted."""


def start_watched(
    work: Coroutine[Any, Any, None], name: str, on_failure: FailureHandler
) -> asyncio.Task[None]:
    """asyncio.create_task(work, name=name), watched (see watch)."""
    return watch(asyncio.create_task(work, name=name), on_failure)


def watch(task: asyncio.Task[None], on_failure: FailureHandler) -> asyncio.Task[None]:
    """Logs the task's exception, if it ends with one, and calls on_failure(its name)."""
    task.add_done_callback(functools.partial(_ended, on_failure))
    return task


def _ended(on_failure: FailureHandler, task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    err = task.exception()
    if err is None:
        return
    log.critical("the %s task failed; stopping", task.get_name(), exc_info=err)
    on_failure(task.get_name())
