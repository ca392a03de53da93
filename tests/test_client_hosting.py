"""The in-process simulation (:mod:`wafl.cli.sim`) reaches :mod:`wafl.client` only through its public interface
for hosts, :mod:`wafl.client.hosting`, and only for the names that module lists in ``__all__``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import wafl.cli.sim
from wafl.client import hosting


def _client_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) of every import of a ``wafl.client`` module in ``wafl.cli.sim``, function-local ones
    included."""
    found = []
    for path in sorted(Path(wafl.cli.sim.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("wafl.client"):
                found += [(path.name, node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(path.name, a.name, "") for a in node.names if a.name.startswith("wafl.client")]
    return found


def test_sim_imports_only_the_public_client_names() -> None:
    found = _client_imports()
    assert found, "wafl.cli.sim builds its clients from wafl.client"
    assert [f for f in found if f[1] != "wafl.client.hosting" or f[2] not in hosting.__all__] == []
    assert {f[2] for f in found} <= set(hosting.__all__)


def test_the_public_names_are_the_clients_own() -> None:
    for name in hosting.__all__:
        obj = getattr(hosting, name)
        home = importlib.import_module(obj.__module__)
        assert obj.__module__.startswith("wafl.client.") and getattr(home, name) is obj
