"""Leaves the process when the main thread stays blocked on another process for too long.

A gloo or NCCL receive has no useful timeout of its own (the process group's is for rendezvous
and is minutes long), and a peer behind a cut link neither answers nor closes its socket: the
receive would wait forever, and so would this worker. The main thread marks such waits with
`guard`; a background thread exits the process once one outlasts its limit, and the supervisor
(Kubernetes, `sarathictl up --local`) restarts the worker, which registers again and joins the
rebuilt pipeline. A wait shown to be making progress (the peer is still stepping, say the
controller's pings) gets its limit again from then (`renew`); one whose end is no longer
wanted (the controller took the pipeline down) ends now (`expire`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 0.25


def _exit_now(code: int) -> None:
    logging.shutdown()
    os._exit(code)


class Watchdog:
    def __init__(
        self,
        exit_code: int,
        exit_process: Callable[[int], None] = _exit_now,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.exit_code = exit_code
        self._exit_process = exit_process
        self._clock = clock
        self._what = ""
        self._deadline = float("inf")
        self._guard_no = 0
        self._lock = threading.Lock()  # guards begin and end against renew's thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, what: str, limit_s: float) -> Iterator[int]:
        """While inside, the process exits if it is still inside after limit_s seconds (or
        after the limit renew set). Gives the guard's number, for renew."""
        with self._lock:
            self._guard_no += 1
            number = self._guard_no
            # Two plain stores (check reads them together; a torn read only delays it a turn).
            self._what, self._deadline = what, self._clock() + limit_s
        try:
            yield number
        finally:
            with self._lock:
                self._deadline = float("inf")

    def renew(self, number: int, limit_s: float) -> bool:
        """Guard `number`'s limit becomes limit_s from now, if the main thread is still inside
        it (a wait shown to be making progress); False otherwise."""
        with self._lock:
            if number != self._guard_no or self._deadline == float("inf"):
                return False
            self._deadline = self._clock() + limit_s
            return True

    def expire(self, number: int, why: str) -> bool:
        """Guard `number` is past its limit now (what the wait is for is no longer wanted:
        `why`), if the main thread is still inside it; False otherwise."""
        with self._lock:
            if number != self._guard_no or self._deadline == float("inf"):
                return False
            self._what, self._deadline = f"{self._what} ({why})", -float("inf")
            return True

    def check(self) -> bool:
        """One look: exits the process (returns True) if a guarded wait is past its limit."""
        deadline, what = self._deadline, self._what
        if self._clock() <= deadline:
            return False
        logger.error("%s: still blocked past its limit; exiting to be restarted", what)
        self._exit_process(self.exit_code)
        return True

    def _run(self) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            if self.check():
                return

    def stop(self) -> None:
        self._stop.set()
