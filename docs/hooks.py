"""mkdocs hook: the API reference reads the source as the package ``wafl`` it installs as.

The repository keeps the design card's top-level folders (``common/``, ``server/``, ...), which
the installed package maps to ``wafl.common``, ``wafl.server``, ...; mkdocstrings reads source
files, so this hook lays out ``build/api-src/wafl/`` as links to those folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "server", "client", "cli")


def layout() -> None:
    """Lays out ``build/api-src/wafl/`` (idempotent)."""
    package = ROOT / "build" / "api-src" / "wafl"
    package.mkdir(parents=True, exist_ok=True)
    # A regular package, so that the console script ``bin/wafl`` on the path is not merged into it.
    (package / "__init__.py").write_text('"""wafl: wait-free federated learning over gRPC."""\n')
    for name in PACKAGES:
        link = package / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)


# When mkdocs loads this file, while it reads mkdocs.yml: before mkdocstrings sets up its search paths, which
# leave out a folder that does not exist yet (laid out in on_config only, a fresh clone's first build failed).
layout()


def on_config(config: Any) -> Any:
    layout()
    return config
