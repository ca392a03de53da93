"""A new aggregation rule, staleness function or robust center is one file with its registration line: each
is picked up by name through the normal entry points (``check_aggregation``, ``make_strategy``, the
accumulator, an in-process run), and an unknown name is refused naming the field and every known name."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from strategy_checks import make, state, upload
from wafl.cli.sim.simulate import simulate
from wafl.common.codec import iter_chunks, manifest_of
from wafl.common.config import ConfigError, load_config
from wafl.server.aggregation.accumulator import Accumulator
from wafl.server.aggregation.robust import ROBUST_CENTERS
from wafl.server.aggregation.rule import Rule
from wafl.server.staleness import STALENESS
from wafl.server.strategies import STRATEGIES, check_aggregation, strategy_class

PLUGIN = '''"""A rule, a staleness function and a robust center, each registered by its line in this one file."""

from wafl.server.aggregation.robust import register as register_center
from wafl.server.staleness import STALENESS, StalenessFunction
from wafl.server.strategies.base import register as register_rule
from wafl.server.strategies.buffered import BufferedStrategy

CALLS = []  # what the run called: "rule", "staleness", "center"


@register_rule("buffered-copy")
class BufferedCopy(BufferedStrategy):
    """Buffered aggregation under another name."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CALLS.append("rule")


@STALENESS.register("halving")
class Halving(StalenessFunction):
    """``s(k) = 2^-k``."""

    def __call__(self, k):
        CALLS.append("staleness")
        return 0.5**k


def _one_is_too_few(trim, uploads):
    return f"aggregator=midrange of {uploads} upload is that upload" if uploads < 2 else None


@register_center("midrange", refuse=_one_is_too_few)
def midrange(values, trim):
    """The middle of each coordinate's smallest and largest value."""
    CALLS.append("center")
    return (values.min(axis=0) + values.max(axis=0)) / 2
'''

BASE = {"num_clients": 3, "aggregation": "buffered-copy", "staleness": "halving", "aggregator": "midrange"}


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The file above imported from a temporary folder; its registrations are undone afterwards."""
    (tmp_path / "wafl_test_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield importlib.import_module("wafl_test_plugin")
    finally:
        STRATEGIES.remove("buffered-copy")
        STALENESS.remove("halving")
        ROBUST_CENTERS.remove("midrange")
        sys.modules.pop("wafl_test_plugin", None)


def test_each_is_picked_up_by_name_through_the_entry_points(plugin: ModuleType) -> None:
    cfg = check_aggregation(load_config(None, {**BASE, "buffer_size": 2, "staleness_a": 0.7, "staleness_b": 3}))
    assert strategy_class(cfg) is plugin.BufferedCopy and plugin.BufferedCopy.name == "buffered-copy"
    s = make(**BASE, buffer_size=2, staleness_a=0.7, staleness_b=3)  # make_strategy, as the engine makes it
    assert isinstance(s, plugin.BufferedCopy)
    weight = s.config.staleness
    assert isinstance(weight, plugin.Halving) and (weight.a, weight.b) == (0.7, 3)  # built from the settings
    assert s.fold_weight(10, {}, 2) == 0.25  # the rule weighs uploads with it (uniform: s(age))
    # the accumulator of the configuration's aggregator combines the uploads with the new center
    states = [state(i) for i in range(3)]
    acc = Accumulator(manifest_of(states[0]), rule=Rule(center=cfg.security.aggregator))
    specs = {sp.name: sp for sp in acc.manifest}
    for st in states:
        fold = acc.begin(1.0)
        for c in iter_chunks(st.items(), 16):
            fold.add(specs[c.name], c)
        fold.commit()
    got = acc.center()
    for k in states[0]:
        stack = torch.stack([st[k] for st in states]).double().numpy()
        np.testing.assert_allclose(got[k].double().numpy(), (stack.min(0) + stack.max(0)) / 2, rtol=1e-6)
    # its refusal is asked where the configuration is checked
    with pytest.raises(ConfigError, match="aggregator=midrange of 1 upload is that upload"):
        check_aggregation(load_config(None, {**BASE, "buffer_size": 1}))


def test_an_update_is_weighted_by_the_new_staleness_function(plugin: ModuleType) -> None:
    """FedBuff's step ``x + sum_i s(age_i) delta_i / K`` with the new ``s(k) = 2^-k``: c's update from version
    1 goes into the buffer of version 2 with weight 1/2, a's from version 2 with weight 1."""
    s = make(aggregation="buffered", staleness="halving", buffer_size=2)
    s.start(0.0)
    x1, da, db, dc = state(0), state(1), state(2), state(3)
    upload(s, "a", 1, da)
    upload(s, "b", 1, db)
    x2, _, _ = s.aggregate(x1, s.close(1.0))
    s.published(2.0)
    upload(s, "c", 1, dc)
    upload(s, "a", 2, da)
    x3, _, row = s.aggregate(x2, s.close(3.0))
    assert row["staleness_max"] == 1
    for k in x1:
        want = x2[k].double() + (0.5 * dc[k].double() + da[k].double()) / 2
        np.testing.assert_allclose(x3[k].double().numpy(), want.numpy(), atol=1e-6)


def test_each_serves_an_in_process_run(plugin: ModuleType) -> None:
    """A run of the new rule with the new staleness function and center (``simulate``): each is called."""
    cfg = load_config(
        None,
        {
            **BASE,
            "buffer_size": 2,
            "rounds": 2,
            "seed": 1,
            "local_epochs": 1,
            "protocol": "compute-and-wait",
            "device": "cpu",
        },
    )
    rows = simulate(check_aggregation(cfg))
    assert [r["version"] for r in rows] == [2, 3]
    assert {"rule", "staleness", "center"} <= set(plugin.CALLS)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"aggregation": "nope"}, "aggregation='nope' is not one of ['buffered', 'buffered-copy', 'fedasync', 'sync']"),
        (
            {"aggregation": "buffered", "staleness": "nope"},
            "staleness='nope' is not one of ['constant', 'halving', 'hinge', 'poly', 'sqrt']",
        ),
        ({"aggregator": "nope"}, "aggregator='nope' is not one of ['mean', 'trimmed_mean', 'median', 'midrange']"),
    ],
)
def test_an_unknown_name_is_refused_naming_the_field_and_the_known_names(
    plugin: ModuleType, override: dict, message: str
) -> None:
    with pytest.raises(ConfigError) as e:
        check_aggregation(load_config(None, {"num_clients": 3, **override}))
    assert str(e.value) == message


RULE_FILE = '''from wafl.server.strategies.base import register
from wafl.server.strategies.sync import SyncStrategy


@register("sync-copy")
class SyncCopy(SyncStrategy):
    """Sync's rounds under another name."""
'''

STALENESS_FILE = """from wafl.server.staleness.base import STALENESS, StalenessFunction


@STALENESS.register("halving")
class Halving(StalenessFunction):
    def __call__(self, k):
        return 0.5**k
"""

ALGORITHM_FILE = """from wafl.common.algorithms.base import Algorithm
from wafl.common.algorithms.params import NoParams
from wafl.common.algorithms.registry import register

register("fedavg-copy", NoParams, lambda p, run: Algorithm("fedavg-copy"))
"""

CHECK = """
import sys
import wafl.common.algorithms, wafl.server.staleness, wafl.server.strategies

# as if each file were in its package's folder: nothing imports them, the registries find them
wafl.server.strategies.__path__.append(sys.argv[1])
wafl.server.staleness.__path__.append(sys.argv[2])
wafl.common.algorithms.__path__.append(sys.argv[3])
from wafl.common.algorithms import registry
from wafl.common.config import load_config
from wafl.server.strategies import check_aggregation, strategy_class
from wafl.server.strategies.buffered import BufferedConfig

rule = strategy_class(check_aggregation(load_config(None, {"num_clients": 3, "aggregation": "sync-copy"})))
cfg = check_aggregation(load_config(None, {"num_clients": 3, "aggregation": "buffered", "staleness": "halving"}))
weight = BufferedConfig.of(cfg).staleness
algorithm = load_config(None, {"num_clients": 3, "algorithm": "fedavg-copy"})
built = registry.resolve(algorithm.training.algorithm, algorithm.training.params, algorithm.to_dict())
print(rule.__module__, rule.name, type(weight).__module__, weight(3), built.name)
"""


def test_a_file_in_the_package_is_all_it_takes(tmp_path: Path) -> None:
    """A rule file among the rules', a staleness file among the staleness functions' and an algorithm file
    among the algorithms' are found by the registries on their first read, in a fresh interpreter (no list
    names them, no test imports them)."""
    for folder in ("rules", "staleness", "algorithms"):
        (tmp_path / folder).mkdir()
    (tmp_path / "algorithms" / "fedavg_copy.py").write_text(ALGORITHM_FILE)
    (tmp_path / "rules" / "sync_copy.py").write_text(RULE_FILE)
    (tmp_path / "staleness" / "halving.py").write_text(STALENESS_FILE)
    out = subprocess.run(
        [sys.executable, "-c", CHECK, *(str(tmp_path / f) for f in ("rules", "staleness", "algorithms"))],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "wafl.server.strategies.sync_copy",
        "sync-copy",
        "wafl.server.staleness.halving",
        "0.125",
        "fedavg-copy",
    ]
