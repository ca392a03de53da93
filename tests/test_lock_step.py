"""Whether clients evaluate every model they train is what the round policy declares
(``Strategy.lock_step``), carried to them in every broadcast header (``BroadcastHeader.asynchronous``),
not a comparison of the ``aggregation`` name: a lock-step rule under another name behaves as sync."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from wafl.cli.sim.simulate import simulate
from wafl.common.config import load_config
from wafl.server.strategies import STRATEGIES, check_aggregation
from wafl.server.strategies.base import register
from wafl.server.strategies.buffered import BufferedStrategy
from wafl.server.strategies.fedasync import FedAsyncStrategy
from wafl.server.strategies.sync import SyncStrategy

TINY = {
    "num_clients": 3,
    "rounds": 4,
    "eval_every": 2,
    "seed": 3,
    "local_epochs": 1,
    "protocol": "compute-and-wait",
    "device": "cpu",
}


def test_the_rules_declare_it() -> None:
    assert SyncStrategy.lock_step
    assert not BufferedStrategy.lock_step and not FedAsyncStrategy.lock_step


@pytest.fixture
def renamed_sync() -> Iterator[str]:
    """Sync's rounds registered under another name, for this test only."""
    register("lockstep-copy")(type("LockStepCopy", (SyncStrategy,), {}))
    try:
        yield "lockstep-copy"
    finally:
        STRATEGIES.remove("lockstep-copy")


def _untimed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in r.items() if not k.endswith("_s") and k not in ("timestamp", "wall", "run_id")} for r in rows
    ]


def test_a_lock_step_rule_under_another_name_evaluates_as_sync(renamed_sync: str) -> None:
    sync = simulate(check_aggregation(load_config(None, TINY)))
    # lock-step: the clients evaluate in the rounds eval_every picks (2 and 4) only
    assert [r["local_accuracy"] is not None for r in sync] == [False, True, False, True]
    copy = simulate(check_aggregation(load_config(None, {**TINY, "aggregation": renamed_sync})))
    assert _untimed(copy) == _untimed(sync)


def test_an_asynchronous_rule_evaluates_every_model_trained() -> None:
    rows = simulate(check_aggregation(load_config(None, {**TINY, "aggregation": "fedasync"})))
    assert len(rows) == 4 and all(r["local_accuracy"] is not None for r in rows)
