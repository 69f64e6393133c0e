"""`python -m stage_worker --controller tcp://HOST:PORT --model DIR ...`: one stage worker."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from stage_worker.errors import CheckpointError
from stage_worker.worker import StageWorker, WorkerConfig, install_log_tag


def parse_args(argv: Sequence[str] | None) -> WorkerConfig:
    p = argparse.ArgumentParser(prog="python -m stage_worker", description=__doc__)
    p.add_argument("--controller", required=True, help="controller ROUTER address, tcp://HOST:PORT")
    p.add_argument("--model", required=True, help="folder with config.json and *.safetensors")
    p.add_argument("--stage", type=int, default=-1, help="requested stage (-1: assigned)")
    p.add_argument("--tp-rank", type=int, default=-1, help="requested TP rank (-1: assigned)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="CPU KV-cache budget")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block for the report")
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--attention", default="torch", choices=["torch", "flashinfer"])
    p.add_argument(
        "--send-slices",
        action="store_true",
        help="send 1/TP of the activations per rank; the next stage all-gathers",
    )
    a = p.parse_args(argv)
    return WorkerConfig(
        controller=a.controller,
        model_dir=a.model,
        stage=a.stage,
        tp_rank=a.tp_rank,
        device=a.device,
        dtype=a.dtype,
        kv_cache_bytes=a.kv_cache_bytes,
        block_size_hint=a.block_size,
        num_threads=a.num_threads,
        attention=a.attention,
        send_slices=a.send_slices,
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(worker)s %(name)s: %(message)s"
    )
    install_log_tag()
    try:
        config = parse_args(argv)
        return StageWorker(config).run()
    except CheckpointError as err:
        print(f"stage_worker: bad checkpoint: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"stage_worker: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
