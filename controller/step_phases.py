"""Where the controller's step time goes: wall seconds per phase, summed since start.

The engine (schedule, apply, detokenize, stream) and the pipeline executor (encode, send,
receive, decode) add to one ControllerPhases; Status reports the totals (generate.proto
ControllerPhases) and a reader takes differences of two readings. The names are those of
`sarathictl bench controller-step`, which times the same work against a stand-in worker.
Wall time (perf_counter), not CPU time: on a machine whose cores the workers share, waiting for
a core is part of what a step costs the controller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

clock = time.perf_counter


@dataclass
class ControllerPhases:
    """Totals of every phase; the engine's and the executor's code add to them in place."""

    num_results: int = 0
    """Micro-batch results applied."""
    num_tokens: int = 0
    """Tokens those results carried."""
    schedule_s: float = 0.0
    encode_s: float = 0.0
    send_s: float = 0.0
    receive_s: float = 0.0
    """Parsing worker messages (results and heartbeats) and keeping the heartbeats' records."""
    decode_s: float = 0.0
    apply_s: float = 0.0
    detokenize_s: float = 0.0
    stream_s: float = 0.0
    """Streaming less detokenizing: latency records, finishes, stream events."""
    round_trip_s: float = 0.0
    """Not a phase: each micro-batch's time from its plans sent to its result back, summed."""
    _sent_at: dict[int, float] = field(default_factory=dict, repr=False)

    def sent(self, batch_id: int, at: float) -> None:
        """A micro-batch's plans went out at `at` (a clock() reading)."""
        self._sent_at[batch_id] = at

    def returned(self, batch_id: int, at: float) -> None:
        """Its result came back at `at`; a result of a batch never sent (a rebuild) is ignored."""
        sent = self._sent_at.pop(batch_id, None)
        if sent is not None:
            self.round_trip_s += at - sent

    def forget_in_flight(self) -> None:
        """The pipeline went down: batches in flight will never return."""
        self._sent_at.clear()

    def totals(self) -> dict[str, int | float]:
        """Every total by its generate.proto ControllerPhases field name."""
        return {
            name: getattr(self, name)
            for name in self.__dataclass_fields__
            if not name.startswith("_")
        }
