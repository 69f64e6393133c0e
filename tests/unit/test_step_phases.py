"""The step phases' totals: the controller's (engine and executor) and the workers' as Status
relays them."""

from __future__ import annotations

import asyncio

from sarathi_proto import generate_pb2, stage_pb2

from controller.stage_report import public_phases
from controller.step_phases import ControllerPhases
from tests.unit.test_engine import collect, make_engine, request


def _fields(message: type) -> list[tuple[str, int, int]]:
    return [(f.name, f.number, f.type) for f in message.DESCRIPTOR.fields]  # type: ignore[attr-defined]


def test_the_public_stage_phases_mirror_the_heartbeats_field_for_field() -> None:
    assert _fields(generate_pb2.StagePhases) == _fields(stage_pb2.StepPhases)
    worker = stage_pb2.StepPhases(num_steps=3, num_tokens=96, step_s=0.3, linear_s=0.2)
    relayed = public_phases(worker)
    assert relayed.num_steps == 3 and relayed.num_tokens == 96
    assert relayed.step_s == 0.3 and relayed.linear_s == 0.2
    assert public_phases(None) == generate_pb2.StagePhases()  # a worker that sent none yet


def test_controller_totals_name_every_field_of_the_status_message() -> None:
    names = {f.name for f in generate_pb2.ControllerPhases.DESCRIPTOR.fields}
    assert set(ControllerPhases().totals()) == names


def test_round_trips_count_batches_that_return_and_forget_lost_ones() -> None:
    phases = ControllerPhases()
    phases.sent(1, at=10.0)
    phases.sent(2, at=10.5)
    phases.returned(1, at=10.25)
    phases.returned(7, at=11.0)  # never sent here (from before a rebuild): ignored
    phases.forget_in_flight()  # batch 2 was lost with the pipeline
    phases.returned(2, at=12.0)
    assert phases.round_trip_s == 0.25


def test_the_engine_times_schedule_apply_detokenize_and_stream() -> None:
    async def main() -> ControllerPhases:
        engine, _ = make_engine()
        loop_task = asyncio.create_task(engine.run())
        handles = [engine.add(request(f"r{i}", prompt_len=5, max_tokens=4)) for i in range(3)]
        for handle in handles:
            await collect(handle.events)
        loop_task.cancel()
        return engine.phases

    phases = asyncio.run(main())
    assert phases.num_tokens == 12  # 3 requests of 4 tokens
    assert phases.num_results >= 4  # the fake pipeline runs one micro-batch at a time
    for name in ("schedule_s", "apply_s", "detokenize_s", "stream_s"):
        assert getattr(phases, name) > 0, name
    # The executor's phases: no executor here.
    assert phases.encode_s == phases.send_s == phases.receive_s == phases.round_trip_s == 0
