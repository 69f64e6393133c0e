"""`python -m stage_worker`, except that loading its weights takes SARATHI_TEST_LOAD_S seconds
more, as a real model's would: a window in which to kill a worker that has said hello and
holds its place, mid-rebuild (test_rebuild_worker_lost.py). Nothing else of the worker changes."""

from __future__ import annotations

import os
import time
from typing import Any

from stage_worker import worker
from stage_worker.__main__ import main

LOAD_S = float(os.environ["SARATHI_TEST_LOAD_S"])
_load = worker.StageWorker._load


def slow_load(self: worker.StageWorker, *args: Any) -> Any:
    time.sleep(LOAD_S)
    return _load(self, *args)


worker.StageWorker._load = slow_load  # type: ignore[method-assign]

if __name__ == "__main__":
    raise SystemExit(main())
