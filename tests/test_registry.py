"""wafl.common.registry: a kind's things register from their own files, read on first use."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from wafl.common.registry import Registry


def _package(root: Path, name: str, files: dict[str, str]) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(
        f"from wafl.common.registry import Registry\nTHINGS = Registry('thing', {name!r})\n"
    )
    for module, body in files.items():
        (root / name / f"{module}.py").write_text(f"from {name} import THINGS\n{body}")


def test_the_package_files_register_themselves_on_first_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _package(
        tmp_path,
        "regpkg_a",
        {
            "one": "@THINGS.register('one')\ndef one():\n    return 1\n",
            "two": "@THINGS.register('two')\n@THINGS.register('deux')\ndef two():\n    return 2\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import regpkg_a

    assert "regpkg_a.one" not in sys.modules  # nothing imported before the registry is read
    assert regpkg_a.THINGS.names() == ["deux", "one", "two"]
    assert regpkg_a.THINGS.lookup("deux")() == 2 and regpkg_a.THINGS["one"]() == 1
    assert sorted(regpkg_a.THINGS) == ["deux", "one", "two"] and len(regpkg_a.THINGS) == 3 and "one" in regpkg_a.THINGS
    with pytest.raises(ValueError, match=r"thing='three' is not one of \['deux', 'one', 'two'\]"):
        regpkg_a.THINGS.lookup("three")


def test_a_name_claimed_by_two_files_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = "@THINGS.register('same')\ndef f():\n    return 0\n"
    _package(tmp_path, "regpkg_b", {"a": body, "b": body})
    monkeypatch.syspath_prepend(str(tmp_path))
    import regpkg_b

    with pytest.raises(ValueError, match="thing 'same' is registered twice"):
        regpkg_b.THINGS.names()


def test_a_registry_without_a_package_holds_what_was_added() -> None:
    reg: Registry[int] = Registry("number")
    reg.add("a", 1)
    reg.add("a", 1)  # the same thing again: a module imported twice under one name
    assert dict(reg) == {"a": 1}
    with pytest.raises(ValueError, match="number='b' is not one of \\['a'\\]"):
        reg.lookup("b")
    reg.remove("a")  # a test's own registration, undone
    reg.remove("a")  # an unknown name: nothing to undo
    assert dict(reg) == {}


def test_datasets_and_models_are_registered_by_their_files() -> None:
    from wafl.common.datasets import DATASETS
    from wafl.common.models import MODELS

    assert {"digits", "fashion-mnist", "cifar10", "synthetic-digits"} <= set(DATASETS)
    assert {"cnn", "lenet5", "resnet18", "shufflenetv2"} <= set(MODELS)


def test_rules_and_staleness_functions_are_registered_by_their_files() -> None:
    from wafl.server.staleness import STALENESS
    from wafl.server.strategies import STRATEGIES

    assert STRATEGIES.names() == ["buffered", "fedasync", "sync"]
    assert all(STRATEGIES[name].name == name for name in STRATEGIES)
    assert STALENESS.names() == ["constant", "hinge", "poly", "sqrt"]
    assert {name: STALENESS[name].__module__ for name in STALENESS} == {
        name: f"wafl.server.staleness.{name}" for name in STALENESS
    }
