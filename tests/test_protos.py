"""The generated protobuf code in common/proto is exactly what protos/ generates."""

from pathlib import Path

from wafl.common import protogen


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    fresh = {p.name: p.read_text() for p in protogen.generate(tmp_path)}
    committed = {p.name: p.read_text() for p in protogen.OUT_DIR.iterdir() if p.suffix in (".py", ".pyi")}
    assert set(fresh) == set(committed), "run: python -m wafl.common.protogen"
    for name, text in fresh.items():
        assert committed[name] == text, f"{name} is stale: run python -m wafl.common.protogen"
