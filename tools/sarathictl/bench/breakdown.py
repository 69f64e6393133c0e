"""Where a step's time goes, from two Status readings: the phase totals' differences per step.

Status carries totals since start (generate.proto ControllerPhases, and StagePhases per stage);
a scenario's breakdown is (after - before) / (steps after - steps before), in milliseconds per
micro-batch. Pure arithmetic and the rows' names: the command (step_breakdown.py) takes the
readings and prints what this returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_proto import generate_pb2

# (field of generate.proto ControllerPhases, row label): the phases of `bench controller-step`.
CONTROLLER_PHASES = (
    ("schedule_s", "schedule"),
    ("encode_s", "encode plans"),
    ("send_s", "send plans"),
    ("receive_s", "receive (parse worker messages)"),
    ("decode_s", "decode results"),
    ("apply_s", "apply results"),
    ("detokenize_s", "detokenize"),
    ("stream_s", "stream (events, latency records)"),
)
# (field of generate.proto StagePhases, row label), in the order a step runs them.
STAGE_PHASES = (
    ("prepare_s", "prepare plan"),
    ("recv_wait_s", "wait for activations"),
    ("linear_s", "linear layers"),
    ("attention_s", "attention"),
    ("forward_other_s", "rest of forward (embed, norms, rotary, all-reduce)"),
    ("logits_s", "logits (LM head)"),
    ("sample_s", "sampling"),
    ("send_s", "send activations / tokens"),
)


@dataclass(frozen=True)
class Totals:
    """One Status reading's totals: the controller's wall clock and phases, each stage's."""

    uptime_s: float
    controller: dict[str, float]
    """generate.proto ControllerPhases fields."""
    stages: list[dict[str, float]]
    """generate.proto StagePhases fields, per stage."""


def totals_of(status: generate_pb2.StatusResponse) -> Totals:
    return Totals(
        status.uptime_s,
        _fields(status.controller_phases),
        [_fields(stage.phases) for stage in status.stages],
    )


def _fields(message: generate_pb2.ControllerPhases | generate_pb2.StagePhases) -> dict[str, float]:
    return {f.name: float(getattr(message, f.name)) for f in message.DESCRIPTOR.fields}


@dataclass(frozen=True)
class StageBreakdown:
    steps: int
    tokens_per_step: float
    phases_ms: dict[str, float]
    """Per step, by StagePhases field: every phase of STAGE_PHASES."""
    step_ms: float
    """The whole step: plan off the socket -> output sent."""
    wall_ms: float
    """Wall time per step (the controller's clock over the stage's steps)."""

    @property
    def unaccounted_ms(self) -> float:
        """The step less its phases: the statements between the worker's laps (about 0)."""
        return self.step_ms - sum(self.phases_ms.values())

    @property
    def idle_ms(self) -> float:
        """Wall time between steps: waiting for the next plan, and the heartbeat. Never below 0:
        the stage's totals come with its heartbeats, so its window may hold part of a step more
        than the controller's wall-clock window (seen: -0.26 ms a step on a busy stage)."""
        return max(0.0, self.wall_ms - self.step_ms)


@dataclass(frozen=True)
class ControllerBreakdown:
    steps: int
    tokens_per_step: float
    """Sampled tokens per micro-batch result."""
    phases_ms: dict[str, float]
    """Per step, by ControllerPhases field: every phase of CONTROLLER_PHASES."""
    wall_ms: float
    """The controller's wall time per step."""
    round_trip_ms: float
    """A micro-batch's plans out -> its result in (overlaps the stages' time)."""

    @property
    def other_ms(self) -> float:
        """Wall time beyond the phases: the APIs, the event loop, waiting for results."""
        return self.wall_ms - sum(self.phases_ms.values())


def _per_step(before: dict[str, float], after: dict[str, float], steps: int, name: str) -> float:
    return 1e3 * (after[name] - before[name]) / steps


def controller_breakdown(before: Totals, after: Totals) -> ControllerBreakdown:
    """Raises ValueError when no result came back between the readings (or the controller
    restarted: its totals went down)."""
    b, a = before.controller, after.controller
    steps = int(a["num_results"] - b["num_results"])
    if steps <= 0:
        raise ValueError(f"controller: {steps} micro-batch results between the readings")
    return ControllerBreakdown(
        steps,
        (a["num_tokens"] - b["num_tokens"]) / steps,
        {name: _per_step(b, a, steps, name) for name, _ in CONTROLLER_PHASES},
        1e3 * (after.uptime_s - before.uptime_s) / steps,
        _per_step(b, a, steps, "round_trip_s"),
    )


def stage_breakdowns(before: Totals, after: Totals) -> list[StageBreakdown]:
    """Raises ValueError naming the stage that ran no step between the readings."""
    if len(before.stages) != len(after.stages):
        raise ValueError(f"stages: {len(before.stages)} before, {len(after.stages)} after")
    out = []
    wall_s = after.uptime_s - before.uptime_s
    for index, (b, a) in enumerate(zip(before.stages, after.stages, strict=True)):
        steps = int(a["num_steps"] - b["num_steps"])
        if steps <= 0:
            raise ValueError(f"stage {index}: {steps} steps between the readings")
        out.append(
            StageBreakdown(
                steps,
                (a["num_tokens"] - b["num_tokens"]) / steps,
                {name: _per_step(b, a, steps, name) for name, _ in STAGE_PHASES},
                _per_step(b, a, steps, "step_s"),
                1e3 * wall_s / steps,
            )
        )
    return out


@dataclass(frozen=True)
class ScenarioBreakdown:
    """One scenario's steps between its two readings, and what a client saw meanwhile."""

    label: str
    decodes: int
    """Sequences decoding throughout."""
    controller: ControllerBreakdown
    stages: list[StageBreakdown]
    client_tpot_ms: float
    """Median over the decoding requests of their mean gap between tokens in the window."""


def scenario_breakdown(
    label: str, decodes: int, before: Totals, after: Totals, client_tpot_ms: float
) -> ScenarioBreakdown:
    """Raises ValueError, naming the scenario, when a reading pair holds no step."""
    try:
        controller = controller_breakdown(before, after)
        stages = stage_breakdowns(before, after)
    except ValueError as err:
        raise ValueError(f"scenario {label}: {err}") from None
    return ScenarioBreakdown(label, decodes, controller, stages, client_tpot_ms)
