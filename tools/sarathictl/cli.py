"""Entry point of `sarathictl`: every command lives in its own module under commands/."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from sarathictl.commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sarathictl",
        description="Operate a sarathi-cluster: serve, generate, inspect, benchmark.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0), or a bad flag that argparse named (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        result: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as err:  # configuration and input errors: one clear line, no traceback
        print(f"sarathictl: error: {err}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    raise SystemExit(main())
