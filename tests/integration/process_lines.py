"""A child process's output read line by line with a deadline: `readline()` on a pipe blocks,
so a child that hangs would hang the test past any deadline written around it."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import IO


class LineReader:
    """Reads `stream` on a thread of its own, to its end."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def until(self, done: Callable[[str], bool], timeout_s: float) -> str:
        """The first line `done` accepts; AssertionError with what was seen if the stream ends or
        the deadline passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no such line in {timeout_s:.0f} s:\n{self.text()}") from None
            if line is None:
                raise AssertionError(f"the output ended first:\n{self.text()}")
            self.seen.append(line)
            if done(line):
                return line

    def rest(self, timeout_s: float) -> str:
        """Everything to the end of the stream (the child exits), as one string."""
        try:
            self.until(lambda _: False, timeout_s)
        except AssertionError as err:
            if "ended first" not in str(err):
                raise
        return self.text()

    def text(self) -> str:
        return "".join(self.seen)
