"""The committed generated code matches the .proto sources (run `make proto` when it does not)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "proto" / "sarathi_proto"


def _load_generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("proto", sorted(p.stem for p in GENERATED.glob("*.proto")))
def test_generated_code_is_fresh(proto: str, tmp_path: Path) -> None:
    _load_generator().generate(tmp_path)
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
        fresh = (tmp_path / "sarathi_proto" / f"{proto}{suffix}").read_text()
        committed = (GENERATED / f"{proto}{suffix}").read_text()
        assert committed == fresh, f"{proto}{suffix} is stale: run `make proto`"


def test_every_field_is_documented() -> None:
    # The contracts are read by people: every field carries a comment on the line above or
    # beside it (the unit where it has one).
    for proto in GENERATED.glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = (
                stripped.endswith(";")
                and "=" in stripped
                and not stripped.startswith(("option", "syntax", "package", "//"))
            )
            if not is_field or "FINISH_REASON" in stripped:
                continue
            above = lines[i - 1].strip()
            documented = "//" in stripped or above.startswith("//")
            assert documented, f"{proto.name}:{i + 1} has no comment: {stripped}"
