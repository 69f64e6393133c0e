"""`sarathictl generate "prompt"`: streams one answer from a running cluster."""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from sarathi_proto import generate_pb2

from sarathictl.argtypes import float_above, float_at_least, float_in, int_in_range
from sarathictl.client import (
    FINISH_NAMES,
    RetryPolicy,
    add_connection_flags,
    client_from_args,
    explain_rpc_error,
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running cluster")
    p.add_argument("prompt", help="the prompt text")
    add_connection_flags(p)
    # The bounds of the wire fields (generate.proto): max_tokens uint32, top_k int32, seed uint64.
    p.add_argument(
        "--max-tokens", type=int_in_range(1, 2**32 - 1), default=128, help="most tokens to generate"
    )
    p.add_argument("--temperature", type=float_at_least(0.0), default=0.0, help="0 = greedy")
    p.add_argument(
        "--top-p", type=float_in(0.0, 1.0, lo_open=True), default=1.0, help="nucleus mass in (0, 1]"
    )
    p.add_argument("--top-k", type=int_in_range(0, 2**31 - 1), default=0, help="0 disables top-k")
    p.add_argument("--seed", type=int_in_range(0, 2**64 - 1), default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    p.add_argument("--timeout", type=float_above(0.0), default=None, help="deadline in seconds")
    p.add_argument(
        "--retries",
        type=int_in_range(0, 100),
        default=RetryPolicy.max_retries,
        help="when the stream is cut (UNAVAILABLE: the controller restarting or failing over), "
        "resume it this many times in a row, backing off from 0.25 s to 4 s (0: never; "
        f"default {RetryPolicy.max_retries})",
    )
    p.add_argument("--json", action="store_true", help="one JSON object at the end")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    sampling = generate_pb2.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    if args.seed is not None:
        sampling.seed = args.seed
    request = generate_pb2.GenerateRequest(
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        apply_chat_template=args.chat,
    )
    text, token_ids = [], []
    first = last = None

    def on_retry(retry: int, received: int, err: grpc.RpcError) -> None:
        print(
            f"\nsarathictl: stream cut ({err.code().name}: {err.details()}); resuming after "
            f"{received} tokens (retry {retry} of {args.retries})",
            file=sys.stderr,
        )

    policy = RetryPolicy(max_retries=args.retries)
    with client_from_args(args) as client:
        try:
            for response in client.generate_resumable(request, args.timeout, policy, on_retry):
                text.append(response.text)
                token_ids.extend(response.token_ids)
                first = first or response
                if not args.json:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                last = response
        except grpc.RpcError as err:
            print(f"\nsarathictl: {explain_rpc_error(err, args.addr)}", file=sys.stderr)
            return 1
    assert first is not None and last is not None
    reason = FINISH_NAMES.get(last.finish_reason, "unknown")
    if args.json:
        print(
            json.dumps(
                {
                    "request_id": last.request_id,
                    "text": "".join(text),
                    "token_ids": token_ids,
                    "finish_reason": reason,
                    "seed": first.seed,  # the request's, or the one the server drew
                    "ttft_s": last.ttft_s,
                    "mean_tbt_s": last.mean_tbt_s,
                    "num_prompt_tokens": last.num_prompt_tokens,
                    "num_output_tokens": last.num_output_tokens,
                }
            )
        )
    else:
        print(
            f"\n[{reason}: {last.num_output_tokens} tokens, TTFT {last.ttft_s * 1e3:.0f} ms, "
            f"mean TBT {last.mean_tbt_s * 1e3:.1f} ms]",
            file=sys.stderr,
        )
    return 0
