"""Request traces users bring: CSV or JSONL, one request a row, lengths and optionally arrivals.

Column names vary between sources, so each field takes the first of a few known names:
- prompt tokens: num_prefill_tokens (Vidur's processed traces), prompt_tokens, input_tokens,
  ContextTokens (the Azure LLM inference trace);
- output tokens: num_decode_tokens, output_tokens, GeneratedTokens;
- arrival: arrived_at (seconds, Vidur), arrival_s, timestamp, TIMESTAMP (seconds as a number,
  or an ISO 8601 date and time as the Azure trace writes it).
A trace with arrival times can be replayed as recorded (`--arrival replay`); one without is a
bag of lengths that the benchmarks sample and give Poisson or gamma arrivals.
"""

from __future__ import annotations

import csv
import datetime
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT_COLUMNS = ("num_prefill_tokens", "prompt_tokens", "input_tokens", "ContextTokens")
OUTPUT_COLUMNS = ("num_decode_tokens", "output_tokens", "GeneratedTokens")
ARRIVAL_COLUMNS = ("arrived_at", "arrival_s", "timestamp", "TIMESTAMP")
JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class TraceRows:
    lengths: list[tuple[int, int]]
    """(prompt tokens, output tokens) per request, in file order."""
    arrivals_s: list[float] | None
    """Seconds from the first request, sorted like lengths; None: the trace has no arrivals."""


def _pick(names: Mapping[str, Any] | list[str], candidates: tuple[str, ...]) -> str | None:
    return next((c for c in candidates if c in names), None)


def _seconds(value: object) -> float:
    """A number of seconds, or an ISO 8601 date and time (fractions beyond microseconds cut)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        pass
    text = str(value).strip()
    head, dot, fraction = text.partition(".")
    if dot:  # the Azure trace writes 7 fractional digits; datetime takes at most 6
        digits = "".join(c for c in fraction if c.isdigit())
        text = f"{head}.{digits[:6]}{fraction[len(digits) :]}"
    moment = datetime.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in JSONL_SUFFIXES


def _records(path: Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(line number, record) from a CSV (header on line 1) or a JSONL file."""
    with open(path, newline="") as f:
        if _is_jsonl(path):
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}: line {line_no}: not JSON: {err.msg}") from None
                    if not isinstance(record, dict):
                        raise ValueError(f"{path}: line {line_no}: not a JSON object")
                    yield line_no, record
        else:
            yield from enumerate(csv.DictReader(f), start=2)


def read_trace_rows(path: Path) -> TraceRows:
    """Every request of a trace file; a missing field or a bad value names the line."""
    lengths: list[tuple[int, int]] = []
    arrivals: list[float] = []
    columns: tuple[str, str, str | None] | None = None
    for line_no, record in _records(path):
        if columns is None:
            prompt_col = _pick(record, PROMPT_COLUMNS)
            output_col = _pick(record, OUTPUT_COLUMNS)
            if prompt_col is None or output_col is None:
                missing = PROMPT_COLUMNS if prompt_col is None else OUTPUT_COLUMNS
                where = line_no if _is_jsonl(path) else 1  # a CSV's columns are its header's
                raise ValueError(f"{path}: line {where}: missing column(s) {' / '.join(missing)}")
            columns = (prompt_col, output_col, _pick(record, ARRIVAL_COLUMNS))
        prompt_col, output_col, arrival_col = columns
        try:
            prompt = int(float(record[prompt_col]))
            output = int(float(record[output_col]))
            if arrival_col is not None:
                arrivals.append(_seconds(record[arrival_col]))
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{path}: line {line_no}: {prompt_col}, {output_col}"
                f"{f' and {arrival_col}' if arrival_col else ''} must be numbers"
                f"{' (or an ISO date and time)' if arrival_col else ''}"
            ) from None
        if prompt < 1 or output < 1:
            raise ValueError(
                f"{path}: line {line_no}: lengths must be >= 1, got prompt {prompt}, "
                f"output {output}"
            )
        lengths.append((prompt, output))
    if not lengths:
        raise ValueError(f"{path}: no requests")
    if columns is None or columns[2] is None:
        return TraceRows(lengths, None)
    order = sorted(range(len(lengths)), key=arrivals.__getitem__)
    first = arrivals[order[0]]
    return TraceRows([lengths[i] for i in order], [arrivals[i] - first for i in order])


def has_arrivals(path: Path) -> bool:
    """Whether the trace's first record carries an arrival time (cheap: reads one record)."""
    for _, record in _records(path):
        return _pick(record, ARRIVAL_COLUMNS) is not None
    return False
