"""`python -m stage_worker`, except that a step whose plan holds the token POISON_TOKEN raises,
as a worker bug that one request's input triggers would: the test of the quarantine
(controller/scheduler/quarantine.py). A test fault: nothing else of the worker changes."""

from __future__ import annotations

import os

from sarathi_proto import stage_pb2

from stage_worker import runner
from stage_worker.__main__ import main

POISON_TOKEN = int(os.environ["SARATHI_TEST_POISON_TOKEN"])
_prepare = runner.StageRunner.prepare


def prepare_or_fail(self: runner.StageRunner, plan: stage_pb2.StepPlan) -> runner.PreparedStep:
    for seq in plan.seqs:
        if POISON_TOKEN in seq.token_ids:
            raise RuntimeError(f"token {POISON_TOKEN} is poison (a planted test fault)")
    return _prepare(self, plan)


runner.StageRunner.prepare = prepare_or_fail  # type: ignore[method-assign]

if __name__ == "__main__":
    raise SystemExit(main())
