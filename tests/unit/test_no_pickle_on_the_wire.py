"""Nothing the runtime receives is decoded with pickle or eval: the runtime packages' own code
never imports pickle (or its relatives) nor calls eval/exec/torch.load without weights_only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_PACKAGES = ("controller", "stage_worker", "proto/sarathi_proto")
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}


def runtime_files() -> list[Path]:
    return sorted(p for pkg in RUNTIME_PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def offences(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(node.module)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if isinstance(func, ast.Name) and name in ("eval", "exec"):
                found.append(f"{name}()")
            if name == "load" and isinstance(func, ast.Attribute):
                owner = func.value
                if isinstance(owner, ast.Name) and owner.id == "torch":
                    weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                    if (
                        not weights_only
                        or getattr(weights_only[0].value, "value", None) is not True
                    ):
                        found.append("torch.load() without weights_only=True")
    return found


def test_the_scan_catches_what_it_looks_for() -> None:
    bad = "import pickle\nfrom cloudpickle import loads\neval('1')\nimport torch\ntorch.load(f)\n"
    assert offences(bad) == [
        "pickle",
        "cloudpickle",
        "eval()",
        "torch.load() without weights_only=True",
    ]


@pytest.mark.parametrize("path", runtime_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_runtime_code_never_unpickles(path: Path) -> None:
    assert offences(path.read_text()) == [], f"{path.relative_to(ROOT)} may unpickle"
