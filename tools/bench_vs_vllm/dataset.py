"""The conversation trace, and multi-turn chats, as datasets `vllm bench serve` reads: its
`timed_trace` JSONL.

Each line is one request: `input_length` prompt tokens, `output_length` tokens to generate, and
`hash_ids`, one id per `chunk` prompt tokens, from which vLLM's client draws the prompt's token
ids. Every request gets ids of its own, so no two prompts share a prefix (vLLM caches prefixes;
ours does not: shared prefixes would favour it). The `timestamp` is the trace's own arrival, kept
for reference only: the driver passes `--no-self-timed`, so the client draws Poisson arrivals at
the rate asked, as for the random workload.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
CHUNK_TOKENS = 16  # vLLM's default --timed-trace-chunk-hash-size


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def read_trace(path: Path) -> list[TraceRequest]:
    """The rows of a trace CSV (num_prefill_tokens, num_decode_tokens, optional arrived_at)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
        rows = [
            TraceRequest(
                float(row.get("arrived_at") or 0.0),
                int(float(row["num_prefill_tokens"])),
                int(float(row["num_decode_tokens"])),
            )
            for row in reader
        ]
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def scale_lengths(rows: list[TraceRequest], scale: float, max_model_len: int) -> list[TraceRequest]:
    """Both lengths times `scale` (at least one token each); a request still longer than the
    model's context keeps its output and loses prompt tokens until it fits."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    scaled = []
    for r in rows:
        prompt = max(1, round(r.prompt_tokens * scale))
        output = max(1, round(r.output_tokens * scale))
        if prompt + output > max_model_len:
            output = min(output, max_model_len - 1)
            prompt = max_model_len - output
        scaled.append(TraceRequest(r.arrival_s, prompt, output))
    return scaled


def sample(rows: list[TraceRequest], num_requests: int, seed: int) -> list[TraceRequest]:
    """num_requests rows drawn without replacement (all of them, shuffled, if fewer), with
    their arrival times made relative to the first drawn."""
    picked = random.Random(seed).sample(rows, min(num_requests, len(rows)))
    start = min(r.arrival_s for r in picked)
    return [TraceRequest(r.arrival_s - start, r.prompt_tokens, r.output_tokens) for r in picked]


def timed_trace_lines(rows: list[TraceRequest], chunk: int = CHUNK_TOKENS) -> list[str]:
    """One JSON line per request in vLLM's timed_trace format; hash ids never repeat."""
    lines = []
    next_id = 0
    for r in rows:
        num_ids = math.ceil(r.prompt_tokens / chunk)
        entry = {
            "timestamp": round(r.arrival_s, 6),
            "input_length": r.prompt_tokens,
            "output_length": r.output_tokens,
            "hash_ids": list(range(next_id, next_id + num_ids)),
        }
        next_id += num_ids
        lines.append(json.dumps(entry))
    return lines


def write_trace_dataset(
    trace: Path, out: Path, scale: float, max_model_len: int, num_requests: int, seed: int
) -> list[TraceRequest]:
    """Writes the JSONL for `vllm bench serve --dataset-name timed_trace`; returns its rows."""
    rows = sample(scale_lengths(read_trace(trace), scale, max_model_len), num_requests, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(timed_trace_lines(rows)) + "\n")
    return rows


@dataclass(frozen=True)
class MultiTurn:
    """Chats whose every turn resends the history: the first turn `first_tokens` (a system prompt
    and a question), then each turn the previous prompt, its answer (`output_tokens`, the length
    asked of the model) and a new question (`question_tokens`). Lengths are whole chunks, so a
    turn's prompt starts with exactly the previous turn's hash ids."""

    conversations: int = 4
    turns: int = 4
    first_tokens: int = 256
    question_tokens: int = 64
    output_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("first_tokens", "question_tokens", "output_tokens"):
            if getattr(self, name) % CHUNK_TOKENS or getattr(self, name) < CHUNK_TOKENS:
                raise ValueError(f"{name}={getattr(self, name)}: a multiple of {CHUNK_TOKENS}")

    @property
    def name(self) -> str:
        return f"multiturn-{self.conversations}x{self.turns}"


def multi_turn_lines(chats: MultiTurn) -> list[str]:
    """The turns in the order they are sent: every chat's first turn, then every chat's second,
    and so on, so that a chat's next turn comes a few requests after its last (a user reading
    the answer). No chat shares an id with another."""
    next_id = 0

    def fresh(tokens: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + tokens // CHUNK_TOKENS))
        next_id += len(ids)
        return ids

    history = [fresh(chats.first_tokens) for _ in range(chats.conversations)]
    lines = []
    for turn in range(chats.turns):
        for chat in range(chats.conversations):
            if turn:
                history[chat] = history[chat] + fresh(chats.output_tokens)
                history[chat] = history[chat] + fresh(chats.question_tokens)
            entry = {
                "timestamp": 0.0,
                "input_length": len(history[chat]) * CHUNK_TOKENS,
                "output_length": chats.output_tokens,
                "hash_ids": history[chat],
            }
            lines.append(json.dumps(entry))
    return lines


def write_multi_turn_dataset(chats: MultiTurn, out: Path) -> int:
    """Writes the JSONL; returns the number of requests."""
    lines = multi_turn_lines(chats)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return len(lines)
