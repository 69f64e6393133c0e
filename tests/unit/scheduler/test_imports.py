"""The scheduler core's imports: pure (the standard library and numpy, nothing with side
effects: no torch, zmq, grpc or clock of its own), and one-way inside the package, type-only
imports included, so each module can be read knowing only those below it."""

from __future__ import annotations

import ast
import graphlib
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "controller" / "scheduler"
ALLOWED_OUTSIDE = {"numpy"}
# Pure, but no business of a scheduler that is handed its `now`.
FORBIDDEN_STDLIB = {"time", "os", "socket", "threading", "asyncio", "subprocess", "random"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module the file imports, at run time or for types only."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from controller.scheduler.policies import sarathi` names a module too.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def package_graph() -> dict[str, set[str]]:
    modules = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    return {
        name: {i for i in imported if i in modules and i != name}
        for name, imported in modules.items()
    }


def test_the_core_imports_only_the_standard_library_and_numpy() -> None:
    outside = {
        imported.split(".")[0]
        for path in PACKAGE.rglob("*.py")
        for imported in imports_of(path)
        if not imported.startswith("controller.scheduler")
    }
    assert "controller" not in outside  # nothing of the controller around it
    third_party = outside - set(sys.stdlib_module_names) - {"__future__"}
    assert third_party <= ALLOWED_OUTSIDE, third_party - ALLOWED_OUTSIDE
    assert not outside & FORBIDDEN_STDLIB, outside & FORBIDDEN_STDLIB


def test_imports_inside_the_package_run_one_way() -> None:
    graph = package_graph()
    # The package's __init__ re-exports; leaving it out, modules import each other directly.
    graph.pop("controller.scheduler", None)
    for imported in graph.values():
        imported.discard("controller.scheduler")
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the circle


def test_the_batch_builder_sees_the_scheduler_only_through_its_protocol() -> None:
    graph = package_graph()
    assert "controller.scheduler.scheduler" not in graph["controller.scheduler.batch_builder"]
    assert "controller.scheduler.scheduler_state" in graph["controller.scheduler.batch_builder"]
