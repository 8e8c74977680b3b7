"""The committed gRPC stubs must match what protoc generates from protos/ right now."""

from __future__ import annotations

from pathlib import Path

from tidelog import protogen


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    protogen.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "tidelog" / "v1").iterdir())
    committed_dir = protogen.ROOT / "tidelog" / "v1"
    committed = sorted(
        p.relative_to(protogen.ROOT)
        for p in committed_dir.iterdir()
        if p.name not in {"__init__.py", "__pycache__"}
    )
    assert generated == committed, "stub files differ: run `make protos`"
    for rel in generated:
        assert (tmp_path / rel).read_bytes() == (protogen.ROOT / rel).read_bytes(), (
            f"{rel} is stale: run `make protos` and commit the result"
        )


def test_every_proto_declaration_and_field_is_commented() -> None:
    """The contract is documented where it is defined: each message, enum, service, rpc and
    field has a comment on its line or on the line before."""
    undocumented = []
    for proto in protogen.proto_files():
        lines = proto.read_text().splitlines()
        for number, line in enumerate(lines):
            stripped = line.strip()
            is_decl = stripped.startswith(("message ", "rpc ", "enum ", "service "))
            is_field = (
                "=" in stripped
                and stripped.endswith(";")
                and not stripped.startswith(("//", "syntax", "package", "option"))
            )
            if not (is_decl or is_field):
                continue
            previous = lines[number - 1].strip() if number else ""
            if "//" not in stripped and not previous.startswith("//"):
                undocumented.append(f"{proto.name}:{number + 1}: {stripped}")
    assert not undocumented, "\n".join(undocumented)
