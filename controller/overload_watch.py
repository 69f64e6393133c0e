"""Tells when admission overload starts and when it ends, for the controller's events.

Overload is the admission queue at one of its bounds (controller/admission.py), so new requests
are refused; a request refused there since the last look counts too, for a burst that fills and
drains the queue between two looks. It ends once the queue has stayed below its bounds for a
while: a queue that refills at once after each admission is one overload, not many.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from controller.engine import Engine

# How often the queue is looked at.
_PERIOD_S = 0.25
# Below the bounds for this long ends an overload.
CLEAR_AFTER_S = 3.0


class OverloadTracker:
    """Turns samples of the admission queue into start and end calls."""

    def __init__(
        self,
        on_start: Callable[[str], None],
        on_end: Callable[[float], None],
        clear_after_s: float = CLEAR_AFTER_S,
    ) -> None:
        self.on_start = on_start
        self.on_end = on_end
        self.clear_after_s = clear_after_s
        self.started_at: float | None = None
        self._last_overloaded_at = 0.0

    def sample(self, now: float, reason: str) -> None:
        """reason: overload_reason() now ("" when the queue admits)."""
        if reason:
            self._last_overloaded_at = now
            if self.started_at is None:
                self.started_at = now
                self.on_start(reason)
        elif self.started_at is not None and now - self._last_overloaded_at >= self.clear_after_s:
            lasted_s = self._last_overloaded_at - self.started_at
            self.started_at = None
            self.on_end(lasted_s)


async def watch_overload(engine: Engine, tracker: OverloadTracker) -> None:
    while True:
        # A refusal between two looks counts: a burst can fill and drain the queue within a period.
        seen = engine.take_overload_seen()
        reason = engine.overload_reason() or seen
        tracker.sample(engine.clock(), reason)
        await asyncio.sleep(_PERIOD_S)
