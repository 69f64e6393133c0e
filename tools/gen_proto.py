"""Regenerates the Python code for proto/sarathi_proto/*.proto (run by `make proto`)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"


def generate(out_dir: Path) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto into out_dir/sarathi_proto."""
    (out_dir / "sarathi_proto").mkdir(parents=True, exist_ok=True)
    protos = sorted(
        str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "sarathi_proto").glob("*.proto")
    )
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {protos}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
