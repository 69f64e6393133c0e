"""`python -m sarathictl.model_prep [DIR]`: the same as `sarathictl model prepare-demo [DIR]`."""

from __future__ import annotations

import sys

from sarathictl.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["model", "prepare-demo", *sys.argv[1:]]))
