"""The paper's TBT SLO rule (section 5), which every command that derives an SLO goes by: a
multiple of the time of one decode step of a batch of SLO_BATCH sequences on the hardware at
hand, so that a target accounts for what the model and the machine can do at all."""

from __future__ import annotations

SLO_BATCH = 32
"""The decode batch whose step is the SLO's unit (the paper: 32 sequences of 4k context)."""

SLO_FACTORS = {"strict": 5.0, "relaxed": 25.0}
"""The multiples of that step the strict and relaxed SLOs allow a P99 time between tokens."""
