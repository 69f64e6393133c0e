"""`python -m stage_worker.comm_bench --tp 2 --tokens 512 --hidden 4096`: the stage-to-stage
hand-off of one micro-batch's activations, sent whole by every TP rank or as 1/TP slices that
the next stage all-gathers. Two stages of TP ranks run as local processes over gloo, so this
measures the protocol's cost and the bytes each link carries, not a real network."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from collections.abc import Sequence

import torch
import torch.multiprocessing as mp

from stage_worker.comm import PipelineLinks, destroy_distributed, init_distributed
from stage_worker.config import ShardSpec
from stage_worker.models import DTYPES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, args: argparse.Namespace, init: str) -> None:
    torch.set_num_threads(1)
    shard = ShardSpec(pp=2, tp=args.tp, stage=rank // args.tp, tp_rank=rank % args.tp)
    tp_group = init_distributed(shard, init, "cpu", "gloo")
    dtype = DTYPES[args.dtype]
    out: dict[str, float | int] = {"tp": args.tp, "tokens": args.tokens, "hidden": args.hidden}
    for mode in ("whole", "slices"):
        links = PipelineLinks(shard, tp_group, send_slices=mode == "slices")
        hidden = torch.randn(args.tokens, args.hidden).to(dtype)
        samples = []
        for i in range(args.repeats + 2):
            torch.distributed.barrier()
            start = time.perf_counter()
            if shard.stage == 0:
                links.send(hidden)
                links.wait_sends()
            else:
                received = links.recv(args.tokens, args.hidden, dtype, "cpu")
                assert received.shape == hidden.shape
            torch.distributed.barrier()
            if i >= 2:
                samples.append((time.perf_counter() - start) * 1e3)
        out[f"{mode}_ms"] = statistics.median(samples)
    whole_bytes = hidden.numel() * hidden.element_size()
    out |= {"link_bytes_whole": whole_bytes, "link_bytes_slices": whole_bytes // args.tp}
    if rank == 0:  # the sender of TP rank 0 speaks for the run
        print(json.dumps(out), flush=True)
    destroy_distributed()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stage_worker.comm_bench", description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(_rank_main, args=(args, init), nprocs=2 * args.tp, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
