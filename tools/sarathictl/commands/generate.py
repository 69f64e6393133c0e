"""`sarathictl generate "prompt"`: streams an answer (or n of them) from a running cluster."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

import grpc
from sarathi_proto import generate_pb2

from controller.scheduler.request_bounds import MAX_N, MAX_TEMPERATURE
from sarathictl.argtypes import float_above, float_in, int_in_range
from sarathictl.client import (
    FINISH_NAMES,
    Client,
    RetryPolicy,
    add_connection_flags,
    client_from_args,
    explain_rpc_error,
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running cluster")
    p.add_argument("prompt", help="the prompt text")
    add_connection_flags(p)
    _add_sampling_flags(p)
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
        f"default {RetryPolicy.max_retries}; with --n above 1 a cut stream is an error)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object at the end")
    p.set_defaults(run=run)


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    # The bounds of the wire fields (generate.proto): max_tokens uint32, top_k int32, seed uint64.
    p.add_argument(
        "--max-tokens", type=int_in_range(1, 2**32 - 1), default=128, help="most tokens to generate"
    )
    p.add_argument(
        "--temperature",
        type=float_in(0.0, MAX_TEMPERATURE),
        default=0.0,
        help=f"in [0, {MAX_TEMPERATURE:g}]; 0 = greedy",
    )
    p.add_argument(
        "--top-p", type=float_in(0.0, 1.0, lo_open=True), default=1.0, help="nucleus mass in (0, 1]"
    )
    p.add_argument("--top-k", type=int_in_range(0, 2**31 - 1), default=0, help="0 disables top-k")
    p.add_argument("--seed", type=int_in_range(0, 2**64 - 1), default=None, help="sampling seed")
    p.add_argument(
        "--n",
        type=int_in_range(1, MAX_N),
        default=1,
        help="answers to sample for the prompt, which is computed once for all of them; choice i "
        "samples with the seed plus i. Above 1 each answer is printed whole when it ends "
        "(default 1: streamed as it comes)",
    )


def build_request(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    sampling = generate_pb2.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    if args.seed is not None:
        sampling.seed = args.seed
    return generate_pb2.GenerateRequest(
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        apply_chat_template=args.chat,
        n=args.n,
    )


class Choice:
    """One answer as it streams in: its text, token ids, and first and last messages."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.first: generate_pb2.GenerateResponse | None = None
        self.last: generate_pb2.GenerateResponse | None = None

    def add(self, response: generate_pb2.GenerateResponse) -> None:
        self.text.append(response.text)
        self.token_ids.extend(response.token_ids)
        self.first = self.first or response
        self.last = response

    @property
    def finish_reason(self) -> str:
        assert self.last is not None
        return FINISH_NAMES.get(self.last.finish_reason, "unknown")

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason in FINISH_NAMES

    def as_json(self) -> dict[str, Any]:
        assert self.first is not None and self.last is not None
        return {
            "text": "".join(self.text),
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "seed": self.first.seed,  # the request's, or the one the server drew, plus the index
            "ttft_s": self.last.ttft_s,
            "mean_tbt_s": self.last.mean_tbt_s,
            "num_output_tokens": self.last.num_output_tokens,
        }


def run(args: argparse.Namespace) -> int:
    request = build_request(args)
    choices = [Choice() for _ in range(args.n)]
    with client_from_args(args) as client:
        try:
            for response in _responses(client, request, args):
                choice = choices[response.index]
                choice.add(response)
                _show_progress(args, choice, response)
        except grpc.RpcError as err:
            streamed = any(choice.token_ids for choice in choices)  # end its line first
            said = f"sarathictl: {explain_rpc_error(err, args.addr)}"
            print(f"\n{said}" if streamed else said, file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(_summary_json(choices)))
    else:
        _print_summary(choices)
    return 0


def _responses(
    client: Client, request: generate_pb2.GenerateRequest, args: argparse.Namespace
) -> Iterator[generate_pb2.GenerateResponse]:
    """The stream; one answer resumes when cut, as the server resumes one choice alone."""
    if args.n > 1:
        return client.generate(request, args.timeout)

    def on_retry(retry: int, limit: int, received: int, err: grpc.RpcError) -> None:
        why = f"{err.code().name}: {err.details()}"
        if received:
            said = f"\nsarathictl: stream cut ({why}); resuming after {received} tokens"
        else:
            said = f"sarathictl: no answer yet ({why}); trying again"
        print(f"{said} (retry {retry} of {limit})", file=sys.stderr)

    policy = RetryPolicy(max_retries=args.retries)
    return client.generate_resumable(request, args.timeout, policy, on_retry)


def _show_progress(
    args: argparse.Namespace, choice: Choice, response: generate_pb2.GenerateResponse
) -> None:
    """One answer streams as it comes; of several, each is printed whole when it ends, so their
    texts do not interleave."""
    if args.json:
        return
    if args.n == 1:
        sys.stdout.write(response.text)
    elif choice.finished:
        sys.stdout.write(f"--- choice {response.index} ---\n{''.join(choice.text)}\n")
    sys.stdout.flush()


def _summary_json(choices: list[Choice]) -> dict[str, Any]:
    """n = 1: the answer's fields at the top level (as before --n); above 1: a `choices` list."""
    last = choices[0].last
    assert last is not None
    request = {"request_id": last.request_id, "num_prompt_tokens": last.num_prompt_tokens}
    if len(choices) == 1:
        return {**request, **choices[0].as_json()}
    return {**request, "choices": [choice.as_json() for choice in choices]}


def _print_summary(choices: list[Choice]) -> None:
    for index, choice in enumerate(choices):
        last = choice.last
        assert last is not None
        label = "" if len(choices) == 1 else f"choice {index}: "
        print(
            f"\n[{label}{choice.finish_reason}: {last.num_output_tokens} tokens, "
            f"TTFT {last.ttft_s * 1e3:.0f} ms, mean TBT {last.mean_tbt_s * 1e3:.1f} ms]",
            file=sys.stderr,
        )
