"""Log-probabilities from the last stage to the client: the StepResult's packed columns, and the
engine handing each token's entry to its stream event."""

from __future__ import annotations

import asyncio

from sarathi_proto import stage_pb2

from controller.engine import StreamEvent
from controller.logprobs import TokenLogprobs, decode_logprobs
from controller.scheduler import MicroBatch
from stage_worker.sampler import TokenLogprobs as WorkerLogprobs
from stage_worker.worker import pack_logprobs
from tests.unit.test_engine import FakePipeline, collect, make_engine, request


def test_packed_columns_round_trip_rows_with_and_without_alternatives() -> None:
    result = stage_pb2.StepResult(batch_id=1, seq_ids=[10, 11, 12, 13], token_ids=[1, 2, 3, 4])
    pack_logprobs(
        result,
        [
            WorkerLogprobs(-0.5, [1, 7, 9], [-0.5, -1.0, -2.0]),
            None,  # did not ask
            WorkerLogprobs(-3.0, [], []),  # asked for the token's own only
            WorkerLogprobs(-0.25, [4], [-0.25]),
        ],
    )
    decoded = decode_logprobs(stage_pb2.StepResult.FromString(result.SerializeToString()))
    assert decoded == {
        10: TokenLogprobs(-0.5, (1, 7, 9), (-0.5, -1.0, -2.0)),
        12: TokenLogprobs(-3.0, (), ()),
        13: TokenLogprobs(-0.25, (4,), (-0.25,)),
    }


class LogprobPipeline(FakePipeline):
    """FakePipeline whose tokens come with a log-probability of -token/100."""

    async def submit(self, batch: MicroBatch) -> None:
        self.batches.append(batch)
        sampled = {c.seq_id: c.context_len for c in batch.chunks if c.yields_token}
        logprobs = {s: TokenLogprobs(-t / 100, (t,), (-t / 100,)) for s, t in sampled.items()}
        loop = asyncio.get_running_loop()
        loop.call_later(0.001, self._complete_with, batch.batch_id, sampled, logprobs)

    def _complete_with(
        self, batch_id: int, sampled: dict[int, int], logprobs: dict[int, TokenLogprobs]
    ) -> None:
        assert self.engine is not None
        self.engine.on_result(batch_id, sampled, logprobs)


def test_each_event_carries_its_own_tokens_log_probabilities() -> None:
    async def main() -> list[StreamEvent]:
        engine, _ = make_engine()
        pipeline = LogprobPipeline()
        pipeline.engine = engine
        engine.pipeline = pipeline
        loop_task = asyncio.create_task(engine.run())
        events = await collect(engine.add(request("r", prompt_len=5, max_tokens=4)).events)
        loop_task.cancel()
        return events

    events = asyncio.run(main())
    assert [e.token_ids for e in events] == [[5], [6], [7], [8]]
    assert [e.logprobs.logprob if e.logprobs else None for e in events] == [
        -0.05, -0.06, -0.07, -0.08,
    ]  # fmt: skip
    assert events[-1].logprobs == TokenLogprobs(-0.08, (8,), (-0.08,))  # the finishing one too
