"""`kubernetes` is imported only by the code that talks to the API: the controller's events and
`sarathictl status --kubernetes`; the stage worker, the scheduler and the serving path never load
it (a heavy import, and no business of theirs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ALLOWED = {
    "controller/kube_events.py",
    "tools/sarathictl/kube/connect.py",
    "tools/sarathictl/kube/forward.py",
    "tools/sarathictl/kube/status_cmd.py",
}
_IMPORT = re.compile(r"^\s*(from|import)\s+kubernetes\b", re.MULTILINE)


def test_only_the_kubernetes_modules_import_it() -> None:
    importing = {
        str(path.relative_to(REPO))
        for folder in ("controller", "stage_worker", "tools", "proto")
        for path in (REPO / folder).rglob("*.py")
        if _IMPORT.search(path.read_text(errors="replace"))
    }
    assert importing and importing <= ALLOWED, importing - ALLOWED


def test_worker_scheduler_and_controller_app_load_without_it() -> None:
    code = (
        "import sys\n"
        "import stage_worker.__main__, stage_worker.worker\n"
        "import controller.scheduler, controller.engine, controller.app\n"
        "import sarathictl.cli, sarathictl.commands.status\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes')\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
