"""`python -m controller`, except that one plan is one the stage workers reject: the first
micro-batch from REJECTED_BATCH_ID on gets a chunk for a sequence no worker knows, so every
worker raises PlanError, leaves its state as it was, and each stage's TP rank 0 answers with a
StepResult that says `rejected` (stage_worker/worker.py). A test fault: nothing else of the
controller changes."""

from __future__ import annotations

import os

from sarathi_proto import stage_pb2

from controller import __main__ as controller_main
from controller.executor import pipeline
from controller.scheduler import MicroBatch

REJECTED_BATCH_ID = int(os.environ.get("SARATHI_TEST_REJECTED_BATCH_ID", "6"))
UNKNOWN_SEQ_ID = 2**40
_sent_rejected = False


def _with_unknown_sequence(message_bytes: bytes) -> bytes:
    message = stage_pb2.ControllerMessage()
    message.ParseFromString(message_bytes)
    message.plan.seqs.add(seq_id=UNKNOWN_SEQ_ID, first_position=3, num_tokens=1)
    return message.SerializeToString()


def encode_one_rejected(batch: MicroBatch) -> tuple[bytes, bytes]:
    global _sent_rejected
    first, rest = _encode(batch)
    if _sent_rejected or batch.batch_id < REJECTED_BATCH_ID:
        return first, rest
    _sent_rejected = True
    return _with_unknown_sequence(first), _with_unknown_sequence(rest)


_encode = pipeline.encode_plan_messages
pipeline.encode_plan_messages = encode_one_rejected

if __name__ == "__main__":
    raise SystemExit(controller_main.main())
