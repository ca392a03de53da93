"""Generates the Python protobuf/gRPC code in ``common/proto/`` from ``protos/wafl/v1/*.proto``.

Run ``python -m wafl.common.protogen`` after editing a ``.proto`` file. The generated modules
import each other relatively (``from . import federation_pb2``) so they live inside
``wafl.common.proto`` instead of claiming a top-level ``wafl.v1`` package.
``tests/test_protos.py`` regenerates into a temporary folder and fails on any difference.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
OUT_DIR = REPO / "common" / "proto"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "wafl" / "v1").glob("*.proto"))


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Writes ``<name>_pb2.py``, ``<name>_pb2.pyi`` and ``<name>_pb2_grpc.py`` into ``out_dir``."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        include = str(Path(grpc_tools.__file__).parent / "_proto")
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for src in sorted((Path(tmp) / "wafl" / "v1").iterdir()):
            text = src.read_text()
            text = re.sub(r"^from wafl\.v1 import (\w+)", r"from . import \1", text, flags=re.M)
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated protobuf and gRPC code for protos/wafl/v1 (python -m wafl.common.protogen)."""\n')
    written.append(init)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(path)
