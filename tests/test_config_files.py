"""Every configuration file under ``configs/`` and every point of every sweep file under ``configs/sweeps/``
loads as it is (the rule checked as ``wafl run`` and ``wafl sweep`` check it), and the ``config.json`` each
would write holds the closed-set fields as the plain strings of the file."""

from __future__ import annotations

import dataclasses
import enum
import json
import tomllib
from pathlib import Path

import pytest
from wafl.cli.experiments.sweep import load_sweep
from wafl.common.config import ConfigError, RunConfig, load_config
from wafl.common.datasets import DATASETS
from wafl.server.strategies import check_aggregation

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SWEEPS = sorted((CONFIGS / "sweeps").glob("*.toml"))
FILES = sorted(p for p in CONFIGS.rglob("*") if p.suffix in (".toml", ".json") and p.parent != CONFIGS / "sweeps")


def _written_as_before(cfg: RunConfig) -> None:
    """``config.json`` (``to_json``) is the text the plain strings give, and reads back to the same configuration."""
    values = {f.name: getattr(s, f.name) for s in vars(cfg).values() for f in dataclasses.fields(s)}
    closed = [k for k, v in values.items() if isinstance(v, enum.Enum)]
    assert closed, "no closed-set field holds its member after validation"
    plain = {k: v.value if isinstance(v, enum.Enum) else v for k, v in values.items()}
    assert cfg.to_json() == json.dumps(plain, sort_keys=True)
    assert all(type(json.loads(cfg.to_json())[k]) is str for k in closed)
    again = check_aggregation(RunConfig.from_json(cfg.to_json()).validate())
    assert again.to_json() == cfg.to_json()


def test_there_are_files_to_load() -> None:
    assert len(FILES) >= 10 and len(SWEEPS) >= 10


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_configuration_file_loads(path: Path) -> None:
    cfg = check_aggregation(load_config(path))
    raw = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
    plain = json.loads(cfg.to_json())
    assert {k: plain[k] for k in raw if k != "params"} == {k: v for k, v in raw.items() if k != "params"}
    _written_as_before(cfg)


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_every_sweep_point_loads(path: Path) -> None:
    spec = tomllib.loads(path.read_text())
    while "dataset" not in spec.get("base", {}) and "extends" in spec:  # a longer run of another sweep
        spec = tomllib.loads((path.parent / spec["extends"]).read_text())
    dataset = spec["base"].get("dataset", "digits")
    if dataset not in DATASETS:  # a sweep for a dataset this checkout does not have: refused by name
        with pytest.raises(ConfigError, match=f"dataset={dataset!r} is not one of"):
            load_sweep(path)
        return
    _, points = load_sweep(path)
    assert points
    for _, cfg in points:
        _written_as_before(cfg)
