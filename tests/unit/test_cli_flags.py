"""Every numeric or enumerated flag of sarathictl (all sub-commands, nested ones included),
`python -m controller` and `python -m stage_worker` refuses a bad value at parse time, naming
the flag, the value and what is allowed (argparse's form, exit code 2).

The walk finds the flags itself, so a flag added later is checked too: a plain `type=int` or
`type=float` (no bounds) fails here unless ALLOWED_UNBOUNDED lists it with a reason.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from sarathictl import argtypes
from sarathictl.cli import build_parser, main

# (program and sub-commands, option) -> why any value of its type is fine. Empty today: every
# seed is bounded too (numpy's generators refuse negative seeds; the wire's seed is a uint64).
ALLOWED_UNBOUNDED: dict[tuple[str, str], str] = {}

# Types that hold no number and no name from a fixed set: nothing to bound.
FREE_TEXT_TYPES = (None, str, Path)


def parsers() -> dict[str, argparse.ArgumentParser]:
    return {
        "sarathictl": build_parser(),
        "python -m controller": importlib.import_module("controller.__main__").build_parser(),
        "python -m stage_worker": importlib.import_module("stage_worker.__main__").build_parser(),
    }


def walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], argparse.Action]]:
    """(the words that reach the parser, an action of it), through every level of sub-commands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def all_actions() -> list[tuple[str, tuple[str, ...], argparse.Action]]:
    return [(prog, path, a) for prog, p in parsers().items() for path, a in walk(p, ())]


ACTIONS = all_actions()


def flag_name(action: argparse.Action) -> str:
    return max(action.option_strings, key=len) if action.option_strings else action.dest


def bad_inputs(action: argparse.Action) -> list[str]:
    if action.choices is not None:
        return ["no-such-choice"]
    return list(getattr(action.type, "bad_values", ()))


def checked(action: argparse.Action) -> bool:
    return action.choices is not None or hasattr(action.type, "bad_values")


def parse_error(
    prog: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> tuple[object, str]:
    with pytest.raises(SystemExit) as exited:
        parsers_by_prog[prog].parse_args(argv)
    return exited.value.code, capsys.readouterr().err


parsers_by_prog = parsers()
CASES = [
    pytest.param(prog, path, action, bad, id=f"{prog} {' '.join(path)} {flag_name(action)}={bad}")
    for prog, path, action in ACTIONS
    if checked(action)
    for bad in bad_inputs(action)
]


def test_the_walk_reaches_every_program_and_nested_sub_commands() -> None:
    seen = {(prog, path, flag_name(a)) for prog, path, a in ACTIONS}
    for expected in [
        ("sarathictl", ("generate",), "--max-tokens"),
        ("sarathictl", ("bench", "capacity"), "--granularity"),
        ("sarathictl", ("bench", "stage"), "--decode-batches"),
        ("sarathictl", ("model", "random-falcon"), "--vocab-size"),
        ("sarathictl", ("tune-budget",), "--tbt-slo"),
        ("python -m controller", (), "--heartbeat-timeout"),
        ("python -m stage_worker", (), "--controller-timeout"),
    ]:
        assert expected in seen
    assert len(CASES) > 150


@pytest.mark.parametrize(("prog", "path", "action", "bad"), CASES)
def test_a_bad_value_fails_at_parse_time_naming_flag_value_and_rule(
    prog: str,
    path: tuple[str, ...],
    action: argparse.Action,
    bad: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    flag = flag_name(action)
    argv = [*path, flag, bad] if action.option_strings else [*path, bad]
    code, err = parse_error(prog, argv, capsys)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert f"argument {flag}" in line or f"argument {action.metavar}" in line
    assert bad in line
    if action.choices is not None:
        assert "invalid choice" in line and all(str(c) in line for c in action.choices)
    else:
        assert "must be" in line or "known:" in line


def test_no_numeric_flag_is_left_unbounded() -> None:
    unbounded = []
    for prog, path, action in ACTIONS:
        key = (" ".join((prog, *path)), flag_name(action))
        if checked(action) or action.type in FREE_TEXT_TYPES:
            assert key not in ALLOWED_UNBOUNDED, f"{key} is checked now: drop it from the list"
            continue
        if key not in ALLOWED_UNBOUNDED:
            unbounded.append(f"{key[0]} {key[1]} (type={action.type!r})")
    assert not unbounded, (
        "give these flags a bounded type from sarathictl/argtypes.py (or the program's own "
        "helpers), or choices=; or list them in ALLOWED_UNBOUNDED with the reason:\n"
        + "\n".join(unbounded)
    )


@pytest.mark.parametrize(
    "action",
    [
        pytest.param(a, id=f"{prog} {' '.join(path)} {flag_name(a)}")
        for prog, path, a in ACTIONS
        if hasattr(a.type, "bad_values")
    ],
)
def test_every_default_is_within_its_own_flag_rule(action: argparse.Action) -> None:
    default = action.default
    if default is None:
        return
    text = ",".join(map(str, default)) if isinstance(default, tuple | list) else str(default)
    convert = action.type
    assert callable(convert)
    if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
        for item in default:  # each value given is one item (an appended flag: none)
            convert(str(item))
    else:
        convert(text)


def test_the_issue_s_example_reads_as_argparse_s_own_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["generate", "hello", "--max-tokens", "-3"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(
        "sarathictl generate: error: argument --max-tokens: must be at least 1, got -3\n"
    )
    assert main(["bench", "capacity", "--tbt-slo", "0.1", "--granularity", "1.5"]) == 2
    assert "argument --granularity: must be below 1, got 1.5" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        (argtypes.int_at_least(1), "-3", "must be at least 1, got -3"),
        (argtypes.int_at_least(1), "2.5", "must be an integer at least 1, got '2.5'"),
        (argtypes.int_in_range(0, 10), "11", "must be at most 10, got 11"),
        (argtypes.float_above(0.0), "0", "must be above 0, got 0"),
        (argtypes.float_above(0.0), "inf", "must be a number above 0, got 'inf'"),
        (argtypes.float_in(0.0, 1.0, lo_open=True), "x", "must be a number in (0, 1], got 'x'"),
        (argtypes.float_in(0.5, 3600.0), "0.1", "must be at least 0.5, got 0.1"),
        (argtypes.port("off"), "70000", "must be a TCP port in [0, 65535] (0: off), got 70000"),
        (argtypes.one_of("GPU", ["h100", "a100"]), "tpu", "unknown GPU 'tpu'; known: a100, h100"),
        (argtypes.device(), "tpu", "must be cpu, cuda or cuda:N, got 'tpu'"),
    ],
)
def test_helper_messages(kind: object, text: str, message: str) -> None:
    assert callable(kind)
    with pytest.raises(argparse.ArgumentTypeError) as err:
        kind(text)
    assert str(err.value) == message


def test_helpers_return_what_the_commands_use() -> None:
    assert argtypes.int_at_least(0)("7") == 7
    assert argtypes.float_in(0.0, 1.0, lo_open=True)("1") == 1.0
    assert argtypes.port("off")("0") == 0
    assert argtypes.one_of("GPU", ["a100"], {"a100-80gb": "a100"})("A100-80GB") == "a100"
    assert argtypes.comma_list(argtypes.int_at_least(1))("1, 2,3") == (1, 2, 3)
    assert argtypes.comma_list(str, allow_empty=True)("") == ()
    assert argtypes.device()("cuda:1") == "cuda:1"
    slo = argtypes.NumberOrName(argtypes.float_above(0.0), ("strict", "relaxed"))
    assert (slo("strict"), slo("0.5")) == ("strict", 0.5)
