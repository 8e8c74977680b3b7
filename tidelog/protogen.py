"""Regenerate the gRPC stubs in ``tidelog/v1/`` from ``protos/tidelog/v1/*.proto``.

``make protos`` runs this module. The generated files are committed (so installing tidelog
needs no protoc), and ``tests/test_protos_fresh.py`` fails when they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "tidelog" / "v1"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Write ``tidelog/v1/*_pb2.py``, ``*_pb2_grpc.py`` and ``*.pyi`` under ``out_dir``."""
    from grpc_tools import protoc  # noqa: PLC0415  (dev-only: imported only when generating)

    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")


def main() -> None:
    generate(ROOT)
    init = ROOT / "tidelog" / "v1" / "__init__.py"
    if not init.exists():
        init.write_text(
            '"""Generated gRPC stubs for tidelog.v1 (do not edit; run make protos)."""\n'
        )
    print(f"generated stubs for {len(proto_files())} protos into tidelog/v1/", file=sys.stderr)


if __name__ == "__main__":
    main()
