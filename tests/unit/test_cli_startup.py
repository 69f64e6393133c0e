"""`sarathictl` answers quickly: building its parser loads neither torch nor the controller's
server code, which only the commands that start processes or run a model need. Loading torch
took `sarathictl --help` (and `status`, `generate`) from 1.0 to 4.0 s on a 2-core EPYC."""

from __future__ import annotations

import subprocess
import sys


def test_the_command_line_loads_without_torch_or_the_controller_app() -> None:
    code = (
        "import sys\n"
        "from sarathictl.cli import build_parser\n"
        "build_parser()\n"
        "heavy = ('torch', 'transformers', 'controller.app', 'stage_worker.models')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    assert loaded == "[]"


def test_bench_stage_still_parses_and_names_its_choices() -> None:
    from sarathictl.cli import build_parser

    args = build_parser().parse_args(["bench", "stage", "--random-shape", "mistral-7b"])
    assert (args.dtype, args.decode_batches[-1], args.prefill_chunks[0]) == ("bfloat16", 64, 32)
