"""The README stays a newcomer's entry whose links and architecture map match the tree."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
PACKAGES = ("common", "server", "client", "cli")


def architecture_map() -> str:
    start = README.index("## Architecture")
    block = README[start:].split("```", 2)[1]
    return block


def test_readme_is_short() -> None:
    assert len(README.splitlines()) <= 300


def test_readme_keeps_the_two_commands() -> None:
    assert "\nmake run\nmake test\n" in README


def test_readme_links_resolve() -> None:
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local, "the README links to its docs pages"
    missing = [t for t in local if not (REPO / t).exists()]
    assert missing == []


def test_architecture_map_names_every_module() -> None:
    block = architecture_map()
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", block))
    missing = []
    for package in PACKAGES:
        assert f"{package}/" in block
        for path in sorted((REPO / package).iterdir()):
            if path.name.startswith("__") or path.name == "proto":
                continue
            if path.is_dir() and any(path.glob("*.py")):
                if f"{path.name}/" not in block:
                    missing.append(f"{package}/{path.name}/")
            elif path.suffix == ".py" and path.stem not in words:
                missing.append(f"{package}/{path.name}")
    assert missing == []


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    pages = [p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")]
    assert pages
    assert [p for p in pages if p not in nav] == []
